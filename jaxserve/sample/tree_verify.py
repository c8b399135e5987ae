"""Verifying a tree of draft tokens (SpecInfer, EAGLE, Medusa): which path to accept, and
the token that follows it (jitted; the tree is static).

The target scores every tree position in one step (under the tree's attention mask): row
r * (N+1) + i of the logits is request r's distribution of the children of position i.
Each row is shaped as the sampler shapes a row; the caller gives position i the metadata
of output token `output_index + depth(i)` (its penalty history: the path to i), so the
target distribution p at i is the one plain sampling would draw from after that path.

- Greedy rows accept the longest path whose every draft is the argmax at its parent (the
  longest accepted prefix over the tree's paths, as SpecInfer and EAGLE do; the first in
  BFS order among equally long ones, which only siblings repeating a token make
  possible), then emit the argmax at its end (the bonus token).
- Sampling rows use recursive rejection sampling over siblings (Jeon et al. 2024,
  "Recursive Speculative Decoding"; SpecInfer's rule is the same for i.i.d. siblings).
  At a position with target p_1 and children c_1..c_m in rank order, c_j is accepted with
  probability min(1, p_j(c_j) / q_j(c_j)), and the walk moves to it; on a rejection
  p_{j+1} = normalize(max(0, p_j - q_j)). With no child accepted the token is drawn from
  the last residual. q_j is the distribution c_j was drawn from given c_1..c_{j-1}:
  siblings drawn without replacement from q (EAGLE) have q_j = q without c_1..c_{j-1},
  renormalized; deterministic candidates (top-k of some model, Medusa heads, n-gram) are
  point masses, q_j = onehot(c_j), and a rejected one is simply removed from p.

Why exact, by induction over the siblings left: if c_j is drawn from q_j independently of
the verifier's uniforms, then accepting it with min(1, p_j/q_j), and otherwise emitting
whatever a procedure exact for the residual emits, is exactly p_j (the speculative
sampling identity). The rest of the siblings is such a procedure for any q_{j+1} that
c_{j+1} was drawn from; with no sibling left it is a draw from p_{j+1}. Below an accepted
child the same holds for the child's own target, by induction over depth.
NOTE: a rejected sibling's residual mass is 0 (rejection needs p_j(c_j) < q_j(c_j)),
so a later sibling repeating its token is always rejected; and a pruned tree must drop a node's last
siblings, not earlier ones, when siblings were drawn without replacement (sibling j came
from q without siblings 0..j-1, which verification only removes as it rejects them).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

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
from scheduler.draft_tree import DraftTree

TREE_ACCEPT_STREAM0 = 16  # sibling rank j's acceptance test: stream 16 + j (sampler.draw_uniforms)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeVerifyOutput:
    token_ids: jax.Array  # i32 [R, D+1]: the accepted path's drafts, then the drawn token, which the rest repeats
    num_tokens: jax.Array  # i32 [R]: accepted drafts + 1
    path: jax.Array  # i32 [R, D+1]: tree positions of the root and the accepted drafts; the rest repeats the last
    logprobs: jax.Array  # f32 [R, D+1]: of each token under the raw model output (zeros unless wanted)
    top_logprob_ids: jax.Array  # i32 [R, D+1, W]
    top_logprobs: jax.Array  # f32 [R, D+1, W]


def verify_tree(
    logits: jax.Array,
    meta: SamplingMetadata,
    tree: DraftTree,
    draft_ids: jax.Array,
    valid: jax.Array,
    draft_probs: jax.Array | None = None,
    *,
    row_block: int = 0,
) -> TreeVerifyOutput:
    """logits: f32 [R*(N+1), V], row r*(N+1)+i for tree position i of request r; meta: as
    many rows; draft_ids: i32 [R, N+1], each position's token (column 0, the root's, is not
    read); valid: bool [R, N+1], a request's pruned tree (an invalid node's descendants are
    invalid too); draft_probs: f32 [R, N+1, V], the q each position's children were drawn
    from without replacement (None: point masses). D is tree.max_depth. `row_block`: the
    logprob tables in blocks of that many rows (see sampler.logprob_tables)."""
    num_rows, width = draft_ids.shape
    if width != tree.num_nodes + 1 or logits.shape[0] != num_rows * width:
        raise ValueError(f"{tree.num_nodes=} does not fit {draft_ids.shape=} and {logits.shape=}")
    vocab = logits.shape[-1]
    logits = apply_grammar_mask(logits, meta)  # the logprobs below too
    adjusted = adjust_logits(logits, meta)
    greedy_path, greedy_last = _greedy_path(tree, greedy_argmax(adjusted).reshape(num_rows, width), draft_ids, valid)

    def sampled():
        p = probabilities(adjusted, meta).reshape(num_rows, width, vocab)
        u_accept = [
            draw_uniforms(meta, TREE_ACCEPT_STREAM0 + j).reshape(num_rows, width)
            for j in range(max(map(len, tree.children)))
        ]
        u_draw = draw_uniforms(meta).reshape(num_rows, width)
        return _sampled_walk(tree, p, draft_probs, draft_ids, valid, u_accept, u_draw)

    temperature = meta.temperature.reshape(num_rows, width)[:, 0]
    path, last = jax.lax.cond(jnp.all(temperature == 0), lambda: (greedy_path, greedy_last), sampled)
    row_greedy = temperature == 0
    path = jnp.where(row_greedy[:, None], greedy_path, path)
    last = jnp.where(row_greedy, greedy_last, last)

    accepted = jnp.asarray(tree.depth)[path[:, -1]]
    on_path = jnp.pad(jnp.take_along_axis(draft_ids, path[:, 1:], axis=1), ((0, 0), (0, 1)))
    token_ids = jnp.where(jnp.arange(tree.max_depth + 1)[None, :] < accepted[:, None], on_path, last[:, None])
    logits = logits.reshape(num_rows, width, vocab)
    chosen, top_ids, top_values = _logprobs(logits, path, token_ids, meta, row_block)
    return TreeVerifyOutput(token_ids.astype(jnp.int32), accepted + 1, path, chosen, top_ids, top_values)


def _child(tree: DraftTree, cur: jax.Array, rank: int, draft_ids: jax.Array, valid: jax.Array):
    """The child of rank `rank` of each row's position `cur`: its position, its token, and
    whether the row's tree has it. Positions without one name the root (not a child)."""
    table = np.array([kids[rank] if rank < len(kids) else 0 for kids in tree.children], np.int32)
    child = jnp.asarray(table)[cur]
    rows = jnp.arange(cur.shape[0])
    return child, draft_ids[rows, child], (child > 0) & valid[rows, child]


def _branching(tree: DraftTree, depth: int) -> int:
    """The most children of a position at `depth`: the static number of sibling tests."""
    return max(len(kids) for kids, d in zip(tree.children, tree.depth) if d == depth)


def _greedy_path(tree: DraftTree, best: jax.Array, draft_ids: jax.Array, valid: jax.Array):
    """best: i32 [R, N+1], the argmax at each position. The longest path whose drafts all
    equal the argmax at their parent (the first in BFS order among equally long ones)
    [R, D+1], and the argmax at its end [R]."""
    rows = jnp.arange(draft_ids.shape[0])
    matches = [jnp.ones(rows.shape, bool)]  # the root's path: nothing to match
    for i in range(1, tree.num_nodes + 1):
        a = tree.parent[i]
        matches.append(matches[a] & valid[:, i] & (draft_ids[:, i] == best[:, a]))
    end = jnp.argmax(jnp.where(jnp.stack(matches, axis=1), jnp.asarray(tree.depth), -1), axis=1)
    return jnp.asarray(tree.path_table)[end], best[rows, end].astype(jnp.int32)


def _sampled_walk(
    tree: DraftTree,
    p_all: jax.Array,
    q_all: jax.Array | None,
    draft_ids: jax.Array,
    valid: jax.Array,
    u_accept: list[jax.Array],
    u_draw: jax.Array,
):
    """p_all: f32 [R, N+1, V], the target at each position; q_all: the same shape or None
    (point masses); u_accept: per rank, f32 [R, N+1]; u_draw: f32 [R, N+1]. The accepted
    path [R, D+1] and the token drawn at its end [R]."""
    rows = jnp.arange(draft_ids.shape[0])
    cur = jnp.zeros_like(rows)
    going = jnp.ones(rows.shape, bool)
    p = p_all[:, 0]  # a row's current target: the residual, once it has stopped
    path = [cur]
    for depth in range(tree.max_depth):
        q = None if q_all is None else q_all[rows, cur]
        moved = jnp.zeros_like(going)
        nxt = cur
        for rank in range(_branching(tree, depth)):
            child, token, has = _child(tree, cur, rank, draft_ids, valid)
            trying = has & going & ~moved
            accept, p_next, q_next = _sibling_test(p, q, token, u_accept[rank][rows, cur])
            rejected = trying & ~accept
            p = jnp.where(rejected[:, None], p_next, p)
            q = None if q is None else jnp.where(rejected[:, None], q_next, q)
            nxt = jnp.where(trying & accept, child, nxt)
            moved = moved | (trying & accept)
        going = going & moved
        cur = nxt
        p = jnp.where(going[:, None], p_all[rows, cur], p)
        path.append(cur)
    return jnp.stack(path, axis=1), invert_cdf(p, u_draw[rows, cur])


def _sibling_test(p: jax.Array, q: jax.Array | None, token: jax.Array, u: jax.Array):
    """One candidate against target p (f32 [R, V], normalized): accepted with probability
    min(1, p(t) / q_j(t)); the residual normalize(max(0, p - q_j)) and q without t, for
    the next sibling. q: the draft's remaining mass (unnormalized), None for point masses."""
    one_hot = jax.nn.one_hot(token, p.shape[-1], dtype=p.dtype)
    q_j = one_hot if q is None else q / jnp.maximum(q.sum(-1, keepdims=True), jnp.finfo(q.dtype).tiny)
    p_t = (p * one_hot).sum(-1)
    q_t = (q_j * one_hot).sum(-1)
    residual = jnp.maximum(p - q_j, 0.0)
    mass = residual.sum(-1, keepdims=True)
    # 0 only through rounding where p = q_j, and then no rejection is possible: keep p.
    p_next = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)
    q_next = None if q is None else q * (1.0 - one_hot)  # without replacement
    return u * q_t < p_t, p_next, q_next  # u < p/q, without dividing


def _logprobs(logits: jax.Array, path: jax.Array, token_ids: jax.Array, meta: SamplingMetadata, row_block: int):
    """Each output token's log-probability under the raw logits at the position it was
    drawn from (path[k] for token k), and the top tables; zeros unless some row asks."""
    num_rows, steps = path.shape

    def shaped(tables):
        return tuple(t.reshape(num_rows, steps, *t.shape[1:]) for t in tables)

    def tables():
        drawn_from = logits[jnp.arange(num_rows)[:, None], path].reshape(num_rows * steps, -1)  # [R*(D+1), V]
        return shaped(logprob_tables(drawn_from, token_ids.reshape(-1), row_block=row_block))

    return jax.lax.cond(
        meta.want_logprobs, tables, lambda: shaped(no_logprob_tables(num_rows * steps, logits.shape[-1]))
    )
