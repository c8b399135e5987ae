"""EAGLE: a one-layer head drafts from the target's hidden states and the tokens after them.

EAGLE-3 (`heads.Eagle3Head`) runs the same way: its features are the inputs of a few target
layers side by side (the runner's `step_features`) brought to D by its fc; h below is that.

The head's entry at position i reads (h_i, x_{i+1}): the target's hidden state there and
the token that follows, and predicts h_{i+1}, whose logits (the target's own norm and LM
head) guess x_{i+2}. Its layer keeps a one-layer paged KV cache with the target's block
ids, so prefix hits, copy-on-write copies and rollback by `num_computed_tokens` carry over
as they do for a draft model.

After each target step (`follow`), one jitted call writes the entries of the step's tokens:
every token's hidden state, the next token in the step beside it, and at each row's last
accepted position the token just sampled there (still on the device). It keeps that
position's output f, the guess of h at the new last token. Before the next step
(`propose`), one jitted call drafts a chain for every decoding request:

    position:     L-1          | L            L+1          ...
    entry:        (h, x_L)     | (f_L, d_1)   (f_L+1, d_2)
    output:       f_L -> d_1   | f_L+1 -> d_2 f_L+2 -> d_3         (x_L: the token just sampled)

Drafts are the argmax (point masses), so verification stays exact for sampled requests.
The draft entries at L, L+1 ... are overwritten with the target's real hidden states by
the next `follow`; entries past an accepted path are never read before they are rewritten.

NOTE: a prefix-cache hit reuses the head's entry at the last cached position, written by
the request that computed it with its own next token; that costs a little draft quality
where prompts diverge right after a block boundary, never correctness.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.inputs import ModelInputs
from jaxserve.model.kv_cache import allocate_kv_cache, copy_blocks
from jaxserve.runner.model_runner import copy_pairs
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.context import ProposerContext
from jaxserve.spec_decode.proposers import decoding, reserve_draft_slots, sampled_rows
from jaxserve.spec_decode.published_heads import load_draft_heads
from scheduler import Request, StepBatch

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import StepHandle


class EagleProposer:
    overlaps = False  # the head's KV cache follows every step's hidden states (follow)

    def __init__(self, config: SpeculativeConfig, context: ProposerContext):
        self.dtype = context.model.dtype
        head = load_draft_heads(config.model, context.model_config, self.dtype, config.method)
        self.feature_layers = head.feature_layers  # EAGLE-3: the target layers' inputs, else its last hidden state
        self.config, self.scheduler, self.target = config, context.scheduler, context.runner
        target = self.target
        self.head_def, params = nnx.split(head)
        self.params = nnx.to_pure_dict(jax.device_put(params, target.replicated))  # see ModelRunner.params
        kv = allocate_kv_cache(head.cfg, target.kv.num_blocks, target.block_size, context.kv_dtype)
        self.kv = jax.device_put(kv, target.replicated)
        # The target's XLA options (jaxserve.runner.compile_options).
        jit = functools.partial(jax.jit, compiler_options=target.compiler_options)
        self._follow = jit(self._follow_fn, donate_argnames=("kv",))
        self._ends = jit(_ends_fn)
        self._propose = jit(self._propose_fn, donate_argnames=("kv",))
        self._copy_blocks = jit(copy_blocks, donate_argnames=("kv",))
        # By row of the latest step: the head's guess of h at each row's new last token.
        self._features = jax.device_put(
            np.zeros((target.max_num_seqs, head.cfg.hidden_size), self.dtype), target.replicated
        )
        self._rows: dict[str, int] = {}  # request id -> its row in the latest step, if it sampled there
        if context.warm_up:
            self.warm_up()

    def warm_up(self) -> None:
        """Compile `follow` for every token bucket and the ends and `propose` for every row bucket."""
        target = self.target
        none = np.full(target.max_num_seqs, 0, np.int32)  # no row's ends (T = 0: none below it)
        for t in target.buckets:
            inputs, _ = target.pad_inputs(None, *target.bucket_for(t))
            width = target.config.hidden_size * max(1, len(self.feature_layers))
            hidden = jax.device_put(np.zeros((t, width), self.dtype), target.replicated)
            self._write(inputs, hidden, none + t, np.ones(1, np.int32))
        for r in target.row_buckets:
            self._ends(none, jax.device_put(np.ones(r, np.int32), target.replicated), np.int32(0))
            self._draft([], r)
        self.kv = self._copy_blocks(self.kv, copy_pairs([], target.max_num_seqs))
        jax.block_until_ready(self.kv)

    # -- the proposer interface ------------------------------------------------------------

    def propose(self, running: list[Request]) -> None:
        kv, k = self.scheduler.kv, self.config.num_speculative_tokens
        # Drafting writes the head's entries up to L + k - 2: reserve the step's slots now (or skip).
        drafting = [r for r in decoding(running, self.config) if r.request_id in self._rows]
        requests = reserve_draft_slots(kv, drafting, k, self.target.max_model_len)
        if requests:
            for req, tokens in zip(requests, self._draft(requests, self.target.rows_for(len(requests)))):
                req.spec_token_ids = tokens

    def draft_probs(self, batch: StepBatch) -> None:
        return None

    def follow(self, batch: StepBatch, handle: StepHandle) -> None:
        """Write the head's entries for the target's step just dispatched (on the device)."""
        if batch.block_copies:
            self.kv = self._copy_blocks(self.kv, copy_pairs(batch.block_copies, self.target.max_num_seqs))
        target, m = self.target, batch.num_seqs
        t = target.step_inputs.input_ids.shape[0]
        # Each row's first verified position; rows that sample nothing: T (their last entry's
        # next token is the prompt's, below).
        first = np.full(target.max_num_seqs, t, np.int32)
        first[:m] = np.where(batch.samples, batch.logits_indices - batch.num_spec_tokens, t)
        counts = handle.out.num_tokens if batch.verify is not None else np.ones(target.rows_for(m), np.int32)
        hidden = target.step_features if self.feature_layers else target.step_hidden
        self._write(target.step_inputs, hidden, first, counts, batch)
        self._rows = sampled_rows(batch)

    # -- the jitted parts ------------------------------------------------------------------

    def _write(self, inputs: ModelInputs, hidden, first: np.ndarray, counts, batch: StepBatch | None = None) -> None:
        """Run `_follow` on a step's inputs (no batch: warm-up)."""
        t = inputs.input_ids.shape[0]
        next_ids = np.zeros(t, np.int32)
        if batch is not None:
            n = batch.num_tokens
            next_ids[: n - 1] = batch.input_ids[1:n]  # within a row; each row's last is set below
            ends = batch.query_start_loc[1:] - 1
            for row in np.flatnonzero(~batch.samples):  # a prefill chunk: the prompt's next token
                req = self.scheduler.requests[batch.request_ids[row]]
                next_ids[ends[row]] = req.all_token_ids[batch.positions[ends[row]] + 1]
        device = self.target.replicated
        ends = self._ends(first, jax.device_put(counts, device), np.int32(t))
        self.kv, self._features = self._follow(
            self.params,
            self.target.params,
            self.kv,
            hidden,
            inputs,
            next_ids,
            jax.device_put(ends, device),
            self.target.last_tokens,
        )

    def _follow_fn(self, params, target_params, kv, hidden, inputs: ModelInputs, next_ids, ends, last_tokens):
        """The head over a step's T tokens; its outputs at `ends` [max_num_seqs] (T: none), by row."""
        head, target = nnx.merge(self.head_def, params), nnx.merge(self.target.graphdef, target_params)
        next_ids = next_ids.at[ends].set(last_tokens, mode="drop")
        f, kv = head(target, head.target_features(target, hidden), next_ids, inputs, kv, self.target.attention)
        return kv, f[jnp.minimum(ends, f.shape[0] - 1)]

    def _draft(self, requests: list[Request], rows: int) -> list[list[int]]:
        """k drafts for each request (padding to `rows` rows, which write to the null block)."""
        positions = np.zeros(rows, np.int32)
        feature_rows = np.zeros(rows, np.int32)
        tables = np.zeros((rows, self.target.max_blocks_per_seq), np.int32)
        for i, req in enumerate(requests):
            positions[i], feature_rows[i] = req.num_tokens - 1, self._rows[req.request_id]
            table = self.scheduler.kv.block_ids(req.request_id)[: tables.shape[1]]
            tables[i, : len(table)] = table
        drafts, self.kv = self._propose(
            self.params, self.target.params, self.kv, self._features, feature_rows, positions, tables
        )
        return np.asarray(drafts)[: len(requests)].tolist()

    def _propose_fn(self, params, target_params, kv, features, feature_rows, positions, tables):
        """i32 [R, k]: the greedy chain from each row's feature; entries at positions .. + k - 2."""
        head, target = nnx.merge(self.head_def, params), nnx.merge(self.target.graphdef, target_params)
        bs, max_len = self.target.block_size, self.target.max_model_len
        rows = positions.shape[0]
        row_ids = jnp.arange(rows, dtype=jnp.int32)
        f = features[feature_rows]
        drafts = [head.draft_ids(target, f)]
        for _ in range(self.config.num_speculative_tokens - 1):
            block = tables[row_ids, jnp.minimum(positions // bs, tables.shape[1] - 1)]
            slots = jnp.where(positions < max_len, block * bs + positions % bs, 0)  # past the context: the null block
            inputs = ModelInputs(
                drafts[-1], positions, slots, jnp.arange(rows + 1, dtype=jnp.int32), positions + 1, tables, row_ids
            )
            f, kv = head(target, f, drafts[-1], inputs, kv, self.target.attention)
            drafts.append(head.draft_ids(target, f))
            positions = positions + 1
        return jnp.stack(drafts, axis=1), kv


def _ends_fn(first, counts, t):
    """Flat index of each row's last accepted token: its first verified one + count - 1 (T: none)."""
    counts = jnp.ones_like(first).at[: counts.shape[0]].set(counts)
    return jnp.where(first < t, first + counts - 1, t)
