"""Proposers: who guesses the draft tokens each step verifies.

Before a step is scheduled, `propose(running)` sets `spec_token_ids` on each running
request that is decoding (all its tokens known, one to compute); the scheduler fits as
many as the step has room for. A proposer that draws its drafts from a distribution
(a draft model) hands those distributions to the verify step through `draft_probs`;
n-gram drafts are point masses and have none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import jax

from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.ngram import NgramIndex
from scheduler import Request, StepBatch

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import StepHandle


class Proposer(Protocol):
    # Whether steps without drafts may run in the overlapped loop (then the engine asks
    # wants_known_tokens before each step). A proposer that follows every step on the
    # device (a draft model's or a head's KV cache) needs each step's tokens: False.
    overlaps: bool

    def wants_known_tokens(self, running: list[Request]) -> list[tuple[Request, int]]:
        """The requests whose newest token is still on the device that would draft next
        step, with about how many drafts: where that pays, the engine waits for the step
        in flight before proposing."""

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` of the running requests to draft for."""

    def draft_probs(self, batch: StepBatch) -> jax.Array | None:
        """f32 [R, k, V]: what the batch's drafts were drawn from, by row (None: point masses)."""

    def follow(self, batch: StepBatch, handle: StepHandle) -> None:
        """The target has dispatched `batch` (a draft model writes the same tokens' K/V)."""


def decoding(running: list[Request], config: SpeculativeConfig) -> list[Request]:
    """The requests to propose for: decoding, with room for a draft token, only while the
    batch is small enough (disable_by_batch_size), and, for chains with a draft_token_cost,
    only those whose own acceptance makes a draft pay (each gets its `max_drafts`)."""
    for req in running:
        req.spec_token_ids = []
    return _may_draft(running, config, pending=False)


def awaiting_token(running: list[Request], config: SpeculativeConfig) -> list[Request]:
    """The requests `decoding` would propose for once their newest token, still on the
    device (a step in flight), reaches the host."""
    return _may_draft(running, config, pending=True)


def _may_draft(running: list[Request], config: SpeculativeConfig, pending: bool) -> list[Request]:
    if config.disable_by_batch_size is not None and len(running) > config.disable_by_batch_size:
        return []
    adaptive = config.draft_token_cost is not None and config.speculative_token_tree is None
    out = []
    for r in running:
        if not (
            r.num_tokens - r.num_computed_tokens == 1
            and (r.num_pending > 0) == pending
            and r.num_output_tokens + 1 < r.sampling_params.max_tokens
        ):
            continue
        if adaptive:  # one decision per step, whether asked before the token arrives or after
            r.max_drafts = r.draft_length.length(config.num_speculative_tokens, config.draft_token_cost, r.num_tokens)
            if r.max_drafts == 0:
                continue
        out.append(r)
    return out


def reserve_draft_slots(kv, requests: list[Request], k: int, max_model_len: int) -> list[Request]:
    """The requests that got slots for their last token and up to k drafts, reserved now (the
    proposer writes them before the step is scheduled), never past the context: a request at
    its end gets its last token's slot only (its drafts there write to the null block).
    `kv`: the scheduler's KVCacheManager."""
    return [r for r in requests if kv.allocate_slots(r, 1 + max(0, min(k, max_model_len - r.num_tokens))) is not None]


def sampled_rows(batch: StepBatch) -> dict[str, int]:
    """Request id -> row, for the rows of `batch` that sample a token: where a head finds
    the hidden state of each request's newest token (a request not in the step has none)."""
    return {rid: row for row, (rid, samples) in enumerate(zip(batch.request_ids, batch.samples.tolist())) if samples}


class NgramProposer:
    """Prompt lookup in each request's own tokens (see spec_decode.ngram), through an index
    per running request that is fed only the tokens that arrived since the last step.

    It keeps nothing on the device, so the engine's loop stays overlapped while no request
    is copying: before each step it asks `wants_known_tokens`, which looks up the suffix
    the host knows (all but the token in flight). A suffix that matched one step ago most
    likely still matches with the next token, so the engine waits for that token (and
    drafts) only there; in free text, where most lookups find nothing, steps overlap as
    without speculation. A copy that begins is noticed one step late."""

    overlaps = True

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.indexes: dict[str, NgramIndex] = {}

    def wants_known_tokens(self, running: list[Request]) -> list[tuple[Request, int]]:
        drafting = ((req, len(self._lookup(req))) for req in awaiting_token(running, self.config))
        return [(req, n) for req, n in drafting if n]

    def propose(self, running: list[Request]) -> None:
        for req in decoding(running, self.config):
            req.spec_token_ids = self._lookup(req)
        ids = {r.request_id for r in running}  # forget finished and preempted requests (rebuilt on resume)
        self.indexes = {rid: index for rid, index in self.indexes.items() if rid in ids}

    def _lookup(self, req: Request) -> list[int]:
        """Drafts to follow the request's known tokens."""
        c = self.config
        index = self.indexes.get(req.request_id)
        if index is None or len(index) > len(req.all_token_ids):
            index = self.indexes[req.request_id] = NgramIndex(min(c.prompt_lookup_min, 2))
        index.extend(req.all_token_ids[len(index) :])
        return index.propose(c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max)

    def draft_probs(self, batch: StepBatch) -> None:
        return None

    def follow(self, batch: StepBatch, handle: StepHandle) -> None:
        pass
