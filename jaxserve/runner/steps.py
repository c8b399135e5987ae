"""The step functions the runner compiles: plain functions of arrays, jitted in one place.

`ModelRunner` binds each to a `StepStatics` (what is fixed for the runner's life: the
model's graph, the attention kernel, the devices, the row count, the drafts' shape) and
applies `jax.jit` once, with the cache donated:

    body          embeddings, every layer, the KV write, for T tokens  -> hidden states, cache
    head          final norm, LM head and sampler for R rows           -> tokens (kept by row)
    verify_head   the same for R rows of k + 1 positions, verifying drafts
    prompt_head   every prompt token's logprob tables, a group of rows at a time
    compact       after tree verification: the accepted path's K/V moved next to its root
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.decoder import AttentionFn
from jaxserve.model.fixed_order import INVARIANT_ROWS
from jaxserve.model.inputs import ModelInputs
from jaxserve.model.kv_cache import KVCache, move_slots
from jaxserve.parallel.sharding import replicated
from jaxserve.sample.rejection_sampler import verify
from jaxserve.sample.sampler import MAX_LOGPROBS, SamplingMetadata, sample
from jaxserve.sample.tree_verify import TreeVerifyOutput, verify_tree
from scheduler.draft_tree import DraftTree

PROMPT_LOGITS_ROWS = 256  # prompt logprobs: tokens whose [rows, V] logits are live at once
NULL_SLOT = 0  # the null block's first slot (kv_cache.NULL_BLOCK is 0): where moves that do nothing go


@dataclasses.dataclass(frozen=True)
class StepStatics:
    """What the step functions close over: fixed for a runner's life, never traced."""

    graphdef: nnx.GraphDef  # the model's structure; its arrays come in as `params`
    attention: AttentionFn
    mesh: jax.sharding.Mesh
    kv_shardings: Any  # the KVCache's shardings: the cache comes back as it went in
    rows: int  # max_num_seqs: results are kept by row in arrays of this many
    num_speculative_tokens: int  # k: with k > 0 the body hands over k + 1 positions per sequence
    tree: DraftTree | None  # drafts shaped as a tree (None: a chain, or no drafts)
    keep_step_hidden: bool  # the body also returns every token's hidden state (an EAGLE head reads them)
    feature_layers: tuple[int, ...] = ()  # ... and these layers' inputs side by side (an EAGLE-3 head's features)
    batch_invariant: bool = False  # a row's results do not depend on the step's other rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PendingTokens:
    """Which input tokens the step in flight sampled: they are taken from its device output."""

    positions: jax.Array  # int32 [S]: on the flat token axis (T for padding: dropped)
    rows: jax.Array  # int32 [S]: rows of the step in flight

    def fill(self, input_ids: jax.Array, last_tokens: jax.Array) -> jax.Array:
        return input_ids.at[self.positions].set(last_tokens[self.rows], mode="drop")


def row_block(s: StepStatics) -> int:
    """The sampler's logprob tables in fixed blocks under batch invariance (else 0: all rows at once)."""
    return INVARIANT_ROWS if s.batch_invariant else 0


def whole(s: StepStatics, logits: jax.Array) -> jax.Array:
    """Logits gathered whole on every device (under tensor parallelism the LM head splits
    the vocabulary): the sampler, penalties and grammar masks see the full vocabulary."""
    return jax.lax.with_sharding_constraint(logits, replicated(s.mesh))


def body(
    s: StepStatics,
    params,
    kv: KVCache,
    inputs: ModelInputs,
    pending: PendingTokens,
    last_tokens,
    keep_hidden: bool = False,
):
    """Hidden states of each sequence's last token [max_num_seqs, D] (with speculation,
    of its k + 1 verified positions [max_num_seqs, k + 1, D]), the cache, with
    `keep_step_hidden` every token's hidden state [T, D] (an EAGLE head reads them all),
    and with `feature_layers` every token's inputs of those layers [T, n * D] (EAGLE-3's)."""
    inputs = dataclasses.replace(inputs, input_ids=pending.fill(inputs.input_ids, last_tokens))
    model = nnx.merge(s.graphdef, params)
    hidden, kv, features = model.hidden_states_and_layer_inputs(inputs, kv, s.feature_layers, attention=s.attention)
    kv = jax.lax.with_sharding_constraint(kv, s.kv_shardings)  # the cache comes back as it went in
    return hidden[inputs.logits_indices], kv, hidden if s.keep_step_hidden or keep_hidden else None, features


def head(s: StepStatics, params, hidden, meta: SamplingMetadata):
    """Sample the first R rows of `hidden` (R: meta's rows); also keep the tokens on the device."""
    r, k = meta.temperature.shape[0], s.num_speculative_tokens
    last = hidden[:r, -1] if k else hidden[:r]  # with speculation, a plain step's positions are all its last
    out = sample(whole(s, nnx.merge(s.graphdef, params).logits(last)), meta, row_block=row_block(s))
    return out, by_row(out.token_ids, s.rows), by_row(last, s.rows) if k else None  # only heads read it


def verify_head(s: StepStatics, params, hidden, meta: SamplingMetadata, draft_ids, num_drafts, draft_probs):
    """Verify the first R rows' draft tokens (R: draft_ids' rows); keep each row's last token."""
    r, k, tree = draft_ids.shape[0], s.num_speculative_tokens, s.tree
    logits = whole(s, nnx.merge(s.graphdef, params).logits(hidden[:r].reshape(r * (k + 1), -1)))
    if tree is None:
        out = verify(logits, meta, draft_ids, num_drafts, draft_probs, row_block=row_block(s))
    else:  # column 0 is the root (not a draft); a request keeps a BFS prefix of the tree
        valid = jnp.arange(k + 1)[None, :] <= num_drafts[:, None]
        out = verify_tree(
            logits,
            meta,
            tree,
            jnp.pad(draft_ids, ((0, 0), (1, 0))),
            valid,
            None if draft_probs is None else jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0))),
            row_block=row_block(s),
        )
    last = jnp.take_along_axis(out.token_ids, out.num_tokens[:, None] - 1, axis=1)[:, 0]
    # The position the last token was drawn at: its hidden state is what draft heads read.
    end = (
        out.num_tokens - 1 if tree is None else jnp.take_along_axis(out.path, out.num_tokens[:, None] - 1, axis=1)[:, 0]
    )
    return out, by_row(last, s.rows), by_row(hidden[jnp.arange(r), end], s.rows)


def prompt_head(s: StepStatics, params, hidden, targets):
    """Every token's logprob tables for prompt logprobs, PROMPT_LOGITS_ROWS tokens at a time:
    no [T, V] array is ever whole, on the device or off it."""
    model = nnx.merge(s.graphdef, params)
    # NOTE: groups of rows, not lax.map's batch_size: that vmaps the LM head, and the CPU
    # kernel of a tied head (an FFI call) would then run once per row.
    num_tokens = hidden.shape[0]
    # with batch invariance one group shape for every step (XLA fuses the tables of [rows, V]
    # logits differently by rows: from 64 rows on, a row's logprob moved by an ulp)
    rows = INVARIANT_ROWS if s.batch_invariant else min(PROMPT_LOGITS_ROWS, num_tokens)
    groups, pad = -(-num_tokens // rows), -num_tokens % rows
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(groups, rows, -1)
    targets = jnp.pad(targets, (0, pad)).reshape(groups, rows)
    tables = jax.lax.map(lambda group: prompt_logprob_tables(model.logits(group[0]), group[1]), (hidden, targets))
    return tuple(t.reshape(groups * rows, *t.shape[2:])[:num_tokens] for t in tables)


def compact(kv: KVCache, out: TreeVerifyOutput, tree_slots):
    """Move each row's accepted drafts' K/V to the slots after its root, in path order
    (tree_slots [R, N+1]: the slots of the root and its nodes)."""
    depth = jnp.arange(out.path.shape[1])[None, :]
    moved = (depth < out.num_tokens[:, None]) & (out.path != depth)
    src = jnp.take_along_axis(tree_slots, out.path, axis=1)
    dst = tree_slots[:, : out.path.shape[1]]
    return move_slots(kv, jnp.where(moved, src, NULL_SLOT).ravel(), jnp.where(moved, dst, NULL_SLOT).ravel())


def by_row(values: jax.Array, rows: int) -> jax.Array:
    """values [r, ...] in the first r of `rows` rows (the rest zeros): a step's results by row."""
    return jnp.zeros((rows, *values.shape[1:]), values.dtype).at[: values.shape[0]].set(values)


def prompt_logprob_tables(logits: jax.Array, targets: jax.Array):
    """Per token (logits f32 [T, V], targets i32 [T]): the target's logprob and rank (1 + how
    many tokens are strictly more likely, as vLLM), and the top MAX_LOGPROBS ids and logprobs."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=1)[:, 0]
    ranks = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1, dtype=jnp.int32)
    values, ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logits.shape[1]))
    return chosen, ranks, ids.astype(jnp.int32), values
