"""Ragged paged attention: many sequences' new tokens, back to back, over a paged KV cache.

The flat token axis holds every scheduled sequence's new tokens (prefill chunks and
decode tokens alike); sequence `s` owns tokens `query_start_loc[s]:query_start_loc[s+1]`,
which are the last `q_len` positions of its `kv_lens[s]`-token context. Its K/V live in
the pages `block_tables[s, :cdiv(kv_lens[s], page_size)]`, already written for this
step's tokens. Attention is causal within a sequence, optionally limited to a sliding
window and soft-capped. A `tree_mask` of W int32 words per new token restricts which of
its sequence's first 32 W new tokens it sees (speculative tree verification, see
`ragged_paged_attention_reference`). An 8-bit cache (fp8 or int8 pages) comes with `k_scales` and
`v_scales` (see `pallas_kernels.quantized_kv`); pages are dequantized as they are loaded.

This module holds the pure-JAX version (XLA gathers and einsums). It is the CPU serving
path and the oracle for the Pallas kernel, which has the same signature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_kv import codes_to_float


def as_mask_words(tree_mask) -> jax.Array:
    """int32 [T, W]: a tree mask given as [T, W] words, or as [T] (one word a token)."""
    tree_mask = jnp.asarray(tree_mask, jnp.int32)
    if tree_mask.ndim not in (1, 2):
        raise ValueError(f"tree_mask is int32 [T] or [T, W], got shape {tree_mask.shape}")
    return tree_mask if tree_mask.ndim == 2 else tree_mask[:, None]


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # int32 [S]: context length of each sequence, this step's tokens included
    block_tables: jax.Array,  # int32 [S, max_pages]: page ids of each sequence, in order
    query_start_loc: jax.Array,  # int32 [S + 1]: cumulative new-token counts
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    query_tile: int | None = None,
    kv_chunk_pages: int | None = None,
    k_scales: jax.Array | None = None,  # float32 [num_pages, num_kv_heads, page_size] of an 8-bit cache
    v_scales: jax.Array | None = None,
    tree_mask: jax.Array | None = None,  # int32 [T, W] or [T] (W = 1): speculative tree verification
) -> jax.Array:  # [T, num_heads, head_dim]; zeros for tokens past query_start_loc[S]
    """Attention of every new token over its own sequence's paged context.

    `tree_mask`: a new token at offset i of its sequence's new tokens sees the new token
    at offset j < 32 W only if bit j % 32 of its word j // 32 is set (on top of causality,
    j <= i). Context keys and new tokens at offsets >= 32 W follow the plain causal rule,
    so words of -1 change nothing. A draft tree to verify is one sequence's new tokens
    [root, node_1 .. node_N] (N < 32 W) in BFS order, each token's words holding the bits
    of the node's ancestors and itself (`scheduler.draft_tree`); other sequences' tokens
    get -1.

    The flat tokens are cut into query tiles, each inside one sequence: by default
    one-token tiles for decode tokens and `PREFILL_TILE`-token tiles for prefill chunks
    (two passes), or `query_tile` tokens for all. Tiles are processed a group at a
    time, and only groups holding real tiles run (T and S are padded buckets, so most
    of their static bound is usually empty). A group walks its sequences' pages
    `kv_chunk_pages` at a time with an online softmax, as far as its longest context,
    so memory stays bounded and padding costs nothing.
    """
    q, k_pages, v_pages, kv_lens, block_tables, query_start_loc = map(
        jnp.asarray, (q, k_pages, v_pages, kv_lens, block_tables, query_start_loc)
    )
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales come together: pass both (an 8-bit cache) or neither")
    scales = None if k_scales is None else (jnp.asarray(k_scales), jnp.asarray(v_scales))
    tree_mask = None if tree_mask is None else as_mask_words(tree_mask)
    chunk_pages = kv_chunk_pages or max(1, 128 // k_pages.shape[1])
    num_tokens, num_seqs = q.shape[0], kv_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    if query_tile:
        passes = [(query_tile, q_lens, max_tiles(num_tokens, num_seqs, query_tile))]
    else:  # tiles sized to each kind of sequence: a decode token alone, a prefill chunk in long tiles
        # A prefill chunk has two or more tokens, so at most T // 2 sequences are in this pass.
        prefill_tile = min(PREFILL_TILE, num_tokens)
        passes = [
            (1, jnp.where(q_lens == 1, 1, 0), max(1, min(num_tokens, num_seqs))),
            (
                prefill_tile,
                jnp.where(q_lens > 1, q_lens, 0),
                max_tiles(num_tokens, min(num_seqs, num_tokens // 2), prefill_tile),
            ),
        ]
    out = jnp.zeros(q.shape, q.dtype)
    q32 = q.astype(jnp.float32) * sm_scale
    for tile, selected, tile_bound in passes:
        out = _attend_tiles(
            out,
            q32,
            k_pages,
            v_pages,
            scales,
            kv_lens,
            block_tables,
            query_start_loc,
            q_lens,
            selected,
            tile,
            tile_bound,
            chunk_pages,
            sliding_window,
            soft_cap,
            tree_mask,
        )
    return out


PREFILL_TILE = 32  # query tokens per tile of a prefill chunk


def max_tiles(num_tokens: int, num_seqs: int, query_tile: int) -> int:
    """Static bound on sum(cdiv(q_len, tq)) over S sequences with sum(q_len) <= T."""
    return max(1, min(num_tokens, (num_tokens + num_seqs * (query_tile - 1)) // query_tile))


# Query rows (tiles x tile length) per group: enough to batch well, few enough that a step
# with one short prompt does not compute a large group of empty tiles.
_GROUP_ROWS = 128


def _attend_tiles(
    out,
    q32,
    k_pages,
    v_pages,
    scales,
    kv_lens,
    block_tables,
    query_start_loc,
    q_lens,
    selected,
    tq,
    max_tiles,
    chunk_pages,
    sliding_window,
    soft_cap,
    tree_mask,
):
    """Attention for the first `selected[s]` new tokens of each sequence s (0 or q_lens[s]),
    in at most `max_tiles` tiles of `tq` tokens, written into `out`."""
    num_tokens, num_heads, head_dim = q32.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs = kv_lens.shape[0]
    groups = num_heads // num_kv_heads
    chunk = chunk_pages * page_size

    # -- cut the selected tokens into per-sequence query tiles ----------------------
    tiles_per_seq = (selected + tq - 1) // tq
    tile_end = jnp.cumsum(tiles_per_seq)
    group_size = min(max_tiles, max(1, _GROUP_ROWS // tq))  # tiles per group
    num_tiles = -(-max_tiles // group_size) * group_size  # whole groups
    tile_ids = jnp.arange(num_tiles)
    seq = jnp.searchsorted(tile_end, tile_ids, side="right")  # [NT]; == S for spare tiles
    tile_valid = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    first_q = (tile_ids - (tile_end[seq] - tiles_per_seq[seq])) * tq  # offset in the sequence
    q_off = first_q[:, None] + jnp.arange(tq)[None, :]  # [NT, TQ]
    q_valid = tile_valid[:, None] & (q_off < selected[seq][:, None])
    token = jnp.where(q_valid, query_start_loc[seq][:, None] + q_off, num_tokens)
    new0 = kv_lens[seq] - q_lens[seq]  # [NT]: position of the sequence's first new token
    q_pos = new0[:, None] + q_off  # position of each query token
    words = None if tree_mask is None else tree_mask[jnp.minimum(token, num_tokens - 1)]  # [NT, TQ, W]
    seq_len = jnp.where(tile_valid, kv_lens[seq], 0)  # [NT]

    # Pad the block table so every chunk slice is in bounds (dynamic_slice would clamp);
    # spare tiles read the null page 0 over and over, which stays in cache.
    max_pages = block_tables.shape[1]
    padded_pages = -(-max_pages // chunk_pages) * chunk_pages
    tables = jnp.pad(block_tables, ((0, 0), (0, padded_pages - max_pages)))[seq]  # [NT, P']
    tables = jnp.where(tile_valid[:, None], tables, 0)

    def attend_group(g, out):
        """Attention for tiles [g * group_size, (g + 1) * group_size)."""

        def take(x):
            return jax.lax.dynamic_slice_in_dim(x, g * group_size, group_size, axis=0)

        g_token, g_valid, g_pos, g_len, g_tables, g_new0 = map(take, (token, q_valid, q_pos, seq_len, tables, new0))
        g_words = None if words is None else take(words)
        # [NG, TQ, H, D] -> [NG, KV, G, TQ, D]
        qt = q32[jnp.minimum(g_token, num_tokens - 1)]
        qt = qt.reshape(group_size, tq, num_kv_heads, groups, head_dim).transpose(0, 2, 3, 1, 4)

        def kv_chunk(c, carry):
            m, l, acc = carry  # [NG, KV, G, TQ], same, [NG, KV, G, TQ, D]
            pages = jax.lax.dynamic_slice_in_dim(g_tables, c * chunk_pages, chunk_pages, axis=1)
            kv_shape = (group_size, chunk, num_kv_heads, head_dim)
            k = codes_to_float(k_pages.at[pages].get(mode="promise_in_bounds"))
            v = codes_to_float(v_pages.at[pages].get(mode="promise_in_bounds"))
            if scales is not None:  # [NG, chunk_pages, KV, page_size] -> per token and head
                k_scale, v_scale = (
                    jnp.swapaxes(x.at[pages].get(mode="promise_in_bounds"), -1, -2)[..., None] for x in scales
                )
                k, v = k * k_scale, v * v_scale
            k, v = k.reshape(kv_shape), v.reshape(kv_shape)
            kv_pos = c * chunk + jnp.arange(chunk)  # [C]
            in_seq = kv_pos[None, :] < g_len[:, None]  # [NG, C]
            # NOTE: slots past the context may hold anything (NaN in tests); zero them so
            # that 0 * garbage never reaches the output.
            v = jnp.where(in_seq[:, :, None, None], v, 0.0)

            s = jnp.einsum("nkgqd,nckd->nkgqc", qt, k)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            mask = in_seq[:, None, :] & g_valid[:, :, None] & (kv_pos[None, None, :] <= g_pos[:, :, None])
            if sliding_window is not None:
                mask &= kv_pos[None, None, :] > g_pos[:, :, None] - sliding_window
            if g_words is not None:
                j = kv_pos[None, None, :] - g_new0[:, None, None]  # [NG, 1, C]: offset among the new tokens
                num_words = g_words.shape[-1]
                bit = sum(  # j & 31: a shift in range for every j
                    jnp.where(j >> 5 == w, (g_words[:, :, w, None] >> (j & 31)) & 1, 0) for w in range(num_words)
                )
                mask &= (j < 0) | (j >= 32 * num_words) | (bit != 0)
            mask = mask[:, None, None]  # [NG, 1, 1, TQ, C]
            s = jnp.where(mask, s, -jnp.inf)

            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with no key yet
            p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
            alpha = jnp.exp(m - m_safe)
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + jnp.einsum("nkgqc,nckd->nkgqd", p, v)
            return m_new, l, acc

        shape = (group_size, num_kv_heads, groups, tq)
        init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(shape + (head_dim,)))
        first_chunk = (
            0
            if sliding_window is None
            else jnp.maximum(jnp.min(jnp.where(g_valid, g_pos, jnp.iinfo(jnp.int32).max)) - sliding_window + 1, 0)
            // chunk
        )
        _, l, acc = jax.lax.fori_loop(first_chunk, (jnp.max(g_len) + chunk - 1) // chunk, kv_chunk, init)
        res = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [NG, KV, G, TQ, D]
        res = res.transpose(0, 3, 1, 2, 4).reshape(group_size * tq, num_heads, head_dim)
        return out.at[g_token.reshape(-1)].set(res.astype(out.dtype), mode="drop")

    num_groups = (tile_end[-1] + group_size - 1) // group_size  # groups holding real tiles
    return jax.lax.fori_loop(0, num_groups, attend_group, out)
