"""The C++ CPU kernels (XLA FFI): attention against the dense float64 oracle and against the
pure-JAX reference on the same inputs (unused pages and slots are NaN, tests/attention_cases:
a read outside a sequence's context shows up as NaN); the small matmul, the int4 matmul and the
decoder-layer blocks against NumPy in float64."""

import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.weights.load import default_cache_dir
from pallas_kernels import cpu_kernels
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from tests.attention_cases import batch_tree_mask, dense_attention, kary_tree, make_case
from tests.tiny_models import q8_0_table


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.build(default_cache_dir()) is None


def run_kernel(case, **kwargs):
    out = jax.jit(cpu_kernels.ragged_paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap"))(
        case.q, case.k_pages, case.v_pages, case.kv_lens, case.block_tables, case.query_start_loc, **kwargs
    )
    return np.asarray(out, np.float64)


@pytest.mark.parametrize("groups,head_dim", [(1, 16), (3, 64), (5, 64), (1, 128), (2, 128), (4, 128), (8, 128)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (5, None), (None, 2.0), (40, 3.0)])
def test_mixed_prefill_and_decode(groups, head_dim, window, soft_cap):
    """A prefill longer than a query block (16) and a key chunk (32), a chunk continuing an
    earlier prefill, decodes with long contexts; contexts end mid-page; padding tokens and a
    padding sequence."""
    rng = np.random.default_rng(groups * 100 + (window or 0))
    q_lens, kv_lens = [45, 5, 1, 1, 1], [45, 70, 9, 16, 133]
    case = make_case(
        rng,
        q_lens,
        kv_lens,
        num_heads=2 * groups,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=8,
        pad_tokens=3,
        pad_seqs=1,
    )
    kwargs = dict(sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    got = run_kernel(case, **kwargs)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, dense_attention(case, **kwargs), atol=2e-5, rtol=1e-5)


def test_many_decodes_split_over_threads():
    """Enough units (sequences x KV heads) that XLA's thread pool takes some of them, and
    that a decode token's KV heads are read in one unit."""
    rng = np.random.default_rng(3)
    kv_lens = list(rng.integers(1, 300, 48))
    case = make_case(
        rng, [1] * 48, kv_lens, num_heads=9, num_kv_heads=3, head_dim=64, page_size=16, pad_tokens=16, pad_seqs=16
    )
    got = run_kernel(case, sm_scale=0.125)
    np.testing.assert_allclose(got, dense_attention(case, sm_scale=0.125), atol=2e-5, rtol=1e-5)
    # The first four sequences alone are too few units to take their heads together: the same bits.
    few = dataclasses.replace(
        case,
        q=case.q[:4],
        kv_lens=case.kv_lens[:4],
        block_tables=case.block_tables[:4],
        query_start_loc=case.query_start_loc[:5],
    )
    np.testing.assert_array_equal(run_kernel(few, sm_scale=0.125), got[:4])


@pytest.mark.parametrize("head_dim,window", [(128, None), (64, 37)])
def test_many_decodes_beside_longer_rows(head_dim, window):
    """Units of several KV heads (one decode token each) beside units of several tokens, which
    take their heads one by one: against the dense oracle, in float32 and in bfloat16."""
    rng = np.random.default_rng(4)
    q_lens = [1] * 40 + [5, 18, 1, 3]
    kv_lens = [int(n) for n in rng.integers(20, 300, 40)] + [60, 18, 1, 90]
    case = make_case(rng, q_lens, kv_lens, num_heads=8, num_kv_heads=4, head_dim=head_dim, page_size=16, pad_tokens=5)
    kwargs = dict(sm_scale=head_dim**-0.5, sliding_window=window)
    np.testing.assert_allclose(run_kernel(case, **kwargs), dense_attention(case, **kwargs), atol=2e-5, rtol=1e-5)
    args = [jnp.asarray(x, "bfloat16") for x in (case.q, case.k_pages, case.v_pages)]
    args += [case.kv_lens, case.block_tables, case.query_start_loc]
    got = cpu_kernels.ragged_paged_attention(*args, **kwargs)
    want = ragged_paged_attention_reference(*args, **kwargs)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("window", [None, 7])
def test_tree_verification_in_a_mixed_batch(window):
    rng = np.random.default_rng(11)
    bushy, chain = kary_tree(31, 3), kary_tree(6, 1)
    q_lens, kv_lens = [13, 1, len(chain), 1, len(bushy)], [20, 9, 40, 16, len(bushy) + 3]
    case = make_case(rng, q_lens, kv_lens, num_heads=6, num_kv_heads=2, head_dim=16, page_size=4, pad_tokens=3)
    mask = batch_tree_mask(case, {2: chain, 4: bushy})
    kwargs = dict(sm_scale=0.25, sliding_window=window)
    want = dense_attention(case, tree_mask=mask, **kwargs)
    assert not np.allclose(want, dense_attention(case, **kwargs)), "the trees must change something"
    np.testing.assert_allclose(run_kernel(case, tree_mask=mask, **kwargs), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_small_trees_on_the_decode_path(head_dim):
    """Trees of 2 and 3 nodes with two query heads a KV head: fewer than 8 query rows a unit,
    which score 16 keys at a time (the AVX-512 decode path), beside plain decodes."""
    rng = np.random.default_rng(13)
    pair, fork = kary_tree(2, 1), kary_tree(3, 2)
    q_lens, kv_lens = [1, len(pair), 1, len(fork)], [77, 40, 5, 130]
    case = make_case(rng, q_lens, kv_lens, num_heads=4, num_kv_heads=2, head_dim=head_dim, page_size=16, pad_tokens=2)
    mask = batch_tree_mask(case, {1: pair, 3: fork})
    kwargs = dict(sm_scale=head_dim**-0.5)
    want = dense_attention(case, tree_mask=mask, **kwargs)
    assert not np.allclose(want, dense_attention(case, **kwargs)), "the fork must change something"
    np.testing.assert_allclose(run_kernel(case, tree_mask=mask, **kwargs), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 30])
def test_trees_past_32_nodes_in_several_words(window):
    """A 70-node and a 40-node tree (3 words a token) beside decodes and a prefill."""
    rng = np.random.default_rng(12)
    big, middle = kary_tree(71, 2), kary_tree(41, 4)
    q_lens, kv_lens = [13, len(big), 1, len(middle)], [20, len(big) + 9, 40, len(middle)]
    case = make_case(rng, q_lens, kv_lens, num_heads=6, num_kv_heads=2, head_dim=16, page_size=4, pad_tokens=3)
    mask = batch_tree_mask(case, {1: big, 3: middle}, num_words=3)
    kwargs = dict(sm_scale=0.25, sliding_window=window)
    want = dense_attention(case, tree_mask=mask, **kwargs)
    one_word = mask[:, :1]
    assert not np.allclose(want, dense_attention(case, tree_mask=one_word, **kwargs)), "words 1 and 2 must matter"
    np.testing.assert_allclose(run_kernel(case, tree_mask=mask, **kwargs), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "q_dtype,kv_dtype", [("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("bfloat16", "float32")]
)
def test_bfloat16_equals_the_reference_on_the_same_inputs(q_dtype, kv_dtype):
    rng = np.random.default_rng(5)
    case = make_case(
        rng, [20, 1, 1], [20, 50, 77], num_heads=6, num_kv_heads=2, head_dim=64, page_size=16, pad_tokens=2
    )
    q, k, v = jnp.asarray(case.q, q_dtype), jnp.asarray(case.k_pages, kv_dtype), jnp.asarray(case.v_pages, kv_dtype)
    args = (q, k, v, case.kv_lens, case.block_tables, case.query_start_loc)
    got = cpu_kernels.ragged_paged_attention(*args, sm_scale=0.125)
    want = ragged_paged_attention_reference(*args, sm_scale=0.125)
    assert got.dtype == want.dtype == jnp.dtype(q_dtype)
    # Both compute in float32 and round the output once to the query's dtype.
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2, rtol=1e-2)


def test_an_8bit_cache_is_refused():
    case = make_case(np.random.default_rng(0), [1], [4], num_heads=2, num_kv_heads=1, head_dim=16, page_size=4)
    scales = np.ones((case.k_pages.shape[0], 1, 4), np.float32)
    with pytest.raises(ValueError, match="8-bit cache runs on the reference"):
        cpu_kernels.ragged_paged_attention(
            case.q,
            np.zeros(case.k_pages.shape, np.int8),
            np.zeros(case.v_pages.shape, np.int8),
            case.kv_lens,
            case.block_tables,
            case.query_start_loc,
            sm_scale=1.0,
            k_scales=scales,
            v_scales=scales,
        )


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k,n", [(64, 96), (576, 1536), (40, 301)])
@pytest.mark.parametrize("transposed", [False, True])
def test_small_matmul_equals_numpy(m, k, n, transposed):
    """Columns split over units (256 per unit, 64 rows of a transposed weight, taken four at a
    time), a ragged last unit, and a last unit whose rows do not divide by four."""
    rng = np.random.default_rng(m * 7 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
    want = x.astype(np.float64) @ (w.T if transposed else w).astype(np.float64)
    got = jax.jit(cpu_kernels.small_matmul, static_argnames="transposed")(x, w, transposed=transposed)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4 * np.sqrt(k), rtol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_small_matmul_in_bfloat16_equals_xla(transposed):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((510, 128) if transposed else (128, 510)), jnp.bfloat16)
    got = cpu_kernels.small_matmul(x, w, transposed=transposed)
    want = jnp.dot(x, w.T if transposed else w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-1)
    with pytest.raises(ValueError, match="M <= 16"):
        cpu_kernels.small_matmul(jnp.zeros((17, 128)), jnp.zeros((128, 4)))


def test_kernels_called_from_several_threads_at_once_equal_numpy():
    """Helper threads linger after a call and are handed the next one (cpu_kernels.cc,
    `Helpers`): calls from several threads at once, back to back, each get their own result."""
    rng = np.random.default_rng(2)
    cases = [
        (rng.standard_normal((m, 96)).astype(np.float32), rng.standard_normal((n, 96)).astype(np.float32))
        for m, n in [(1, 640), (3, 300), (16, 1000)]
    ]
    matmul = jax.jit(cpu_kernels.small_matmul, static_argnames="transposed")

    def calls(x, w):
        return [np.asarray(matmul(x, w, transposed=True)) for _ in range(40)]

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: calls(*case), cases))
    for (x, w), got in zip(cases, results):
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        for g in got:
            np.testing.assert_allclose(g, want, atol=1e-4 * np.sqrt(96), rtol=1e-5)


def test_small_matmul_under_vmap_runs_once_per_element():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 2, 32)).astype(np.float32)
    w = rng.standard_normal((48, 32)).astype(np.float32)
    got = jax.vmap(lambda row: cpu_kernels.small_matmul(row, w, transposed=True))(x)
    np.testing.assert_allclose(np.asarray(got), x @ w.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_small_matmul_gradients_equal_xla(transposed):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 32) if transposed else (32, 40)), jnp.float32)
    loss = lambda mm: lambda x, w: jnp.sum(jnp.tanh(mm(x, w)))  # noqa: E731
    got = jax.grad(loss(lambda x, w: cpu_kernels.small_matmul(x, w, transposed=transposed)), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: x @ (w.T if transposed else w)), argnums=(0, 1))(x, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 3, 8, 13, 64])
@pytest.mark.parametrize("k,ns", [(576, (576, 192, 192)), (40, (301, 88)), (1536, (576, 48, 7))])
def test_dense_matmuls_equal_numpy_and_each_row_alone(m, k, ns):
    """Tiles of 48 columns in blocks of 8 rows: a ragged last tile (301, 88, 7: 13, 40, 7 columns), a last row block of
    fewer rows (3, 13), several weights in one call; each row's bits are those it gets alone,
    and each weight's those of its own call."""
    rng = np.random.default_rng(m * 5 + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    ws = [rng.standard_normal((k, n)).astype(np.float32) for n in ns]
    got = [np.asarray(y) for y in jax.jit(cpu_kernels.dense_matmuls)(x, ws)]
    for w, y in zip(ws, got):
        want = x.astype(np.float64) @ w.astype(np.float64)
        np.testing.assert_allclose(y, want, atol=1e-4 * np.sqrt(k), rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(cpu_kernels.dense_matmul(x, w)), y)
    for r in {0, m // 2, m - 1}:
        alone = cpu_kernels.dense_matmuls(x[r : r + 1], ws)
        for y, a in zip(got, alone):
            np.testing.assert_array_equal(np.asarray(a)[0], y[r])


def test_dense_matmul_in_bfloat16_its_gradients_and_its_errors():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((24, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((128, 100)), jnp.bfloat16)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)  # the rounded inputs, summed exactly
    got = cpu_kernels.dense_matmul(x, w)
    assert got.dtype == jnp.bfloat16  # float32 sums, rounded once
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-8, atol=1e-3)
    wide = cpu_kernels.dense_matmul(x.astype(jnp.float32), w)  # float32 rows at bfloat16 weights
    np.testing.assert_allclose(np.asarray(wide), want, rtol=1e-5, atol=1e-4)

    x32, w32 = jnp.asarray(rng.standard_normal((5, 32)), jnp.float32), jnp.asarray(rng.standard_normal((32, 60)))
    loss = lambda mm: lambda x, w: jnp.sum(jnp.tanh(mm(x, w)))  # noqa: E731
    got_grads = jax.grad(loss(cpu_kernels.dense_matmul), argnums=(0, 1))(x32, w32)
    want_grads = jax.grad(loss(lambda x, w: x @ w), argnums=(0, 1))(x32, w32)
    for g, e in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-5, rtol=1e-5)

    with pytest.raises(ValueError, match="M <= 64"):
        cpu_kernels.dense_matmul(jnp.zeros((65, 32)), w32)
    with pytest.raises(ValueError, match="K=32"):
        cpu_kernels.dense_matmul(x32, jnp.zeros((33, 4)))
    with pytest.raises(ValueError, match="one dtype"):
        cpu_kernels.dense_matmuls(x32, [w32, w32.astype(jnp.bfloat16)])
    with pytest.raises(ValueError, match="float32 or bfloat16 weights"):
        cpu_kernels.dense_matmul(x32, jnp.zeros((32, 4), jnp.float16))


def test_dense_dot_general_takes_few_rows_and_leaves_more_to_xla():
    """What an nnx.Linear marked for the kernel calls: DENSE_MIN_ROWS to DENSE_MAX_ROWS rows
    (any leading shape) through the kernel, fewer or more through XLA's dot; all equal x @ w."""
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((48, 30)), jnp.float32)
    dims = (((2,), (0,)), ((), ()))
    for shape, kernel in [((1, 16, 48), False), ((1, 17, 48), True), ((2, 32, 48), True), ((3, 22, 48), False)]:
        x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        f = jax.jit(lambda x: cpu_kernels.dense_dot_general(x, w, dims))
        assert (cpu_kernels.DENSE_MATMUL_TARGET in f.lower(x).as_text()) == kernel
        np.testing.assert_allclose(np.asarray(f(x)), np.asarray(x) @ np.asarray(w), atol=1e-4, rtol=1e-5)


def int4_case(rng, m, k, n, group, x_dtype=jnp.float32):
    """x, and an int4 weight with random nibbles, scales and offsets in quantized_matmul's
    layout; the float64 product, the weight read with plain bit operations."""
    packed = rng.integers(0, 256, (k // 2, n), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (k // group, n)).astype(np.float32)
    offsets = rng.uniform(-0.5, 0.5, (k // group, n)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
    nibbles = np.empty((k, n))
    nibbles[0::2], nibbles[1::2] = packed & 15, packed >> 4
    rows = np.arange(k) // group
    w = nibbles * scales.astype(np.float64)[rows] + offsets.astype(np.float64)[rows]
    return (x, packed, scales, offsets), np.asarray(x, np.float64) @ w


def tiled_int4_matmul(x, packed, scales, offsets):
    return cpu_kernels.int4_matmul(x, *cpu_kernels.tile_int4(packed, scales, offsets), packed.shape[1])


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("k,n,group", [(576, 1536, 32), (576, 192, 64), (256, 300, 128), (64, 7, 32)])
def test_int4_matmul_equals_numpy(m, k, n, group):
    """Rows by fours, twos and ones; a ragged last tile of 32 columns and a single partial
    one; one to many groups."""
    args, want = int4_case(np.random.default_rng(m * 31 + n), m, k, n, group)
    got = jax.jit(tiled_int4_matmul)(*args)
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.sqrt(k), rtol=1e-5)


@pytest.mark.parametrize("m", [1, 3, 4])
def test_int4_matmul_with_float16_scales_equals_float32_scales(m):
    """Scales and offsets float16 holds exactly (as GGUF's d and m) read as float16: the same
    bits as read from float32; ones it does not hold are not taken as exact."""
    (x, packed, scales, offsets), _ = int4_case(np.random.default_rng(m), m, 256, 300, 32)
    assert not cpu_kernels.half_scales_exact(scales, offsets)
    scales, offsets = (a.astype(np.float16).astype(np.float32) for a in (scales, offsets))
    assert cpu_kernels.half_scales_exact(scales, offsets)
    results = []
    for dtype in (jnp.float32, jnp.float16):
        tiled = cpu_kernels.tile_int4(packed, scales, offsets, scale_dtype=dtype)
        assert tiled[1].dtype == dtype
        results.append(np.asarray(cpu_kernels.int4_matmul(x, *tiled, 300)))
    np.testing.assert_array_equal(results[1], results[0])
    untiled = cpu_kernels.untile_int4(*cpu_kernels.tile_int4(packed, scales, offsets, scale_dtype=jnp.float16), 300)
    np.testing.assert_array_equal(np.asarray(untiled[1]), scales)


@pytest.mark.parametrize("m", [1, 3, 16])
def test_quantized_matmuls_share_one_call_and_equal_each_alone(m):
    """q, k and v in one call: int4 weights of other widths, groups and scale dtypes beside an
    int8 one with offsets and one without, each the same bits as its own call (itself checked
    against float64 NumPy), the first too."""
    rng = np.random.default_rng(m)
    cases = [int4_case(rng, m, 576, n, group) for n, group in ((576, 32), (192, 64), (45, 192))]
    x = cases[0][0][0]
    weights = []
    for i, ((_, packed, scales, offsets), _) in enumerate(cases):
        if i == 1:  # float16 scales and offsets beside float32 ones
            scales, offsets = (a.astype(np.float16).astype(np.float32) for a in (scales, offsets))
        dtype = jnp.float16 if i == 1 else jnp.float32
        tiled = cpu_kernels.tile_int4(packed, scales, offsets, scale_dtype=dtype)
        weights.append(cpu_kernels.QuantizedWeight(*tiled, packed.shape[1]))
    q, s = cpu_kernels.tile_int8(jnp.asarray(rng.integers(-127, 128, (576, 70), dtype=np.int8)), jnp.ones((36, 70)))
    offsets = cpu_kernels.tile_scales(jnp.asarray(rng.random((36, 70)) - 0.5), jnp.float16)
    weights += [cpu_kernels.QuantizedWeight(q, s, offsets, 70), cpu_kernels.QuantizedWeight(q, s, None, 70)]
    together = jax.jit(lambda x: cpu_kernels.quantized_matmuls(x, weights))(x)
    alone = [cpu_kernels.int4_matmul(x, *w.arrays(), w.n) for w in weights[:3]]
    alone += [cpu_kernels.int8_matmul(x, q, s, 70, offsets), cpu_kernels.int8_matmul(x, q, s, 70)]
    for got, want in zip(together, alone, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(together[0]), cases[0][1], atol=1e-5 * np.sqrt(576), rtol=1e-5)


def test_int4_tiles_round_trip():
    (_, *weight), _ = int4_case(np.random.default_rng(4), 1, 64, 45, 32)
    stacked = [np.stack([w, w[::-1]]) for w in weight]  # leading axes (stacked layers) kept
    tiled = cpu_kernels.tile_int4(*stacked)
    assert [t.shape for t in tiled] == [(2, 2, 32, 32), (2, 2, 2, 32), (2, 2, 2, 32)]
    for back, original in zip(cpu_kernels.untile_int4(*tiled, 45), stacked):
        np.testing.assert_array_equal(np.asarray(back), original)


def test_int4_matmul_rows_are_computed_alone():
    """A row's result is the same bits whatever rows share its call (batch invariance)."""
    (x, *weight), _ = int4_case(np.random.default_rng(5), 16, 576, 300, 32)
    together = np.asarray(tiled_int4_matmul(x, *weight))
    for r in (0, 7, 15):  # in a block of four rows, the last block of four, alone
        for rows in (slice(r, r + 1), slice(r - r % 2, r - r % 2 + 2)):
            got = np.asarray(tiled_int4_matmul(x[rows], *weight))
            np.testing.assert_array_equal(got[r - rows.start], together[r])


def test_int4_matmul_in_bfloat16_and_its_errors():
    args, want = int4_case(np.random.default_rng(3), 4, 128, 96, 32, x_dtype=jnp.bfloat16)
    got = tiled_int4_matmul(*args)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-7, atol=1e-5 * np.sqrt(128))
    x, *weight = args
    tiled = cpu_kernels.tile_int4(*weight)
    with pytest.raises(ValueError, match="M <= 64"):
        cpu_kernels.int4_matmul(jnp.zeros((65, 128)), *tiled, 96)
    with pytest.raises(ValueError, match="even K // G"):  # groups of 3: odd
        cpu_kernels.int4_matmul(jnp.zeros((1, 6)), tiled[0][:, :3], tiled[1][:, :2], tiled[2][:, :2], 96)
    with pytest.raises(ValueError, match="N in the last tile"):
        cpu_kernels.int4_matmul(x, *tiled, 64)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernels.int4_matmul(x.astype(jnp.float16), *tiled, 96)


def tiled_int8_head(table):
    q, scales = cpu_kernels.q8_0_blocks(table)
    return (*cpu_kernels.tile_int8(jnp.asarray(q), jnp.asarray(scales)), table.shape[0])


def test_q8_0_blocks_are_found_again_exactly_and_only_where_they_are():
    """The gguf package's Q8_0 blocks, dequantized: their int8 values and float16 scales come
    back exactly (scale times value is the table again); a float table, or one value changed
    by an ulp, is not taken for Q8_0."""
    table = q8_0_table(np.random.default_rng(0), 70, 96)
    q, scales = cpu_kernels.q8_0_blocks(table)
    assert q.dtype == np.int8 and scales.dtype == np.float16 and q.shape == (96, 70) and scales.shape == (3, 70)
    np.testing.assert_array_equal(q.T.astype(np.float32) * np.repeat(scales.T.astype(np.float32), 32, 1), table)
    assert cpu_kernels.q8_0_blocks(np.random.default_rng(1).standard_normal((70, 96))) is None
    nudged = table.copy()
    nudged[5, 40] = np.nextafter(nudged[5, 40], np.float32(np.inf))
    assert cpu_kernels.q8_0_blocks(nudged) is None
    assert cpu_kernels.q8_0_blocks(table[:, :80]) is None  # K not whole blocks


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("n,k", [(1000, 576), (45, 64), (7, 32)])
def test_int8_matmul_equals_numpy(m, n, k):
    """x @ table.T on the table's Q8_0 blocks against float64 NumPy on the table: rows by
    fours, twos and ones; a ragged last tile and a single partial one."""
    rng = np.random.default_rng(m * 7 + n)
    table = q8_0_table(rng, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    got = jax.jit(cpu_kernels.int8_matmul, static_argnums=3)(x, *tiled_int8_head(table))
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    want = np.asarray(x, np.float64) @ table.T.astype(np.float64)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6 * np.sqrt(k) * np.abs(table).max(), rtol=1e-5)


def test_int8_matmul_rows_are_computed_alone_and_in_bfloat16():
    """A row's result is the same bits whatever rows share its call (batch invariance), float32
    scales give the float16 ones' bits, bfloat16 x rounds once, and bad shapes are refused."""
    rng = np.random.default_rng(6)
    table = q8_0_table(rng, 300, 576)
    head = tiled_int8_head(table)
    x = jnp.asarray(rng.standard_normal((16, 576)), jnp.float32)
    together = np.asarray(cpu_kernels.int8_matmul(x, *head))
    for r in (0, 7, 15):
        for rows in (slice(r, r + 1), slice(r - r % 2, r - r % 2 + 2)):
            got = np.asarray(cpu_kernels.int8_matmul(x[rows], *head))
            np.testing.assert_array_equal(got[r - rows.start], together[r])
    wide = np.asarray(cpu_kernels.int8_matmul(x, head[0], head[1].astype(jnp.float32), 300))
    np.testing.assert_array_equal(wide, together)
    got = cpu_kernels.int8_matmul(x.astype(jnp.bfloat16), *head)
    want = np.asarray(x.astype(jnp.bfloat16), np.float64) @ table.T.astype(np.float64)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-7, atol=1e-3)
    with pytest.raises(ValueError, match="M <= 64"):
        cpu_kernels.int8_matmul(jnp.zeros((65, 576)), *head)
    with pytest.raises(ValueError, match="N in the last tile"):
        cpu_kernels.int8_matmul(x, head[0], head[1], 256)
    with pytest.raises(ValueError, match="int8 q"):
        cpu_kernels.int8_matmul(x, head[0].astype(jnp.int16), head[1], 300)


@pytest.mark.parametrize("scale_dtype", [jnp.float16, jnp.float32])
def test_int8_matmul_with_offsets_equals_numpy(scale_dtype):
    """Asymmetric int8 (GGUF's Q5_1 and Q5_K: `scale * q + offset` per group of 32): x @ W
    against float64 NumPy for 1 to 16 rows (fours, twos and ones, a ragged last tile), each row
    the same bits computed alone, and the offsets' shape and dtype checked."""
    rng = np.random.default_rng(21)
    k, n = 576, 70
    q = rng.integers(0, 32, (k, n), dtype=np.int8)
    scales = (rng.random((k // 32, n)) * 0.01).astype(np.float16).astype(np.float32)
    offsets = (-rng.random((k // 32, n)) * 0.1).astype(np.float16).astype(np.float32)
    w = q.astype(np.float64) * np.repeat(scales, 32, 0) + np.repeat(offsets, 32, 0)
    tq, ts = cpu_kernels.tile_int8(jnp.asarray(q), jnp.asarray(scales), scale_dtype=scale_dtype)
    to = cpu_kernels.tile_scales(jnp.asarray(offsets), scale_dtype)
    x = jnp.asarray(rng.standard_normal((16, k)), jnp.float32)
    together = np.asarray(cpu_kernels.int8_matmul(x, tq, ts, n, to))
    np.testing.assert_allclose(together, np.asarray(x, np.float64) @ w, rtol=1e-5, atol=1e-5)
    for m in (1, 2, 3, 5):
        np.testing.assert_array_equal(np.asarray(cpu_kernels.int8_matmul(x[:m], tq, ts, n, to)), together[:m])
    with pytest.raises(ValueError, match="offsets"):
        cpu_kernels.int8_matmul(x, tq, ts, n, to[:, :3])
    with pytest.raises(ValueError, match="offsets in the scales' dtype"):
        cpu_kernels.int8_matmul(x, tq, ts, n, to.astype(jnp.float32 if scale_dtype == jnp.float16 else jnp.float16))


def quantized_products() -> dict[str, np.ndarray]:
    """int4_matmul and int8_matmul (with and without offsets) of seeded random weights (float16
    and float32 scales) for 1 to 16 rows, dense_matmul (float32, bfloat16) for 1 to 64 and
    greedy_argmax, with the kernels built as this process builds them."""
    assert cpu_kernels.build(default_cache_dir()) is None
    rng = np.random.default_rng(11)
    k, n = 576, 80
    x = jnp.asarray(rng.standard_normal((16, k)), jnp.float32)
    int4 = cpu_kernels.tile_int4(
        jnp.asarray(rng.integers(0, 256, (k // 2, n), dtype=np.uint8)),
        jnp.asarray(rng.random((k // 32, n)), jnp.float16),
        jnp.asarray(rng.random((k // 32, n)) - 0.5, jnp.float16),
    )
    int8 = cpu_kernels.tile_int8(
        jnp.asarray(rng.integers(-127, 128, (k, n), dtype=np.int8)), jnp.asarray(rng.random((k // 16, n)), jnp.float32)
    )
    offsets = cpu_kernels.tile_scales(jnp.asarray(rng.random((k // 16, n)) - 0.5), jnp.float16)
    out = {}
    dense = [
        jnp.asarray(rng.standard_normal((k, n)), jnp.float32),
        jnp.asarray(rng.standard_normal((k, 50)), jnp.bfloat16),
    ]
    logits = rng.integers(-3, 3, (6, 1000)).astype(np.float32)  # ties
    logits[1, [5, 700]] = np.nan
    logits[2] = -np.inf
    out["greedy"] = np.asarray(cpu_kernels.greedy_argmax(jnp.asarray(logits)))
    for m in (1, 3, 8, 13, 64):
        xs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        out[f"dense_{m}"] = np.asarray(cpu_kernels.dense_matmul(xs, dense[0]))
        out[f"dense_bf16_{m}"] = np.asarray(cpu_kernels.dense_matmul(xs.astype(jnp.bfloat16), dense[1]), np.float32)
    for m in (1, 2, 3, 4, 5, 16):
        out[f"int4_{m}"] = np.asarray(cpu_kernels.int4_matmul(x[:m], *int4, n))
        out[f"int8_{m}"] = np.asarray(cpu_kernels.int8_matmul(x[:m], *int8, n))
        out[f"int8_asym_{m}"] = np.asarray(cpu_kernels.int8_matmul(x[:m], *int8, n, offsets))
    return out


def test_the_avx2_kernels_give_the_bits_of_the_avx512_ones(tmp_path):
    """int4_matmul and int8_matmul built without AVX-512 (its AVX2 paths, what a machine without
    it runs) give the same bits as built here: each column's sums run the same fma chain; so
    does dense_matmul (its plain loop there), and greedy_argmax picks the same tokens."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    saved = tmp_path / "avx2.npz"
    code = (
        "import numpy as np; from tests.pallas_kernels.test_cpu_kernels import quantized_products; "
        f"np.savez({str(saved)!r}, **quantized_products())"
    )
    env = {**os.environ, cpu_kernels.FLAGS_ENV_VAR: "-mno-avx512f"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    here, avx2 = quantized_products(), np.load(saved)
    assert sorted(avx2.files) == sorted(here)
    for name, values in here.items():
        np.testing.assert_array_equal(avx2[name], values, err_msg=name)


def rms_norm64(x, weight, eps):
    return weight * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def block_case(m, d, a, nk, f, dtype, seed):
    rng = np.random.default_rng(seed)
    arrays = dict(
        x=rng.standard_normal((m, d)),
        norm1=1 + 0.1 * rng.standard_normal(d),
        wq=0.1 * rng.standard_normal((d, a)),
        wk=0.1 * rng.standard_normal((d, nk)),
        wv=0.1 * rng.standard_normal((d, nk)),
        attn=rng.standard_normal((m, a)),
        wo=0.1 * rng.standard_normal((a, d)),
        norm2=1 + 0.1 * rng.standard_normal(d),
        wg=0.1 * rng.standard_normal((d, f)),
        wu=0.1 * rng.standard_normal((d, f)),
        wd=0.1 * rng.standard_normal((f, d)),
    )
    ins = {k: jnp.asarray(v, dtype) for k, v in arrays.items()}
    return {k: np.asarray(v, np.float64) for k, v in ins.items()}, ins  # the oracle sees the rounded inputs


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("d,a,nk,f", [(576, 576, 192, 1536), (40, 24, 8, 100), (7, 9, 5, 13)])
def test_decoder_layer_blocks_equal_numpy(m, d, a, nk, f):
    """norm_qkv and o_proj_mlp against float64 NumPy: K split over units, ragged last units and
    columns past the last full vector (the small shapes)."""
    eps = 1e-5
    want, ins = block_case(m, d, a, nk, f, jnp.float32, seed=m + d)
    q, k, v = jax.jit(cpu_kernels.norm_qkv, static_argnames="eps")(
        ins["x"], ins["norm1"], ins["wq"], ins["wk"], ins["wv"], eps=eps
    )
    h = rms_norm64(want["x"], want["norm1"], eps)
    for got, w in ((q, "wq"), (k, "wk"), (v, "wv")):
        np.testing.assert_allclose(np.asarray(got), h @ want[w], atol=1e-5 * np.sqrt(d), rtol=1e-5)
    out = jax.jit(cpu_kernels.o_proj_mlp, static_argnames="eps")(
        ins["attn"], ins["x"], ins["wo"], ins["norm2"], ins["wg"], ins["wu"], ins["wd"], eps=eps
    )
    x1 = want["x"] + want["attn"] @ want["wo"]
    h = rms_norm64(x1, want["norm2"], eps)
    gate = h @ want["wg"]
    expected = x1 + (gate / (1 + np.exp(-gate)) * (h @ want["wu"])) @ want["wd"]
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5 * np.sqrt(f), rtol=1e-5)


def test_decoder_layer_blocks_in_bfloat16_and_their_errors():
    """bfloat16 throughout, against the same float64 math (bfloat16 rounds the intermediates);
    mixed dtypes and too many rows are refused."""
    want, ins = block_case(2, 64, 64, 16, 128, jnp.bfloat16, seed=0)
    q, k, _ = cpu_kernels.norm_qkv(ins["x"], ins["norm1"], ins["wq"], ins["wk"], ins["wv"], eps=1e-6)
    assert q.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(k, np.float64), rms_norm64(want["x"], want["norm1"], 1e-6) @ want["wk"], atol=3e-2, rtol=2e-2
    )
    out = cpu_kernels.o_proj_mlp(
        ins["attn"], ins["x"], ins["wo"], ins["norm2"], ins["wg"], ins["wu"], ins["wd"], eps=1e-6
    )
    x1 = want["x"] + want["attn"] @ want["wo"]
    h = rms_norm64(x1, want["norm2"], 1e-6)
    gate = h @ want["wg"]
    expected = x1 + (gate / (1 + np.exp(-gate)) * (h @ want["wu"])) @ want["wd"]
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=6e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="one dtype"):
        cpu_kernels.norm_qkv(ins["x"].astype(jnp.float32), ins["norm1"], ins["wq"], ins["wk"], ins["wv"], eps=1e-6)
    with pytest.raises(ValueError, match="up to 16 rows"):
        cpu_kernels.o_proj_mlp(
            jnp.zeros((17, 64), jnp.bfloat16),
            jnp.zeros((17, 64), jnp.bfloat16),
            ins["wo"],
            ins["norm2"],
            ins["wg"],
            ins["wu"],
            ins["wd"],
            eps=1e-6,
        )


def quantized_weight(rng, k, n, kind, group, scale_dtype):
    """A random weight [k, n] of `kind` (int4, int8, int8_asym) in the CPU kernels' layout, and
    its values in float64 (read with plain arithmetic from the untiled values)."""
    g = k // group
    if kind == "int4":
        packed = rng.integers(0, 256, (k // 2, n), dtype=np.uint8)
        values = np.empty((k, n))
        values[0::2], values[1::2] = packed & 15, packed >> 4
        scales, offsets = rng.uniform(0.005, 0.02, (g, n)), rng.uniform(-0.15, -0.05, (g, n))
    else:
        packed = rng.integers(-127, 128, (k, n), dtype=np.int8)
        values = packed.astype(np.float64)
        scales = rng.uniform(2e-4, 1e-3, (g, n))
        offsets = rng.uniform(-0.05, 0.05, (g, n)) if kind == "int8_asym" else None
    scales, offsets = (None if a is None else a.astype(scale_dtype).astype(np.float64) for a in (scales, offsets))
    dense = values * np.repeat(scales, group, 0) + (0 if offsets is None else np.repeat(offsets, group, 0))
    if kind == "int4":
        tiled = cpu_kernels.tile_int4(jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(offsets), scale_dtype)
    else:
        tiled = cpu_kernels.tile_int8(jnp.asarray(packed), jnp.asarray(scales), scale_dtype)
        tiled = (*tiled, None if offsets is None else cpu_kernels.tile_scales(jnp.asarray(offsets), scale_dtype))
    return cpu_kernels.QuantizedWeight(*tiled, n), dense


# (kind, group, scale dtype) of q, k, v, o, gate, up, down: every layout a GGUF mix gives, beside each other.
MIXED_LAYER = (
    ("int4", 32, np.float16),
    ("int8", 16, np.float16),
    ("int8_asym", 32, np.float32),
    ("int4", 64, np.float32),
    ("int4", 32, np.float16),
    ("int8_asym", 16, np.float32),
    ("int8_asym", 20, np.float16),
)


def quantized_block_case(m, d, a, nk, f, dtype, seed, layouts=MIXED_LAYER):
    """block_case's activations with quantized weights (`layouts`): the kernels' arguments and
    the float64 oracle's values."""
    want, ins = block_case(m, d, a, nk, f, dtype, seed)
    rng = np.random.default_rng(seed + 1)
    shapes = {"wq": (d, a), "wk": (d, nk), "wv": (d, nk), "wo": (a, d), "wg": (d, f), "wu": (d, f), "wd": (f, d)}
    for (name, (k, n)), (kind, group, scale_dtype) in zip(shapes.items(), layouts, strict=True):
        ins[name], want[name] = quantized_weight(rng, k, n, kind, group if k % group == 0 else 4, scale_dtype)
    return want, ins


def block_oracle(want, eps):
    """q, k, v and the layer's output in float64 (the float kernels' test's math)."""
    h = rms_norm64(want["x"], want["norm1"], eps)
    x1 = want["x"] + want["attn"] @ want["wo"]
    h2 = rms_norm64(x1, want["norm2"], eps)
    gate = h2 @ want["wg"]
    return (
        h @ want["wq"],
        h @ want["wk"],
        h @ want["wv"],
        x1 + (gate / (1 + np.exp(-gate)) * (h2 @ want["wu"])) @ want["wd"],
    )


@pytest.mark.parametrize("m", [1, 3, 16, 37, 64])
@pytest.mark.parametrize("d,a,nk,f", [(576, 576, 192, 1536), (48, 32, 8, 100)])
def test_quantized_decoder_layer_blocks_equal_numpy(m, d, a, nk, f):
    """quantized_norm_qkv and quantized_o_proj_mlp on a layer whose seven projections mix int4,
    int8 and int8 with offsets, groups of 16 to 64, float16 and float32 scales, against float64
    NumPy on the dequantized weights; ragged last tiles (the small shapes); each row's bits the
    same computed alone."""
    eps = 1e-5
    want, ins = quantized_block_case(m, d, a, nk, f, jnp.float32, seed=m + d)
    norm_qkv = jax.jit(cpu_kernels.quantized_norm_qkv, static_argnames="eps")
    o_proj_mlp = jax.jit(cpu_kernels.quantized_o_proj_mlp, static_argnames="eps")
    qkv = norm_qkv(ins["x"], ins["norm1"], ins["wq"], ins["wk"], ins["wv"], eps=eps)
    out = o_proj_mlp(ins["attn"], ins["x"], ins["wo"], ins["norm2"], ins["wg"], ins["wu"], ins["wd"], eps=eps)
    for got, expected in zip((*qkv, out), block_oracle(want, eps), strict=True):
        np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5 * np.sqrt(f), rtol=1e-5)
    if m > 1:
        last = norm_qkv(ins["x"][-1:], ins["norm1"], ins["wq"], ins["wk"], ins["wv"], eps=eps)
        for got, alone in zip(qkv, last, strict=True):
            np.testing.assert_array_equal(np.asarray(got)[-1:], np.asarray(alone))
        alone = o_proj_mlp(
            ins["attn"][-1:], ins["x"][-1:], ins["wo"], ins["norm2"], ins["wg"], ins["wu"], ins["wd"], eps=eps
        )
        np.testing.assert_array_equal(np.asarray(out)[-1:], np.asarray(alone))


def test_quantized_decoder_layer_blocks_in_bfloat16_and_their_errors():
    """bfloat16 activations against the same float64 math; a mismatched weight, an int4 weight
    without offsets and mixed dtypes are refused."""
    eps = 1e-6
    want, ins = quantized_block_case(2, 64, 64, 16, 128, jnp.bfloat16, seed=0)
    q, k, v = cpu_kernels.quantized_norm_qkv(ins["x"], ins["norm1"], ins["wq"], ins["wk"], ins["wv"], eps=eps)
    out = cpu_kernels.quantized_o_proj_mlp(
        ins["attn"], ins["x"], ins["wo"], ins["norm2"], ins["wg"], ins["wu"], ins["wd"], eps=eps
    )
    assert q.dtype == out.dtype == jnp.bfloat16
    for got, expected in zip((q, k, v, out), block_oracle(want, eps), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), expected, atol=6e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="K=64 inputs"):
        cpu_kernels.quantized_norm_qkv(ins["x"], ins["norm1"], ins["wq"], ins["wd"], ins["wv"], eps=eps)
    with pytest.raises(ValueError, match="K=64 inputs"):
        cpu_kernels.quantized_norm_qkv(
            ins["x"], ins["norm1"], dataclasses.replace(ins["wq"], offsets=None), ins["wk"], ins["wv"], eps=eps
        )
    with pytest.raises(ValueError, match="128 outputs where 64"):
        cpu_kernels.quantized_o_proj_mlp(
            ins["attn"], ins["x"], ins["wg"], ins["norm2"], ins["wg"], ins["wu"], ins["wd"], eps=eps
        )
    with pytest.raises(ValueError, match="one dtype"):
        cpu_kernels.quantized_norm_qkv(
            ins["x"].astype(jnp.float32), ins["norm1"], ins["wq"], ins["wk"], ins["wv"], eps=eps
        )
    with pytest.raises(ValueError, match="up to 64 rows"):
        x = jnp.zeros((65, 64), jnp.bfloat16)
        cpu_kernels.quantized_o_proj_mlp(x, x, ins["wo"], ins["norm2"], ins["wg"], ins["wu"], ins["wd"], eps=eps)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("groups,window", [(1, None), (3, None), (3, 5), (8, 40)])
def test_fixed_order_rows_equal_whatever_the_chunk(dtype, groups, window):
    """With fixed_order a query row's output is bit-identical computed in a whole prefill
    (units of 16 queries, the transposed path from 8 rows), in any chunk of it, or alone as a
    decode step, and with another sequence in the step (batch invariance, prefill = decode)."""
    rng = np.random.default_rng(groups)
    length, head_dim = 70, 64
    case = make_case(rng, [length], [length], num_heads=2 * groups, num_kv_heads=2, head_dim=head_dim, page_size=8)
    q = jnp.asarray(case.q, dtype)
    k_pages, v_pages = jnp.asarray(case.k_pages, dtype), jnp.asarray(case.v_pages, dtype)
    kwargs = dict(sm_scale=head_dim**-0.5, sliding_window=window, fixed_order=True)
    call = jax.jit(cpu_kernels.ragged_paged_attention, static_argnames=("sm_scale", "sliding_window", "fixed_order"))

    def chunk(start: int, stop: int, other: int = 0) -> np.ndarray:
        """Queries [start, stop) of the sequence, after `other` queries of a second sequence."""
        queries = jnp.concatenate([q[:other], q[start:stop]])
        tables = np.concatenate([case.block_tables, case.block_tables])[: 1 + bool(other)]
        lens = np.array([other, stop] if other else [stop], np.int32)
        qsl = np.array([0, other, other + stop - start] if other else [0, stop - start], np.int32)
        out = call(queries, k_pages, v_pages, lens, tables, qsl, **kwargs)
        return np.asarray(out.astype(jnp.float32))[other:]

    whole = chunk(0, length)
    for start, stop, other in [(69, 70, 0), (37, 38, 0), (0, 9, 0), (9, 30, 0), (30, 70, 0), (50, 51, 20), (20, 45, 7)]:
        np.testing.assert_array_equal(
            chunk(start, stop, other), whole[start:stop], err_msg=f"{start=} {stop=} {other=}"
        )


def test_in_row_blocks_rows_equal_alone():
    """A row through small_matmul in blocks of 16 (of 1 to 70 rows, at any place) equals the row alone."""
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((96, 130)), jnp.float32)
    row = rng.standard_normal(96).astype(np.float32)
    matmul = jax.jit(lambda x: cpu_kernels.in_row_blocks(cpu_kernels.small_matmul, (x,), w))
    alone = np.asarray(matmul(row[None]))[0]
    for m, at in [(2, 1), (16, 15), (17, 16), (70, 33), (70, 69)]:
        x = rng.standard_normal((m, 96)).astype(np.float32)
        x[at] = row
        np.testing.assert_array_equal(np.asarray(matmul(jnp.asarray(x)))[at], alone, err_msg=f"{m=} {at=}")
