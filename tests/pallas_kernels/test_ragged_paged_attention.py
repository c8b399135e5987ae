"""The pure-JAX ragged paged attention against a dense float64 oracle."""

import jax
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.attention_cases import batch_tree_mask, dense_attention, kary_tree, make_case, quantize_case, tree_words


def run_reference(case, **kwargs):
    out = ragged_paged_attention_reference(
        case.q, case.k_pages, case.v_pages, case.kv_lens, case.block_tables, case.query_start_loc, **kwargs
    )
    return np.asarray(out, np.float64)


@pytest.mark.parametrize("groups", [1, 3, 8])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (None, 2.0), (7, 3.0)])
def test_mixed_prefill_and_decode(groups, window, soft_cap):
    rng = np.random.default_rng(groups * 100 + (window or 0))
    # A long prefill, a chunk that continues an earlier prefill, and three decodes; some
    # contexts end mid-page, one sequence is padding, and three tokens are padding.
    q_lens, kv_lens = [13, 5, 1, 1, 1], [13, 21, 9, 16, 33]
    case = make_case(
        rng, q_lens, kv_lens, num_heads=2 * groups, num_kv_heads=2, head_dim=16, page_size=4, pad_tokens=3, pad_seqs=1
    )
    scale = 16**-0.5
    want = dense_attention(case, sm_scale=scale, sliding_window=window, soft_cap=soft_cap)
    for tile, chunk in [(None, None), (1, 1), (4, 2), (16, 3)]:
        got = run_reference(
            case, sm_scale=scale, sliding_window=window, soft_cap=soft_cap, query_tile=tile, kv_chunk_pages=chunk
        )
        assert np.isfinite(got).all(), (tile, chunk)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"{tile=} {chunk=}")


def test_shared_prefix_page_and_jit():
    rng = np.random.default_rng(7)
    case = make_case(
        rng, [3, 1, 6], [10, 7, 6], num_heads=4, num_kv_heads=1, head_dim=8, page_size=4, share_first_page=True
    )
    want = dense_attention(case, sm_scale=0.3)
    fn = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "query_tile"))
    got = np.asarray(
        fn(
            case.q,
            case.k_pages,
            case.v_pages,
            case.kv_lens,
            case.block_tables,
            case.query_start_loc,
            sm_scale=0.3,
            query_tile=2,
        )
    )
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["uint8", "int8", "float8_e4m3fn"])
def test_8bit_cache_equals_the_dequantized_pages(dtype):
    """With k_scales / v_scales the pages are 8-bit codes; the result is attention over the
    values they stand for (the dense oracle and the reference on dequantized pages)."""
    rng = np.random.default_rng(11)
    case = make_case(
        rng,
        [13, 5, 1, 1],
        [13, 21, 9, 33],
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        page_size=4,
        pad_tokens=3,
        pad_seqs=1,
    )
    quantized, dequantized = quantize_case(case, dtype, rng)
    for window in (None, 6):
        kwargs = dict(sm_scale=0.25, sliding_window=window)
        want = dense_attention(quantized, **kwargs)
        got = run_reference(quantized, k_scales=quantized.k_scales, v_scales=quantized.v_scales, **kwargs)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(got, run_reference(dequantized, **kwargs), atol=2e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="both"):
        run_reference(quantized, sm_scale=0.25, k_scales=quantized.k_scales)


# Draft trees to verify, in BFS order (each node's parent; the root's is -1): a chain, and
# a tree with two or three children per node over three levels.
CHAIN = [-1, 0, 1, 2, 3]
BUSHY = [-1, 0, 0, 0, 1, 1, 2, 3, 3, 3, 5]


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, None), (None, 2.0), (9, 3.0)])
def test_tree_verification_in_a_mixed_batch(groups, window, soft_cap):
    """A prefill chunk, decodes and two draft trees in one batch; the trees' new tokens
    cross a page boundary, and one tree starts at position 0."""
    rng = np.random.default_rng(groups * 10 + (window or 0))
    q_lens, kv_lens = [13, 1, len(CHAIN), 1, len(BUSHY)], [20, 9, 22, 16, len(BUSHY)]
    case = make_case(
        rng, q_lens, kv_lens, num_heads=2 * groups, num_kv_heads=2, head_dim=16, page_size=4, pad_tokens=3, pad_seqs=1
    )
    mask = batch_tree_mask(case, {2: CHAIN, 4: BUSHY})
    kwargs = dict(sm_scale=0.25, sliding_window=window, soft_cap=soft_cap)
    want = dense_attention(case, tree_mask=mask, **kwargs)
    assert not np.allclose(want, dense_attention(case, **kwargs)), "the trees must change something"
    for tile, chunk in [(None, None), (1, 1), (4, 2), (16, 3)]:
        got = run_reference(case, tree_mask=mask, query_tile=tile, kv_chunk_pages=chunk, **kwargs)
        assert np.isfinite(got).all(), (tile, chunk)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"{tile=} {chunk=}")
    # A word of -1 is no tree: the very same numbers as without one.
    all_bits = np.full(case.q.shape[0], -1, np.int32)
    np.testing.assert_array_equal(run_reference(case, tree_mask=all_bits, **kwargs), run_reference(case, **kwargs))


def test_tree_of_32_nodes_and_offsets_past_32():
    """Bit 31 (the sign) is node 31's; new tokens at offsets >= 32 and context keys
    ignore the words (random ones here, each with its own bit)."""
    rng = np.random.default_rng(5)
    binary = kary_tree(32, 2)
    case = make_case(rng, [32, 40], [40, 45], num_heads=4, num_kv_heads=2, head_dim=16, page_size=8)
    mask = batch_tree_mask(case, {0: binary})
    assert mask[31] < 0 and tree_words(binary)[31] == mask[31]
    own_bit = np.where(np.arange(40) < 32, 1 << np.minimum(np.arange(40), 31), 0).astype(np.uint32)
    mask[32:] = (rng.integers(0, 1 << 32, 40, dtype=np.uint32) | own_bit).view(np.int32)
    want = dense_attention(case, sm_scale=0.25, tree_mask=mask)
    for tile in (None, 8):
        got = run_reference(case, sm_scale=0.25, tree_mask=mask, query_tile=tile)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"{tile=}")


@pytest.mark.parametrize("window", [None, 40])
def test_trees_past_32_nodes_in_several_words(window):
    """Trees of 70 and 40 nodes (3 words a token) beside a chain; a sequence with more new
    tokens than the words cover (100 > 96) sees those past them causally, whatever its words."""
    rng = np.random.default_rng(21)
    big, middle, chain = kary_tree(71, 2), kary_tree(41, 4), kary_tree(6, 1)
    q_lens, kv_lens = [len(big), 1, len(chain), len(middle), 100], [len(big) + 9, 30, 50, len(middle), 120]
    case = make_case(rng, q_lens, kv_lens, num_heads=4, num_kv_heads=2, head_dim=16, page_size=8, pad_tokens=3)
    mask = batch_tree_mask(case, {0: big, 2: chain, 3: middle}, num_words=3)
    last = slice(case.query_start_loc[4], case.query_start_loc[5])
    offsets = np.arange(100)
    own = np.zeros((100, 3), np.uint32)
    own[offsets < 96, np.minimum(offsets // 32, 2)[offsets < 96]] = 1 << (offsets[offsets < 96] % 32)
    mask[last] = (rng.integers(0, 1 << 32, (100, 3), dtype=np.uint32) | own).view(np.int32)
    kwargs = dict(sm_scale=0.25, sliding_window=window)
    want = dense_attention(case, tree_mask=mask, **kwargs)
    one_word = mask[:, :1]  # the first 32 positions only
    assert not np.allclose(want, dense_attention(case, tree_mask=one_word, **kwargs)), "words 1 and 2 must matter"
    for tile, chunk in [(None, None), (8, 2), (32, 4)]:
        got = run_reference(case, tree_mask=mask, query_tile=tile, kv_chunk_pages=chunk, **kwargs)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"{tile=} {chunk=}")


def test_a_mask_of_one_word_a_token_may_come_as_t_or_t_by_1():
    rng = np.random.default_rng(22)
    case = make_case(rng, [len(BUSHY), 1], [len(BUSHY) + 5, 12], num_heads=4, num_kv_heads=2, head_dim=16, page_size=4)
    mask = batch_tree_mask(case, {0: BUSHY})
    np.testing.assert_array_equal(
        run_reference(case, sm_scale=0.25, tree_mask=mask), run_reference(case, sm_scale=0.25, tree_mask=mask[:, None])
    )


def test_tree_verification_with_an_8bit_cache():
    rng = np.random.default_rng(12)
    case = make_case(
        rng, [5, 1, len(BUSHY)], [21, 9, 30], num_heads=6, num_kv_heads=2, head_dim=16, page_size=4, pad_tokens=2
    )
    quantized, dequantized = quantize_case(case, "int8", rng)
    mask = batch_tree_mask(case, {0: CHAIN, 2: BUSHY})
    kwargs = dict(sm_scale=0.25, tree_mask=mask)
    got = run_reference(quantized, k_scales=quantized.k_scales, v_scales=quantized.v_scales, **kwargs)
    np.testing.assert_allclose(got, dense_attention(quantized, **kwargs), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got, run_reference(dequantized, **kwargs), atol=2e-6, rtol=1e-6)
