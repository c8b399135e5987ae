"""Medusa: k heads on the target's last hidden state guess the k tokens after the next.

Each step the runner keeps, per row, the hidden state the row's last token was drawn
from (`ModelRunner.last_hidden`). Before the next step, one jitted call runs the heads on
those of the decoding requests and takes each head's top candidates; a draft tree is
filled from them: the node at depth d with path ranks (r_1 .. r_d) gets head d's
candidate of rank r_d (Medusa's Cartesian tree; a chain takes every head's first). The
drafts are deterministic given the context, so verification treats them as point masses
and stays exact for sampled requests too. Published Medusa-1 heads load as they are
(`published_heads`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.context import ProposerContext
from jaxserve.spec_decode.proposers import decoding, sampled_rows
from jaxserve.spec_decode.published_heads import load_draft_heads
from scheduler import Request, StepBatch
from scheduler.draft_tree import DraftTree

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import StepHandle


class MedusaProposer:
    overlaps = False  # drafts from the newest token's hidden state: each step's must be known

    def __init__(self, config: SpeculativeConfig, context: ProposerContext):
        heads = load_draft_heads(config.model, context.model_config, context.model.dtype, "medusa")
        self.tree = config.tree or DraftTree.chain(config.num_speculative_tokens)
        if self.tree.max_depth > heads.num_heads:
            raise ValueError(f"{config.model} has {heads.num_heads} heads; the drafts need {self.tree.max_depth}")
        self.config, self.runner = config, context.runner
        self.heads = nnx.split(heads)
        # Candidates per head: the most siblings at its depth; a node's token is one of them.
        widths = [int(self.tree.rank[self.tree.depth == d].max()) + 1 for d in range(1, self.tree.max_depth + 1)]
        self._candidates = jax.jit(
            _candidates_fn(self.heads[0], self.runner.graphdef, max(widths), self.tree.max_depth),
            compiler_options=self.runner.compiler_options,  # the target's (jaxserve.runner.compile_options)
        )
        self._depth, self._rank = self.tree.depth[1:] - 1, self.tree.rank[1:]
        self._rows: dict[str, int] = {}  # request id -> its row in the latest step, if it sampled there
        for rows in self.runner.row_buckets:  # compile now, not while serving
            self._candidates(self.heads[1], self.runner.params, self.runner.last_hidden, np.zeros(rows, np.int32))

    def propose(self, running: list[Request]) -> None:
        requests = [r for r in decoding(running, self.config) if r.request_id in self._rows]
        if not requests:
            return
        rows = np.zeros(self.runner.rows_for(len(requests)), np.int32)
        rows[: len(requests)] = [self._rows[req.request_id] for req in requests]
        candidates = np.asarray(self._candidates(self.heads[1], self.runner.params, self.runner.last_hidden, rows))
        drafts = candidates[:, self._depth, self._rank]  # [R, N]: node i's head and rank
        for req, tokens in zip(requests, drafts.tolist()):
            req.spec_token_ids = tokens

    def draft_probs(self, batch: StepBatch) -> None:
        return None

    def follow(self, batch: StepBatch, handle: StepHandle) -> None:
        self._rows = sampled_rows(batch)  # where runner.last_hidden holds each request's newest state


def _candidates_fn(head_graphdef, target_graphdef, width: int, depth: int):
    def candidates(head_params, target_params, last_hidden, rows):
        """i32 [R, depth, width]: the first `depth` heads' top `width` tokens for the last
        hidden states of `rows`."""
        heads, target = nnx.merge(head_graphdef, head_params), nnx.merge(target_graphdef, target_params)
        logits = heads(target, last_hidden[rows])[:depth]  # [depth, R, V]
        return jax.lax.top_k(logits, width)[1].transpose(1, 0, 2).astype(jnp.int32)

    return candidates
