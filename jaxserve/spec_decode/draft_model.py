"""A draft model: a smaller model with the target's tokenizer runs k steps ahead.

The draft has its own paged KV cache with the target's block ids: it runs every step's
tokens right after the target does (`ModelRunner.write_kv`, the same padded inputs, the
same slots), so its cache holds K/V wherever the target's does: prefill chunks, prefix
cache hits, copy-on-write copies and recomputation after preemption come for free, and a
rejected draft is rolled back in both caches by `num_computed_tokens` alone.

Proposing, before each step: for every decoding request, the slots of the next k
positions are reserved (the step needs them anyway), then one jitted call runs k
single-token steps of the draft for all those requests, each feeding the token it drew
into the next. Greedy requests draw the argmax; sampling ones draw from the draft's
softmax at the request's temperature, and those distributions go to the verify step,
whose acceptance test is exact for any draft distribution.

    position:   ... L-1 | L    L+1  ...  L+k-1
    draft in:       x   | d1   d2        d(k-1)      x: the last token, not yet computed
    draft out:      d1  | d2   d3        dk
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.decoder import DecoderLM, unstack_layers
from jaxserve.model.inputs import ModelInputs
from jaxserve.runner.kernels import select_attention
from jaxserve.runner.model_runner import ModelRunner, StepHandle
from jaxserve.sample.sampler import invert_cdf, sample_key
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.context import ProposerContext
from jaxserve.spec_decode.proposers import decoding, reserve_draft_slots
from scheduler import Request, StepBatch

logger = logging.getLogger(__name__)

DRAFT_STREAM = 2  # the draft's random numbers: independent of the target's (sampler.draw_uniforms)


def truncate_layers(model: DecoderLM, num_layers: int) -> DecoderLM:
    """The model with only its first `num_layers` layers (embeddings, final norm and LM head
    shared): a layer-truncated self-draft."""
    if not 1 <= num_layers <= model.cfg.num_layers:
        raise ValueError(f"draft_num_layers must be in [1, {model.cfg.num_layers}], got {num_layers}")
    graphdef, state = nnx.split(unstack_layers(model))
    draft = nnx.merge(graphdef, state)  # a new module tree over the same arrays
    draft.layers = nnx.List(list(draft.layers)[:num_layers])
    draft.cfg = dataclasses.replace(model.cfg, num_layers=num_layers)
    return draft


def load_draft(config: SpeculativeConfig, context: ProposerContext) -> DecoderLM:
    model = context.model
    if config.model is not None:
        from jaxserve.weights.load import load_model

        draft = load_model(config.model, dtype=model.dtype, progress=False)
        if draft.config.vocab_size != context.model_config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.config.vocab_size}) is not the target's "
                f"({context.model_config.vocab_size}): they must share a tokenizer"
            )
        model = draft.model
    if config.draft_num_layers is not None:
        model = truncate_layers(model, config.draft_num_layers)
    return model


class DraftModelProposer:
    overlaps = False  # its KV cache follows every step's tokens (follow): each step's must be known

    def __init__(self, config: SpeculativeConfig, context: ProposerContext):
        self.config = config
        self.scheduler = context.scheduler
        self.target = context.runner
        model = load_draft(config, context)
        target = context.runner
        kv_dtype = context.kv_dtype
        _, attention = select_attention(
            context.attention_backend, model.cfg, model.dtype, target.block_size, kv_dtype, mesh=target.mesh
        )
        self.runner = ModelRunner(
            model,
            num_blocks=target.kv.num_blocks,
            block_size=target.block_size,
            max_num_seqs=target.max_num_seqs,
            max_num_batched_tokens=target.buckets[-1],
            max_model_len=target.max_model_len,
            attention=attention,
            kv_dtype=kv_dtype,
            buckets=target.buckets,
            mesh=target.mesh,
        )  # on the target's devices
        logger.info("draft model: %d layers, KV cache %.1f MiB", model.cfg.num_layers, self.runner.kv.nbytes / 2**20)
        options = target.compiler_options  # the target's XLA options (jaxserve.runner.compile_options)
        self._propose = jax.jit(self._propose_fn, donate_argnames=("kv",), compiler_options=options)
        self._take_rows = jax.jit(lambda probs, rows: probs[rows], compiler_options=options)
        self._rows: dict[str, int] = {}  # request id -> row of the latest proposal
        self._probs: jax.Array | None = None  # [R, k, V]: the distributions the drafts were drawn from
        if context.warm_up:
            self.warm_up()

    def warm_up(self) -> None:
        self.runner.warm_up(heads=False)
        buckets = self.target.row_buckets
        for r in buckets:
            _, probs, self.runner.kv = self._propose(self.runner.params, self.runner.kv, *self._inputs([], r))
            for verify_rows in buckets:  # a step's rows need not be the proposal's
                self._take_rows(probs, np.zeros(verify_rows, np.int32))
        jax.block_until_ready(self.runner.kv)

    # -- the proposer interface ------------------------------------------------------------

    def propose(self, running: list[Request]) -> None:
        kv = self.scheduler.kv
        k = self.config.num_speculative_tokens
        # The step writes the last token and k drafts: reserve their slots now (or skip).
        requests = reserve_draft_slots(kv, decoding(running, self.config), k, self.target.max_model_len)
        self._rows = {r.request_id: i for i, r in enumerate(requests)}
        if not requests:
            return
        rows = self.target.rows_for(len(requests))
        drafts, self._probs, self.runner.kv = self._propose(
            self.runner.params, self.runner.kv, *self._inputs(requests, rows)
        )
        drafts = np.asarray(drafts).tolist()
        max_len = self.target.max_model_len
        for i, req in enumerate(requests):
            room = min(k, max_len - req.num_tokens, req.sampling_params.max_tokens - req.num_output_tokens - 1)
            req.spec_token_ids = drafts[i][: max(room, 0)]

    def draft_probs(self, batch: StepBatch) -> jax.Array | None:
        """The drafts' distributions in the batch's row order (rows without drafts: any)."""
        if batch.verify is None:
            return None
        index = np.zeros(self.target.rows_for(batch.num_seqs), np.int32)
        index[: batch.num_seqs] = [self._rows.get(rid, 0) for rid in batch.request_ids]
        return self._take_rows(self._probs, index)

    def follow(self, batch: StepBatch, handle: StepHandle) -> None:
        self.runner.write_kv(batch)

    # -- the jitted k steps ------------------------------------------------------------------

    def _inputs(self, requests: list[Request], rows: int):
        """Host arrays for `_propose`, padded to `rows` (padding rows write to the null block)."""
        tokens, positions = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        tables = np.zeros((rows, self.runner.max_blocks_per_seq), np.int32)
        temperature = np.zeros(rows, np.float32)
        seeds, sample_index, output_index = (
            np.zeros((rows, 2), np.uint32),
            np.zeros(rows, np.int32),
            np.zeros(rows, np.int32),
        )
        for i, req in enumerate(requests):
            tokens[i], positions[i] = req.all_token_ids[-1], req.num_tokens - 1
            table = self.scheduler.kv.block_ids(req.request_id)[: tables.shape[1]]
            tables[i, : len(table)] = table
            temperature[i] = req.sampling_params.temperature
            seeds[i] = (req.seed >> 32, req.seed & 0xFFFFFFFF)
            sample_index[i], output_index[i] = req.sample_index, req.num_output_tokens
        return tokens, positions, tables, temperature, seeds, sample_index, output_index

    def _propose_fn(self, params, kv, tokens, positions, tables, temperature, seeds, sample_index, output_index):
        """k draft steps for R rows: drafts i32 [R, k], their distributions f32 [R, k, V], the cache."""
        model = nnx.merge(self.runner.graphdef, params)
        rows = tokens.shape[0]
        bs, max_len = self.runner.block_size, self.runner.max_model_len
        row_ids = jnp.arange(rows)
        drafts, probs = [], []
        for j in range(self.config.num_speculative_tokens):
            block = tables[row_ids, jnp.minimum(positions // bs, tables.shape[1] - 1)]
            # Past the context there is no slot: the null block takes the write.
            slots = jnp.where(positions < max_len, block * bs + positions % bs, 0)
            inputs = ModelInputs(
                tokens,
                positions,
                slots,
                jnp.arange(rows + 1, dtype=jnp.int32),
                positions + 1,
                tables,
                row_ids.astype(jnp.int32),
            )
            hidden, kv = model.hidden_states(inputs, kv, attention=self.runner.attention)
            logits = model.logits(hidden)
            q = jax.nn.softmax(logits / jnp.where(temperature > 0, temperature, 1.0)[:, None], axis=-1)
            keys = jax.vmap(sample_key)(seeds, sample_index, output_index + j)
            keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, DRAFT_STREAM)
            drawn = invert_cdf(q, jax.vmap(jax.random.uniform)(keys))
            tokens = jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
            drafts.append(tokens)
            probs.append(q)
            positions = positions + 1
        return jnp.stack(drafts, axis=1), jnp.stack(probs, axis=1), kv
