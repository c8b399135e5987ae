"""Random ragged paged-attention cases and a dense NumPy oracle that knows nothing of pages.

Shared by the reference's tests and the Pallas kernel's tests. Every page that no
sequence owns, and every slot past a sequence's context, is NaN: an out-of-bounds read
shows up as NaN in the output.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class AttentionCase:
    q: np.ndarray  # [T, H, D]
    k_pages: np.ndarray  # [P, page_size, KV, D]
    v_pages: np.ndarray
    kv_lens: np.ndarray  # [S]
    block_tables: np.ndarray  # [S, max_pages]
    query_start_loc: np.ndarray  # [S + 1]
    dense_k: list[np.ndarray]  # per sequence [kv_len, KV, D]
    dense_v: list[np.ndarray]
    k_scales: np.ndarray | None = None  # float32 [P, KV, page_size] when the pages are 8-bit
    v_scales: np.ndarray | None = None

    @property
    def num_real_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def make_case(
    rng: np.random.Generator,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    share_first_page: bool = False,
    dtype=np.float32,
) -> AttentionCase:
    """Sequences with the given new-token and context lengths, pages in scrambled order.

    `share_first_page` makes every sequence start with the same page (a shared prefix),
    so its first page_size positions hold the same K/V in all of them.
    """
    assert all(q <= kv for q, kv in zip(q_lens, kv_lens))
    pages_needed = [-(-kv // page_size) for kv in kv_lens]
    max_pages = max(max(pages_needed), 1)
    distinct = sum(pages_needed) - (len(kv_lens) - 1 if share_first_page else 0)
    num_pages = distinct + 3  # a few pages nobody owns
    k_pages = np.full((num_pages, page_size, num_kv_heads, head_dim), np.nan, dtype)
    v_pages = np.full_like(k_pages, np.nan)
    free = list(rng.permutation(num_pages))
    shared = None
    if share_first_page:
        shared = free.pop()
        k_pages[shared] = rng.standard_normal(k_pages.shape[1:]).astype(dtype)
        v_pages[shared] = rng.standard_normal(v_pages.shape[1:]).astype(dtype)
    tables = np.zeros((len(kv_lens) + pad_seqs, max_pages), np.int32)
    dense_k, dense_v = [], []
    for s, kv in enumerate(kv_lens):
        k = rng.standard_normal((kv, num_kv_heads, head_dim)).astype(dtype)
        v = rng.standard_normal((kv, num_kv_heads, head_dim)).astype(dtype)
        for i in range(pages_needed[s]):
            rows = slice(i * page_size, min(kv, (i + 1) * page_size))
            n = rows.stop - rows.start
            if i == 0 and shared is not None:
                page = shared
                k[rows], v[rows] = k_pages[page, :n], v_pages[page, :n]
            else:
                page = free.pop()
                k_pages[page, :n], v_pages[page, :n] = k[rows], v[rows]
            tables[s, i] = page
        dense_k.append(k)
        dense_v.append(v)
    qsl = np.zeros(len(kv_lens) + pad_seqs + 1, np.int32)
    qsl[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1 :] = qsl[len(q_lens)]
    num_tokens = int(qsl[-1]) + pad_tokens
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(dtype)
    lens = np.array(list(kv_lens) + [0] * pad_seqs, np.int32)
    return AttentionCase(q, k_pages, v_pages, lens, tables, qsl, dense_k, dense_v)


@dataclasses.dataclass(frozen=True)
class SequenceData:
    """One sequence's new tokens' queries and its whole context, to be packed by `pack_case`."""

    q: np.ndarray  # [q_len, H, D]: the last q_len positions of the context
    k: np.ndarray  # [kv_len, KV, D]
    v: np.ndarray


def random_sequence(rng: np.random.Generator, q_len: int, kv_len: int, *, num_heads, num_kv_heads, head_dim, dtype):
    """A sequence of standard normal q / K / V: q_len new tokens at the end of kv_len positions."""
    assert 0 < q_len <= kv_len
    k, v = (rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(dtype) for _ in range(2))
    return SequenceData(rng.standard_normal((q_len, num_heads, head_dim)).astype(dtype), k, v)


def pack_case(
    rng: np.random.Generator, seqs: list[SequenceData], *, page_size: int, pad_tokens: int = 0
) -> AttentionCase:
    """These sequences as one batch, in this order: pages scrambled, a few owned by nobody,
    NaN in every slot no sequence uses; `pad_tokens` random queries at the end."""
    pages_needed = [-(-len(s.k) // page_size) for s in seqs]
    num_pages = sum(pages_needed) + 3
    _, num_kv_heads, head_dim = seqs[0].k.shape
    k_pages = np.full((num_pages, page_size, num_kv_heads, head_dim), np.nan, seqs[0].k.dtype)
    v_pages = np.full_like(k_pages, np.nan)
    free = list(rng.permutation(num_pages))
    tables = np.zeros((len(seqs), max(pages_needed)), np.int32)
    for i, seq in enumerate(seqs):
        for j in range(pages_needed[i]):
            rows = slice(j * page_size, min(len(seq.k), (j + 1) * page_size))
            page = tables[i, j] = free.pop()
            k_pages[page, : rows.stop - rows.start], v_pages[page, : rows.stop - rows.start] = seq.k[rows], seq.v[rows]
    qsl = np.concatenate([[0], np.cumsum([len(s.q) for s in seqs])]).astype(np.int32)
    pad = rng.standard_normal((pad_tokens, *seqs[0].q.shape[1:])).astype(seqs[0].q.dtype)
    q = np.concatenate([s.q for s in seqs] + [pad])
    kv_lens = np.array([len(s.k) for s in seqs], np.int32)
    return AttentionCase(q, k_pages, v_pages, kv_lens, tables, qsl, [s.k for s in seqs], [s.v for s in seqs])


def dense_attention(
    case: AttentionCase,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    tree_mask: np.ndarray | None = None,
) -> np.ndarray:
    """float64 attention, one sequence at a time over its dense K/V. Padding rows are 0.

    With `tree_mask` (int32 [T, W] words a token, or [T]: one), token t sees its sequence's
    new token at offset j < 32 W only if bit j % 32 of tree_mask[t, j // 32] is set.
    """
    words = None if tree_mask is None else np.asarray(tree_mask).reshape(len(case.q), -1)
    num_tokens, num_heads, head_dim = case.q.shape
    groups = num_heads // case.k_pages.shape[2]
    out = np.zeros((num_tokens, num_heads, head_dim))
    for s, (k, v) in enumerate(zip(case.dense_k, case.dense_v)):
        start, end = case.query_start_loc[s], case.query_start_loc[s + 1]
        kv_len = len(k)
        for t in range(start, end):
            pos = kv_len - (end - start) + (t - start)
            keys = np.arange(kv_len)
            allowed = keys <= pos
            if sliding_window is not None:
                allowed &= keys > pos - sliding_window
            if words is not None:
                offset = keys - (kv_len - (end - start))  # among the sequence's new tokens
                limit = 32 * words.shape[1]
                bits = np.array([int(words[t, j // 32]) >> j % 32 & 1 if 0 <= j < limit else 1 for j in offset], bool)
                allowed &= bits
            for h in range(num_heads):
                kh = k[:, h // groups].astype(np.float64)
                vh = v[:, h // groups].astype(np.float64)
                scores = kh @ case.q[t, h].astype(np.float64) * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                scores = np.where(allowed, scores, -np.inf)
                p = np.exp(scores - scores.max())
                out[t, h] = (p / p.sum()) @ vh
    return out


def quantize_case(case: AttentionCase, dtype, rng: np.random.Generator) -> tuple[AttentionCase, AttentionCase]:
    """The case with an 8-bit KV cache (`pallas_kernels.quantized_kv`), and the same case
    with those pages dequantized to float32 (no scales), for the references.

    Both cases' dense K/V are the dequantized values. Slots no sequence uses keep
    garbage: NaN values (or, for int8, which has no NaN, random bytes) and NaN scales.
    `dtype` is float8_e4m3fn, uint8 (e4m3 bit patterns, as the engine stores fp8) or int8.
    """
    import jax.numpy as jnp

    from pallas_kernels.quantized_kv import dequantize_kv, quantize_kv

    num_pages, page_size = case.k_pages.shape[:2]
    used = np.zeros((num_pages, page_size), bool)  # [P, page_size]
    for s, kv_len in enumerate(case.kv_lens):
        for i in range(-(-int(kv_len) // page_size)):
            used[case.block_tables[s, i], : min(page_size, kv_len - i * page_size)] = True

    def quantize(pages):
        q, scales = quantize_kv(jnp.asarray(np.where(used[..., None, None], pages, 0), jnp.float32), dtype)
        q, scales = np.array(q), np.array(jnp.swapaxes(scales, -1, -2))  # scales [P, KV, page_size]
        if jnp.dtype(dtype) == jnp.int8:
            garbage = rng.integers(-128, 128, q.shape).astype(np.int8)
        elif jnp.dtype(dtype) == jnp.uint8:  # e4m3 bit patterns: 0x7F is NaN
            garbage = np.full(q.shape, 0x7F, np.uint8)
        else:
            garbage = np.full(q.shape, np.nan, np.float32).astype(q.dtype)
        q = np.where(used[..., None, None], q, garbage)
        scales = np.where(used[:, None, :], scales, np.nan).astype(np.float32)
        return q, scales, np.array(dequantize_kv(jnp.asarray(q), jnp.asarray(scales)))

    k, k_scales, k_deq = quantize(case.k_pages)
    v, v_scales, v_deq = quantize(case.v_pages)
    dense_k, dense_v = [], []
    for s, kv_len in enumerate(case.kv_lens[: len(case.dense_k)]):
        pages = case.block_tables[s, : -(-int(kv_len) // page_size)]
        dense_k.append(k_deq[pages].reshape(-1, *k_deq.shape[2:])[:kv_len])
        dense_v.append(v_deq[pages].reshape(-1, *v_deq.shape[2:])[:kv_len])
    quantized = dataclasses.replace(
        case, k_pages=k, v_pages=v, k_scales=k_scales, v_scales=v_scales, dense_k=dense_k, dense_v=dense_v
    )
    return quantized, dataclasses.replace(quantized, k_pages=k_deq, v_pages=v_deq, k_scales=None, v_scales=None)


def tree_mask_words(parents: list[int], num_words: int) -> np.ndarray:
    """int32 [N, num_words]: the mask words of a draft tree in BFS order (parents[i] < i; the
    root's is -1): node i's bits are those of its ancestors and itself, bit j in word j // 32."""
    masks: list[int] = []
    for i, parent in enumerate(parents):
        assert parent < i < 32 * num_words
        masks.append((masks[parent] if parent >= 0 else 0) | 1 << i)
    words = [[mask >> 32 * w & 0xFFFFFFFF for w in range(num_words)] for mask in masks]
    return np.array(words, np.uint64).astype(np.uint32).view(np.int32)  # bit 31 is the sign


def tree_words(parents: list[int]) -> list[int]:
    """One int32 mask word a node (see tree_mask_words): trees of at most 32 positions."""
    return tree_mask_words(parents, 1)[:, 0].tolist()


def kary_tree(num_nodes: int, k: int) -> list[int]:
    """Parents of a complete k-ary draft tree in BFS order (k = 1: a chain)."""
    return [-1] + [(i - 1) // k for i in range(1, num_nodes)]


def batch_tree_mask(case: AttentionCase, trees: dict[int, list[int]], num_words: int | None = None) -> np.ndarray:
    """int32 [T, num_words] (or [T]: one word when None): sequence s's new tokens carry the
    words of `trees[s]` (tree_mask_words), every other token -1."""
    mask = np.full((case.q.shape[0], num_words or 1), -1, np.int32)
    for s, parents in trees.items():
        start, end = case.query_start_loc[s], case.query_start_loc[s + 1]
        assert end - start == len(parents), (s, end - start, len(parents))
        mask[start:end] = tree_mask_words(parents, num_words or 1)
    return mask if num_words else mask[:, 0]
