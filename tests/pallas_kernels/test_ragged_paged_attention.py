"""The pure-JAX ragged paged attention against a dense float64 oracle."""

import jax
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.attention_cases import dense_attention, make_case, quantize_case


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
    case = make_case(rng, q_lens, kv_lens, num_heads=2 * groups, num_kv_heads=2, head_dim=16,
                     page_size=4, pad_tokens=3, pad_seqs=1)
    scale = 16**-0.5
    want = dense_attention(case, sm_scale=scale, sliding_window=window, soft_cap=soft_cap)
    for tile, chunk in [(None, None), (1, 1), (4, 2), (16, 3)]:
        got = run_reference(case, sm_scale=scale, sliding_window=window, soft_cap=soft_cap,
                            query_tile=tile, kv_chunk_pages=chunk)
        assert np.isfinite(got).all(), (tile, chunk)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=f"{tile=} {chunk=}")


def test_shared_prefix_page_and_jit():
    rng = np.random.default_rng(7)
    case = make_case(rng, [3, 1, 6], [10, 7, 6], num_heads=4, num_kv_heads=1, head_dim=8,
                     page_size=4, share_first_page=True)
    want = dense_attention(case, sm_scale=0.3)
    fn = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "query_tile"))
    got = np.asarray(fn(case.q, case.k_pages, case.v_pages, case.kv_lens, case.block_tables,
                        case.query_start_loc, sm_scale=0.3, query_tile=2))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["uint8", "int8", "float8_e4m3fn"])
def test_8bit_cache_equals_the_dequantized_pages(dtype):
    """With k_scales / v_scales the pages are 8-bit codes; the result is attention over the
    values they stand for (the dense oracle and the reference on dequantized pages)."""
    rng = np.random.default_rng(11)
    case = make_case(rng, [13, 5, 1, 1], [13, 21, 9, 33], num_heads=6, num_kv_heads=2, head_dim=16,
                     page_size=4, pad_tokens=3, pad_seqs=1)
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
