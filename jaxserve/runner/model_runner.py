"""Runs a scheduler `StepBatch` on the device: pad to buckets, two jitted calls, sampled tokens.

Shapes are padded to a fixed set of buckets so the number of compiled programs is known
and small. A step is two programs dispatched back to back (nothing returns to the host
in between):

- the body: embeddings, every layer, the KV write, for T tokens, T from `token_buckets`:
  1, 2, 4, 8, then steps of 8 up to max_num_seqs, then powers of two up to
  max_num_batched_tokens, as vLLM's CUDA graph sizes (its attention sees S = min(T,
  max_num_seqs) sequence slots). It hands over the final hidden state of each sequence's
  last token.
- the head: final norm, LM head and sampler for R rows, R the number of sequences
  rounded up the same way (at most max_num_seqs), with or without penalties and the
  token bias (logit_bias, allowed_token_ids, bad_words: one variant for both).

So the compiled set is the token buckets plus twice the row buckets, not their product,
and the LM head and sampler, whose cost grows with the rows, work on the real batch
(rounded up), not on as many rows as the token bucket could hold. Every program is
compiled by `warm_up()`; `compilations` counts XLA compiles so tests can show none
happen later.

With speculative decoding (`num_speculative_tokens` k > 0) the body hands over k + 1
hidden states per sequence, one per draft position and the bonus, and a step with draft
tokens runs the verify head (`sample.rejection_sampler.verify`) on them instead of
the sampler: up to k + 1 tokens per sequence.

`dispatch(batch)` only enqueues the step and returns a handle; `handle.fetch()` waits for
its sampled tokens. The sampled tokens also stay on the device (`last_tokens`), where the
next step reads the ones it needs (`StepBatch.pending_tokens`): with the overlapped loop,
step N+1 is dispatched before the host has seen step N's tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.model.decoder import AttentionFn, DecoderLM, unstack_layers
from jaxserve.model.inputs import ModelInputs
from jaxserve.model.kv_cache import KVCache, allocate_kv_cache, copy_blocks, read_blocks, write_blocks
from jaxserve.model.lora import attach_lora, write_slot
from jaxserve.parallel.experts import use_expert_parallel
from jaxserve.parallel.sharding import (
    kv_cache_sharding,
    kv_heads_for,
    make_mesh,
    param_shardings,
    place,
    replicate_kv_heads,
    replicated,
    tensor_parallel_size,
)
from jaxserve.runner import steps
from jaxserve.runner.compile_options import engine_compiler_options
from jaxserve.runner.kernels import lora_kernel_unsupported_reason
from jaxserve.runner.steps import NULL_SLOT, PendingTokens
from jaxserve.sample.rejection_sampler import VerifyOutput
from jaxserve.sample.sampler import SamplerOutput, SamplingMetadata
from jaxserve.sample.tree_verify import TreeVerifyOutput
from pallas_kernels.quantized_kv import is_quantized_kv
from scheduler.draft_tree import DraftTree
from scheduler.step_batch import MAX_BANNED_TOKENS, SamplingBatch, StepBatch, bitmask_words, token_bias_matrix

logger = logging.getLogger(__name__)

# One token is the smallest bucket: on a CPU, XLA runs a one-row matmul as a matrix-vector
# product at about the memory bandwidth, while 2-8 rows run about three times slower, so
# single-stream decode must not be padded.
MIN_TOKENS = 1


@dataclasses.dataclass
class StepPlan:
    """A step's padded host inputs: everything its programs read besides the runner's own
    state (weights, KV cache, the last step's tokens). Over several nodes the leader sends
    this to every node (jaxserve.parallel.multihost), which runs the same programs on it."""

    inputs: ModelInputs
    pending: PendingTokens
    copies: np.ndarray | None = None  # i32 [n, 2]: block copies (copy_pairs) before the body
    prompt_targets: np.ndarray | None = None  # i32 [T]: prompt-logprob targets (the hidden-keeping body)
    sampling: SamplingMetadata | None = None  # the head's; None: the body alone (write_kv)
    draft_ids: np.ndarray | None = None  # i32 [R, k]: with drafts, the verify head instead of the sampler
    num_drafts: np.ndarray | None = None  # i32 [R]
    tree_slots: np.ndarray | None = None  # i32 [R, k + 1]: drafts shaped as a tree (compacted after verify)


# The dataclasses a StepPlan is made of: what a frame between nodes may carry.
PLAN_TYPES = (StepPlan, ModelInputs, PendingTokens, SamplingMetadata)


@dataclasses.dataclass
class RunnerOutput:
    """One row per scheduled sequence (padding rows removed)."""

    token_ids: np.ndarray  # int32 [S], or [S, k+1] after verifying draft tokens
    logprobs: np.ndarray | None  # float32 [S] ([S, k+1]) when some sequence asked for logprobs
    top_logprob_ids: np.ndarray | None  # int32 [S, n] ([S, k+1, n]) when some sequence asked for logprobs
    top_logprobs: np.ndarray | None
    num_tokens: np.ndarray | None = None  # int32 [S] after verifying draft tokens: tokens per row
    prompt_logprobs: PromptLogprobsOutput | None = None  # when some row asked for prompt logprobs


@dataclasses.dataclass
class PromptLogprobsOutput:
    """One entry per prompt token whose logprob the step computed (in step order)."""

    request_ids: list[str]
    positions: np.ndarray  # int32 [N]: the token's position in its prompt (>= 1)
    token_ids: np.ndarray  # int32 [N]: the prompt token there
    logprobs: np.ndarray  # float32 [N]: its logprob given the tokens before it
    ranks: np.ndarray  # int32 [N]: 1 + how many tokens are more likely
    top_ids: np.ndarray  # int32 [N, k]: the k most likely tokens (k: the most any row asked for)
    top_logprobs: np.ndarray  # float32 [N, k]


# Above 8, sizes up to max_num_seqs go in steps of 8 rather than doubling: on the default
# model a decode step of 33 sequences padded to 64 took 1.37x the time (1.50x the CPU) of
# one of 32, padded to 40 it takes 1.05-1.25x (benchmarks/decode_buckets.py, a noisy
# figure); each program more costs under half a second of a warm start.
ROW_STEP = 8


def padded_sizes(limit: int, fine_up_to: int) -> list[int]:
    """The sizes a batch is padded to: powers of two up to ROW_STEP, then multiples of
    ROW_STEP up to `fine_up_to`, then the powers of two above; the last one is `limit`."""
    sizes, n = [], MIN_TOKENS
    while n < limit:
        sizes.append(n)
        n = n + ROW_STEP if ROW_STEP <= n < fine_up_to else 1 << n.bit_length()
    return sizes + [max(limit, MIN_TOKENS)]


def token_buckets(max_num_batched_tokens: int, max_num_seqs: int) -> list[int]:
    """The body's token buckets: decode steps (one token per sequence, up to max_num_seqs)
    padded by at most ROW_STEP - 1 tokens, larger steps to a power of two."""
    return padded_sizes(max_num_batched_tokens, max_num_seqs)


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        attention: AttentionFn,
        kv_dtype=None,
        buckets: list[int] | None = None,
        num_speculative_tokens: int = 0,
        draft_distributions: bool = False,
        draft_tree: DraftTree | None = None,
        keep_step_hidden: bool = False,
        feature_layers: tuple[int, ...] = (),
        mesh: jax.sharding.Mesh | None = None,
        expert_parallel: bool = False,
        expert_dispatch: str = "all-reduce",
        max_loras: int = 0,
        max_lora_rank: int = 0,
    ):
        self.config = model.cfg
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        # The head's row counts: powers of two up to ROW_STEP, then steps of ROW_STEP, up to max_num_seqs.
        self.row_buckets = padded_sizes(max_num_seqs, max_num_seqs)
        self.buckets = sorted(buckets) if buckets else token_buckets(max_num_batched_tokens, max_num_seqs)
        if self.buckets[-1] < max_num_batched_tokens or self.buckets[0] < MIN_TOKENS:
            raise ValueError(
                f"token buckets {self.buckets} must lie in [{MIN_TOKENS}, ...] and reach {max_num_batched_tokens=}"
            )
        # The devices the step runs on (jaxserve.parallel.sharding): one, or tensor-parallel shards.
        self.mesh = mesh = mesh if mesh is not None else make_mesh(1)
        tp = tensor_parallel_size(mesh)
        # Every program below compiles with these (runner/compile_options.py); proposers use them too.
        self.compiler_options = engine_compiler_options(mesh.devices.flat[0].platform)
        jit = functools.partial(jax.jit, compiler_options=self.compiler_options)
        # NOTE: arrays are committed to the mesh up front: jit keys its cache on whether an
        # argument is committed, and the donated cache comes back committed after step one.
        self.replicated = replicated(mesh)
        kv_dtype = jnp.dtype(kv_dtype or model.dtype)
        kv_config = dataclasses.replace(self.config, num_kv_heads=kv_heads_for(self.config, tp))
        kv_shardings = kv_cache_sharding(mesh, quantized=is_quantized_kv(kv_dtype))
        # Allocated in place, shard by shard: no device ever holds the whole cache.
        self.kv: KVCache = jit(
            lambda: allocate_kv_cache(kv_config, num_blocks, block_size, kv_dtype), out_shardings=kv_shardings
        )()
        model = nnx.merge(*nnx.split(unstack_layers(model)))  # our own copy of the modules (same arrays)
        if expert_parallel:  # the MoE layers run whole experts per device (jaxserve.parallel.experts)
            use_expert_parallel(model, mesh, expert_dispatch)
        # LoRA: every layer gets slot stacks (jaxserve.model.lora), and every step's inputs a slot per token.
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        if max_loras:
            device = mesh.devices.flat[0]
            reason = lora_kernel_unsupported_reason(self.config, model.dtype, device, tp)
            attach_lora(model, max_loras, max_lora_rank, kernel=reason is None)
            logger.info(
                "LoRA: %s on %s", "Mosaic GPU SGMV kernel" if reason is None else f"BGMV reference ({reason})", device
            )
        graphdef, params = nnx.split(model)
        params = replicate_kv_heads(params, self.config, tp)
        self.graphdef, self.attention = graphdef, attention
        # A plain nested dict, not an nnx.State: jit flattens a dict in C++, where a State
        # costs about 0.3 ms of host time on every call (two calls a step).
        shardings = param_shardings(params, mesh, expert_parallel)
        self.params = nnx.to_pure_dict(place(params, shardings))
        # The LoRA stacks' placement (split as their projections under tensor parallelism): the
        # slot write returns them placed so, and the step programs see one placement.
        self.lora_shardings = None
        if max_loras:  # committed (place keeps a fresh one-device array as it is), as the slot write returns them
            self.lora_shardings = {i: layer["lora"] for i, layer in nnx.to_pure_dict(shardings)["layers"].items()}
            for i, layer in self.params["layers"].items():
                layer["lora"] = jax.device_put(layer["lora"], self.lora_shardings[i])
        rows = max_num_seqs
        self.num_speculative_tokens = k = num_speculative_tokens
        self.draft_distributions = draft_distributions  # verify against draft probabilities (not point masses)
        # Drafts shaped as a tree (not a chain): tree attention, tree verification, and the
        # accepted path's K/V moved next to each other after each verify step.
        self.keep_step_hidden = keep_step_hidden
        self.tree = draft_tree if draft_tree is not None and not draft_tree.is_chain else None
        statics = steps.StepStatics(
            graphdef=graphdef,
            attention=attention,
            mesh=mesh,
            kv_shardings=kv_shardings,
            rows=rows,
            num_speculative_tokens=k,
            tree=self.tree,
            keep_step_hidden=keep_step_hidden,
            feature_layers=tuple(feature_layers),
            batch_invariant=model.batch_invariant,
        )

        # jit is applied here, once; the step functions (runner/steps.py) stay plain functions.
        self._body = jit(functools.partial(steps.body, statics), donate_argnames=("kv",))
        # Steps with prompt logprobs keep every token's hidden state: a variant compiled when the first comes.
        self._body_keeping_hidden = jit(
            functools.partial(steps.body, statics, keep_hidden=True), donate_argnames=("kv",)
        )
        self._prompt_head = jit(functools.partial(steps.prompt_head, statics))
        self._head = jit(functools.partial(steps.head, statics))
        self._verify_head = jit(functools.partial(steps.verify_head, statics))
        self._compact = jit(steps.compact, donate_argnames=("kv",))
        # The latest step's sampled tokens, by row, on the device.
        self.last_tokens = jax.device_put(np.zeros(rows, np.int32), self.replicated)
        # ... and, when speculating, the hidden state each was drawn from (draft heads read it).
        hidden_rows = np.zeros((rows, self.config.hidden_size), model.dtype)
        self.last_hidden = jax.device_put(hidden_rows, self.replicated) if k else None
        # With keep_step_hidden: the latest step's padded inputs and every token's hidden state.
        self.step_inputs: ModelInputs | None = None
        self.step_hidden: jax.Array | None = None
        self.step_features: jax.Array | None = None  # with feature_layers: their inputs [T, n * D]
        self._copy_blocks = jit(copy_blocks, donate_argnames=("kv",))
        self._read_blocks = jit(read_blocks)
        self._write_blocks = jit(write_blocks, donate_argnames=("kv",), out_shardings=kv_shardings)
        # The stacks come back placed as they went in (replicated), so the step programs see no new sharding.
        self._write_lora_slot = jit(write_slot, donate_argnums=0, out_shardings=self.lora_shardings)
        self.compilations = CompileCounter()
        # Over several nodes (jaxserve.parallel.multihost), node 0's runner hands each step's plan
        # here before running it, so that every node runs the same programs.
        self.broadcast = None

    # -- buckets ------------------------------------------------------------------------

    def bucket_for(self, num_tokens: int) -> tuple[int, int]:
        """(T, S) of the smallest token bucket holding `num_tokens` tokens."""
        for t in self.buckets:
            if t >= num_tokens:
                return t, min(t, self.max_num_seqs)
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def rows_for(self, num_seqs: int) -> int:
        return self.row_buckets[bisect.bisect_left(self.row_buckets, num_seqs)]

    def warm_up(self, heads: bool = True, progress: bool = False) -> None:
        """Compile every program now, so that serving never waits on the compiler; without
        `heads`, only what `write_kv` runs. `progress`: a bar on stderr, a step per bucket."""
        total = len(self.buckets) + (len(self.row_buckets) if heads else 0)
        with tqdm(total=total, desc="compiling", unit="bucket", disable=not progress, leave=False) as bar:
            self._warm_up(heads, bar)
        if heads:
            logger.info(
                "compiled %d token buckets %s and %d row buckets %s",
                len(self.buckets),
                self.buckets,
                len(self.row_buckets),
                self.row_buckets,
            )

    def _warm_up(self, heads: bool, bar: tqdm) -> None:
        if self.max_loras:  # the slot write's program: slot 0 (no adapter) holds zeros, and zeros go in
            stacks = {i: layer["lora"] for i, layer in self.params["layers"].items()}
            self.load_lora(0, [{k: np.zeros(v.shape[1:], v.dtype) for k, v in stacks[i].items()} for i in stacks])
        for t in self.buckets:
            bar.set_postfix_str(f"{t} tokens")
            inputs, pending = self.pad_inputs(None, *self.bucket_for(t))
            hidden, self.kv, *_ = self._body(self.params, self.kv, inputs, pending, self.last_tokens)
            bar.update()  # the call returns once its program is compiled (it runs asynchronously)
        self.kv = self._copy_blocks(self.kv, copy_pairs([], self.max_num_seqs))
        jax.block_until_ready(self.kv)
        if not heads:
            return
        for r in self.row_buckets:
            bar.set_postfix_str(f"{r} rows")
            for penalties in (False, True):
                meta = _dummy_sampling(r, penalties, self.max_model_len, self.config.vocab_size)
                out, *_ = self._head(self.params, hidden, meta)
                out.token_ids.block_until_ready()
                if self.num_speculative_tokens:
                    args = (*self._verify_args(None, r, penalties), self._no_draft_probs(r))
                    out, *_ = self._verify_head(self.params, hidden, *args)
                    out.token_ids.block_until_ready()
                    if self.tree is not None:
                        self.kv = self._compact(self.kv, out, self._tree_slots(None, r))
            bar.update()

    # -- KV handed between engines (prefill/decode disaggregation) ---------------------------

    def read_blocks(self, block_ids: list[int]) -> KVCache:
        """These blocks' KV, [L, len(block_ids), ...] in every array: gathered padded to a power
        of two (few shapes, few compilations), then cut to the blocks asked for, so that a
        transfer moves no padding."""
        n = len(block_ids)
        ids = np.zeros(1 << max(0, n - 1).bit_length(), np.int32)
        ids[:n] = block_ids
        return jax.tree.map(lambda x: x[:, :n], self._read_blocks(self.kv, ids))

    def write_blocks(self, writes: list[tuple[int, int]], blocks: KVCache) -> None:
        """Write row i of `blocks` (read_blocks' output or a slice of it, perhaps another
        engine's, on other devices) into block b, for each (i, b) of `writes`."""
        if not writes:
            return
        have = blocks.k.shape[1]
        n = 1 << max(0, have - 1).bit_length()  # padded here, to few shapes (few compilations)
        if n != have:
            blocks = jax.tree.map(lambda x: jnp.pad(x, [(0, 0), (0, n - have)] + [(0, 0)] * (x.ndim - 2)), blocks)
        rows, block_ids = np.zeros(n, np.int32), np.zeros(n, np.int32)  # padding writes row 0 to the null block
        rows[: len(writes)], block_ids[: len(writes)] = zip(*writes)
        blocks = jax.device_put(blocks, self.replicated)  # a few blocks; the write splits them as the cache is
        self.kv = self._write_blocks(self.kv, blocks, rows, block_ids)

    # -- LoRA adapters --------------------------------------------------------------------

    def load_lora(self, slot: int, layers: list[dict[str, np.ndarray]]) -> None:
        """Copy one adapter into device slot `slot` of every layer's stacks, in place (one
        compiled program for every slot and adapter). `layers`: LoRAAdapter.slot_arrays."""
        stacks = {i: layer["lora"] for i, layer in self.params["layers"].items()}
        # K/V heads repeated for tensor parallelism (replicate_kv_heads) are repeated in B too.
        values = {"layers": {i: {"lora": layers[i]} for i in stacks}}
        values = replicate_kv_heads(values, self.config, tensor_parallel_size(self.mesh))
        values = jax.device_put({i: layer["lora"] for i, layer in values["layers"].items()}, self.replicated)
        stacks = self._write_lora_slot(stacks, jax.device_put(np.int32(slot), self.replicated), values)
        for i, layer_stacks in stacks.items():
            self.params["layers"][i]["lora"] = layer_stacks

    # -- one step -----------------------------------------------------------------------

    def dispatch(self, batch: StepBatch, draft_probs: jax.Array | None = None) -> StepHandle:
        """Enqueue one step on the device and return at once. `draft_probs` [R, k, V]: the
        distributions draft tokens were drawn from (draft models; None: point masses)."""
        plan = self.plan(batch)
        if self.broadcast is not None:
            self.broadcast(plan)
        out, prompt = self.execute(plan, draft_probs)
        if prompt is not None:
            prompt = (prompt, _prompt_rows(batch))
        return StepHandle(out, batch.num_seqs, batch.sampling.want_logprobs, batch.sampling.num_logprobs, prompt)

    def plan(self, batch: StepBatch, heads: bool = True) -> StepPlan:
        """The step's padded host inputs; without `heads`, the body's alone (write_kv)."""
        copies = copy_pairs(batch.block_copies, self.max_num_seqs) if batch.block_copies else None
        inputs, pending = self.pad_inputs(batch, *self.bucket_for(batch.num_tokens))
        plan = StepPlan(inputs, pending, copies)
        targets = batch.prompt_logprob_targets
        if targets is not None:
            plan.prompt_targets = np.zeros(len(inputs.input_ids), np.int32)
            plan.prompt_targets[: len(targets)] = np.maximum(targets, 0)
        if not heads:
            return plan
        r = self.rows_for(batch.num_seqs)
        if batch.verify is not None:
            plan.sampling, plan.draft_ids, plan.num_drafts = self._verify_args(batch, r)
            if self.tree is not None:
                plan.tree_slots = self._tree_slots(batch, r)
        else:
            plan.sampling = self._pad_sampling(batch.sampling, r)
        return plan

    def execute(self, plan: StepPlan, draft_probs: jax.Array | None = None):
        """Enqueue a plan's programs: (the head's output or None, the prompt-logprob tables or None).
        Every node of several runs this with the same plan (jaxserve.parallel.multihost)."""
        if plan.copies is not None:
            self.kv = self._copy_blocks(self.kv, plan.copies)
        keep_hidden = plan.prompt_targets is not None
        run_body = self._body_keeping_hidden if keep_hidden else self._body
        hidden, self.kv, self.step_hidden, self.step_features = run_body(
            self.params, self.kv, plan.inputs, plan.pending, self.last_tokens
        )
        self.step_inputs = plan.inputs
        prompt = None
        if keep_hidden:
            prompt = self._prompt_head(self.params, self.step_hidden, plan.prompt_targets)
            if not self.keep_step_hidden:
                self.step_hidden = None
        if plan.sampling is None:
            return None, prompt
        if plan.draft_ids is not None:
            if draft_probs is None:
                draft_probs = self._no_draft_probs(len(plan.draft_ids))
            args = (plan.sampling, plan.draft_ids, plan.num_drafts, draft_probs)
            out, self.last_tokens, self.last_hidden = self._verify_head(self.params, hidden, *args)
            if plan.tree_slots is not None:
                self.kv = self._compact(self.kv, out, plan.tree_slots)
        else:
            out, self.last_tokens, self.last_hidden = self._head(self.params, hidden, plan.sampling)
        return out, prompt

    def _verify_args(self, batch: StepBatch | None, r: int, penalties: bool = False):
        """The verify head's host arguments for R = r rows (padding rows have no drafts)."""
        k = self.num_speculative_tokens
        draft_ids, num_drafts = np.zeros((r, k), np.int32), np.zeros(r, np.int32)
        if batch is None:
            meta = _dummy_sampling(r * (k + 1), penalties, self.max_model_len, self.config.vocab_size)
        else:
            meta = self._pad_sampling(batch.verify, r * (k + 1))
            draft_ids[: batch.num_seqs] = batch.spec_token_ids
            num_drafts[: batch.num_seqs] = batch.num_spec_tokens
        return meta, draft_ids, num_drafts

    def _no_draft_probs(self, r: int) -> jax.Array | None:
        """What the verify head reads when no draft model gave distributions: zeros (committed,
        as the real ones are) for a runner that verifies against them, else nothing."""
        if not self.draft_distributions:
            return None
        k = self.num_speculative_tokens
        return jax.device_put(np.zeros((r, k, self.config.vocab_size), np.float32), self.replicated)

    def _tree_slots(self, batch: StepBatch | None, r: int) -> np.ndarray:
        """i32 [r, N+1]: each row's slots of its root and its drafts (rows without: the null slot)."""
        slots = np.full((r, self.num_speculative_tokens + 1), NULL_SLOT, np.int32)
        if batch is not None:
            for i, m in enumerate(batch.num_spec_tokens.tolist()):
                if m:
                    end = batch.query_start_loc[i + 1]
                    slots[i, : m + 1] = batch.slot_mapping[end - m - 1 : end]
        return slots

    def write_kv(self, batch: StepBatch) -> None:
        """Run a step's tokens through the layers for their K/V only (no logits): a draft
        model follows the target's steps this way, so its cache holds what the target's does."""
        plan = self.plan(batch, heads=False)
        plan.prompt_targets = None
        self.execute(plan)

    def pad_inputs(self, batch: StepBatch | None, t: int, s: int) -> tuple[ModelInputs, PendingTokens]:
        ids, pos, slots = (np.zeros(t, np.int32) for _ in range(3))
        pending_at = np.full(s, t, np.int32)  # padding: out of range, dropped
        pending_rows = np.zeros(s, np.int32)
        qsl = np.zeros(s + 1, np.int32)
        seq_lens = np.zeros(s, np.int32)
        tables = np.zeros((s, self.max_blocks_per_seq), np.int32)
        k = self.num_speculative_tokens
        logits_at = np.zeros((self.max_num_seqs, k + 1) if k else self.max_num_seqs, np.int32)
        if batch is not None:
            n, m = batch.num_tokens, batch.num_seqs
            ids[:n], pos[:n], slots[:n] = batch.input_ids, batch.positions, batch.slot_mapping
            qsl[: m + 1] = batch.query_start_loc
            qsl[m + 1 :] = n  # padding sequences have no tokens
            seq_lens[:m] = batch.seq_lens
            tables[:m, : batch.block_tables.shape[1]] = batch.block_tables
            if k:  # positions of each row's drafts and its bonus; rows without drafts: the last, repeated
                drafts = batch.num_spec_tokens[:, None]
                logits_at[:m] = batch.logits_indices[:, None] - drafts + np.minimum(np.arange(k + 1), drafts)
            else:
                logits_at[:m] = batch.logits_indices
            p = len(batch.pending_tokens)
            pending_at[:p], pending_rows[:p] = batch.pending_tokens, batch.pending_rows
        tree_mask = None
        if self.tree is not None:  # every step: one compiled program per bucket, not two
            tree_mask = np.full((t, self.tree.mask_words), -1, np.int32)
            if batch is not None and batch.tree_mask is not None:
                tree_mask[: batch.num_tokens] = batch.tree_mask
        lora_slots = None
        if self.max_loras:  # every step: one compiled program per bucket, not two
            lora_slots = np.zeros(t, np.int32)  # padding: slot 0, no adapter
            if batch is not None and batch.lora_slots is not None:
                lora_slots[: batch.num_tokens] = batch.lora_slots
        inputs = ModelInputs(ids, pos, slots, qsl, seq_lens, tables, logits_at, tree_mask, lora_slots)
        return inputs, PendingTokens(pending_at, pending_rows)

    def _pad_sampling(self, b: SamplingBatch, s: int) -> SamplingMetadata:
        def pad(a, fill=0):
            out = np.full((s, *a.shape[1:]), fill, a.dtype)
            out[: len(a)] = a
            return out

        meta = SamplingMetadata(
            temperature=pad(b.temperature),
            top_p=pad(b.top_p, 1),
            top_k=pad(b.top_k),
            min_p=pad(b.min_p),
            presence_penalty=pad(b.presence_penalty),
            frequency_penalty=pad(b.frequency_penalty),
            repetition_penalty=pad(b.repetition_penalty, 1),
            seeds=pad(b.seeds),
            sample_index=pad(b.sample_index),
            output_index=pad(b.output_index),
            banned_token_ids=pad(b.banned_token_ids),
            ban=pad(b.ban),
            want_logprobs=np.bool_(b.want_logprobs),
        )
        if b.history is not None or b.token_bias is not None or b.token_bitmask is not None:
            # One variant for penalties, the token bias and the grammar's bitmask (rows without
            # any leave their logits as they are), so the compiled set stays two per row bucket.
            history, lens, prompt_lens = np.zeros((s, self.max_model_len), np.int32), np.zeros(s, np.int32), None
            if b.history is not None:
                history[: len(b.history), : b.history.shape[1]] = b.history
                lens, prompt_lens = pad(b.history_lens), pad(b.prompt_lens)
            meta.history, meta.history_lens, meta.prompt_lens = (
                history,
                lens,
                lens if prompt_lens is None else prompt_lens,
            )
            meta.token_bias = token_bias_matrix(b.token_bias or [], s, self.config.vocab_size)
            words = bitmask_words(self.config.vocab_size)
            meta.token_bitmask = np.full((s, words), -1, np.int32)
            if b.token_bitmask is not None:  # the grammar's vocabulary may run past the model's: cut
                meta.token_bitmask[: len(b.token_bitmask)] = b.token_bitmask[:, :words]
        return meta


def copy_pairs(copies: list[tuple[int, int]], rows: int) -> np.ndarray:
    """i32 [max(rows, len(copies)), 2]: (src, dst) block copies padded with (0, 0), the null
    block onto itself, so that one compiled copy serves every step."""
    pairs = np.zeros((max(rows, len(copies)), 2), np.int32)
    if copies:
        pairs[: len(copies)] = copies
    return pairs


class StepHandle:
    """A dispatched step; `fetch()` waits for its sampled tokens (one row per sequence)."""

    def __init__(
        self, out: SamplerOutput | VerifyOutput, num_seqs: int, want_logprobs: bool, num_logprobs: int, prompt=None
    ):
        self.out, self.num_seqs, self.want_logprobs, self.num_logprobs = out, num_seqs, want_logprobs, num_logprobs
        self.prompt = prompt  # (device tables, _prompt_rows(batch)) with prompt logprobs

    def fetch(self) -> RunnerOutput:
        result = self._fetch_samples()
        if self.prompt is not None:
            (logprobs, ranks, top_ids, top_values), (at, request_ids, positions, token_ids, k) = self.prompt
            result.prompt_logprobs = PromptLogprobsOutput(
                request_ids,
                positions,
                token_ids,
                np.asarray(logprobs)[at],
                np.asarray(ranks)[at],
                np.asarray(top_ids)[at, :k],
                np.asarray(top_values)[at, :k],
            )
        return result

    def _fetch_samples(self) -> RunnerOutput:
        out, n, k = self.out, self.num_seqs, self.num_logprobs
        token_ids = np.asarray(out.token_ids)[:n]
        num_tokens = np.asarray(out.num_tokens)[:n] if isinstance(out, (VerifyOutput, TreeVerifyOutput)) else None
        if not self.want_logprobs:
            return RunnerOutput(token_ids, None, None, None, num_tokens)
        logprobs = np.asarray(out.logprobs)[:n]
        if k:
            return RunnerOutput(
                token_ids,
                logprobs,
                np.asarray(out.top_logprob_ids)[:n, ..., :k],
                np.asarray(out.top_logprobs)[:n, ..., :k],
                num_tokens,
            )
        return RunnerOutput(token_ids, logprobs, None, None, num_tokens)


def _prompt_rows(batch: StepBatch):
    """Host-side bookkeeping of a step's prompt logprobs: which flat tokens report one, for
    which request and prompt position, the prompt token, and how many alternatives to keep."""
    targets = batch.prompt_logprob_targets
    at = np.flatnonzero(targets >= 0)
    rows = np.searchsorted(batch.query_start_loc, at, side="right") - 1
    request_ids = [batch.request_ids[r] for r in rows.tolist()]
    return at, request_ids, batch.positions[at] + 1, targets[at], batch.num_prompt_logprobs


def _dummy_sampling(s: int, penalties: bool, width: int, vocab_size: int) -> SamplingMetadata:
    f, i = np.zeros(s, np.float32), np.zeros(s, np.int32)
    meta = SamplingMetadata(
        f,
        f + 1,
        i,
        f,
        f,
        f,
        f + 1,
        np.zeros((s, 2), np.uint32),
        i,
        i,
        np.zeros((s, MAX_BANNED_TOKENS), np.int32),
        np.zeros(s, bool),
        np.bool_(False),
    )
    if penalties:
        meta.history, meta.history_lens, meta.prompt_lens = np.zeros((s, width), np.int32), i, i
        meta.token_bias = np.zeros((s, vocab_size), np.float32)
        meta.token_bitmask = np.full((s, bitmask_words(vocab_size)), -1, np.int32)
    return meta


class CompileCounter:
    """Counts XLA compilations in this process, from jax's own monitoring events."""

    _lock = threading.Lock()
    _count = 0
    _installed = False

    def __init__(self):
        with CompileCounter._lock:
            if not CompileCounter._installed:
                jax.monitoring.register_event_duration_secs_listener(CompileCounter._on_event)
                CompileCounter._installed = True

    @staticmethod
    def _on_event(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            with CompileCounter._lock:
                CompileCounter._count += 1

    @property
    def count(self) -> int:
        return CompileCounter._count


__all__ = ["ModelRunner", "RunnerOutput", "StepHandle", "token_buckets"]
