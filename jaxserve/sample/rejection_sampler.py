"""Verifying draft tokens: which to accept, and the token that follows them (jitted).

The target model scores every draft position in one step: row r, position j holds the
logits for the token after the request's next token and its first j drafts. Each
position is shaped exactly as the sampler shapes a row (penalties, banned tokens,
temperature, top-k/p, min-p; the scheduler's `build_verify_sampling` gives each position
its own history, min_tokens state and random stream), so the target distribution p_j is
the one plain sampling would draw from.

- Greedy rows accept the longest run of drafts equal to the argmax, then emit the argmax
  at the first mismatch (or after the last draft: the bonus token).
- Sampling rows use exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023):
  draft d_j, drawn from q_j, is accepted with probability min(1, p_j(d_j) / q_j(d_j));
  at the first rejection the token is drawn from the normalized max(0, p_j - q_j), and
  after the last accepted draft from p. The output is distributed exactly as samples from
  p one token at a time. n-gram drafts are point masses: q_j(d_j) = 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.sample.sampler import (
    SamplingMetadata,
    adjust_logits,
    apply_grammar_mask,
    draw_uniforms,
    greedy_argmax,
    invert_cdf,
    logprob_tables,
    no_logprob_tables,
    probabilities,
)

ACCEPT_STREAM = 1  # the acceptance test's uniforms: independent of the draws' (sampler.draw_uniforms)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VerifyOutput:
    token_ids: jax.Array  # i32 [R, K+1]: accepted drafts, then the sampled token; the rest is padding
    num_tokens: jax.Array  # i32 [R]: accepted drafts + 1
    logprobs: jax.Array  # f32 [R, K+1]: of each token under the raw model output (zeros unless wanted)
    top_logprob_ids: jax.Array  # i32 [R, K+1, W]
    top_logprobs: jax.Array  # f32 [R, K+1, W]


def verify(
    logits: jax.Array,
    meta: SamplingMetadata,
    draft_ids: jax.Array,
    num_drafts: jax.Array,
    draft_probs: jax.Array | None = None,
    *,
    row_block: int = 0,
) -> VerifyOutput:
    """logits: f32 [R*(K+1), V], row r*(K+1)+j for position j of request r; meta: as many
    rows; draft_ids: i32 [R, K]; num_drafts: i32 [R] (positions past them are ignored);
    draft_probs: f32 [R, K, V], the distributions the drafts were drawn from (None: point
    masses, as n-gram drafts are). `row_block`: the logprob tables in blocks of that many
    rows (batch invariance: the same blocks as a plain step's, see sampler.logprob_tables)."""
    num_rows, k = draft_ids.shape
    vocab = logits.shape[-1]
    logits = apply_grammar_mask(logits, meta)  # the logprobs below too
    adjusted = adjust_logits(logits, meta)
    position = jnp.arange(k)[None, :]
    is_draft = position < num_drafts[:, None]  # [R, K]

    greedy = greedy_argmax(adjusted).reshape(num_rows, k + 1)
    greedy_accepted = _leading(is_draft & (draft_ids == greedy[:, :k]))
    greedy_last = jnp.take_along_axis(greedy, greedy_accepted[:, None], axis=1)[:, 0]

    def sampled_path():
        p = probabilities(adjusted, meta).reshape(num_rows, k + 1, vocab)
        p_draft = jnp.take_along_axis(p[:, :k], draft_ids[..., None], axis=-1)[..., 0]
        if draft_probs is None:
            q_draft = jnp.ones_like(p_draft)
            residual = p[:, :k] * (1.0 - jax.nn.one_hot(draft_ids, vocab, dtype=p.dtype))  # max(0, p - onehot)
        else:
            q_draft = jnp.take_along_axis(draft_probs, draft_ids[..., None], axis=-1)[..., 0]
            residual = jnp.maximum(p[:, :k] - draft_probs, 0.0)
        u_accept = draw_uniforms(meta, ACCEPT_STREAM).reshape(num_rows, k + 1)[:, :k]
        accepted = _leading(is_draft & (u_accept * q_draft < p_draft))  # u < p/q, without dividing
        # Where acceptance stopped: a rejected draft's residual, or p after the last draft.
        rejected = accepted < num_drafts
        at = accepted[:, None, None]
        p_at = jnp.take_along_axis(p, at, axis=1)[:, 0]
        residual_at = jnp.take_along_axis(residual, jnp.minimum(at, k - 1), axis=1)[:, 0]
        usable = residual_at.sum(-1, keepdims=True) > 0  # 0 only through rounding, where p = q
        dist = jnp.where(rejected[:, None] & usable, residual_at, p_at)
        u_draw = draw_uniforms(meta).reshape(num_rows, k + 1)
        last = invert_cdf(dist, jnp.take_along_axis(u_draw, accepted[:, None], axis=1)[:, 0])
        return accepted, last

    temperature = meta.temperature.reshape(num_rows, k + 1)[:, 0]
    accepted, last = jax.lax.cond(jnp.all(temperature == 0), lambda: (greedy_accepted, greedy_last), sampled_path)
    row_greedy = temperature == 0
    accepted = jnp.where(row_greedy, greedy_accepted, accepted)
    last = jnp.where(row_greedy, greedy_last, last)

    all_positions = jnp.arange(k + 1)[None, :]
    padded_drafts = jnp.pad(draft_ids, ((0, 0), (0, 1)))
    token_ids = jnp.where(all_positions < accepted[:, None], padded_drafts, last[:, None])

    def tables():
        chosen, ids, values = logprob_tables(logits, token_ids.reshape(-1), row_block=row_block)
        return chosen.reshape(num_rows, k + 1), ids.reshape(num_rows, k + 1, -1), values.reshape(num_rows, k + 1, -1)

    def no_tables():
        chosen, ids, values = no_logprob_tables(num_rows * (k + 1), vocab)
        return chosen.reshape(num_rows, k + 1), ids.reshape(num_rows, k + 1, -1), values.reshape(num_rows, k + 1, -1)

    chosen, top_ids, top_values = jax.lax.cond(meta.want_logprobs, tables, no_tables)
    return VerifyOutput(token_ids, accepted + 1, chosen, top_ids, top_values)


def _leading(ok: jax.Array) -> jax.Array:
    """How many leading entries of each row are True. i32 [R]."""
    return jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1).astype(jnp.int32)
