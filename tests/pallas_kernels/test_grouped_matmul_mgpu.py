"""The Mosaic GPU grouped matmul (MoE experts: bf16 / f16, int4 and fp8 weights), tested
without a GPU the way the dense kernels are.

0. The pure-JAX references against float64 NumPy (a loop over rows: y[r] = x[r] @ w[g(r)]),
   and the work list (XLA) against a plain Python enumeration of (tile, group) pairs.
1. The kernels under the Mosaic GPU interpreter on small shapes against the references:
   empty groups (first, middle, last), all rows in one group, rows past sum(group_sizes),
   M not a multiple of the row tile, groups straddling tiles, f16, the warp-specialized
   pipeline, int4 group sizes 32 / 64 / 128, fp8 rows of very different magnitudes. Rows
   past the groups and the weights of empty groups are NaN: a kernel that reads them shows.
2. Lowered for CUDA with `jax.export` at Qwen3-30B-A3B's expert shapes (hidden 2048,
   expert intermediate 768, 128 experts, top-8) for 8, 256 and 2048 tokens.

With JAXSERVE_MGPU_ON_GPU=1 (benchmarks/gpu_check.sh) the cases of 1 run compiled on the
GPU, and production shapes with a random router's group sizes (and all rows to one
expert) are added.

Tolerance as in test_quantized_matmul_mgpu: the same float32 products, summed in another
order, rounded once to bf16 / f16.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.mosaic_lowering import (
    MOE_TOKENS,
    QWEN3_MOE_EXPERTS,
    QWEN3_MOE_PROJECTIONS,
    QWEN3_MOE_TOP_K,
    lower_grouped_matmul,
)
from jaxserve.model.quantization import quantize_fp8, quantize_int4
from pallas_kernels import grouped_matmul_mgpu as gmm
from pallas_kernels.grouped_matmul import (
    fp8_grouped_matmul_reference,
    grouped_matmul_reference,
    int4_grouped_matmul_reference,
)
from pallas_kernels.quantized_matmul import dequantize_int4

ON_GPU = os.environ.get("JAXSERVE_MGPU_ON_GPU") == "1"
if ON_GPU and jax.devices()[0].platform != "gpu":
    pytest.skip("JAXSERVE_MGPU_ON_GPU=1 but there is no GPU", allow_module_level=True)

INTERPRET = None if ON_GPU else True


def tolerance(dtype, want):
    ulp = float(jnp.finfo(dtype).eps)
    return dict(rtol=2 * ulp, atol=2 * ulp * 1e-2 * float(np.abs(want).max()))


def as_f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def rows_of_groups(sizes):
    """The group of each sorted row (len(sizes) for rows past them)."""
    return np.repeat(np.arange(len(sizes)), sizes)


def activations(rng, rows, k, sizes, dtype=jnp.bfloat16, spread=False):
    """x [rows, K] with the rows past sum(sizes) NaN (no kernel may read them)."""
    x = rng.standard_normal((rows, k)) * (rng.uniform(0.01, 10.0, (rows, 1)) if spread else 1.0)
    x[sum(sizes) :] = np.nan
    return jnp.asarray(x, dtype)


def zero_unused_rows(x, sizes):
    """x with the NaN rows past the groups zeroed (what the references may see)."""
    return x.at[sum(sizes) :].set(0)


def check(got, want, dtype, sizes):
    got, want = as_f64(got), as_f64(want)
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **tolerance(dtype, want))
    assert not got[sum(sizes) :].any()  # rows past the groups are zero


def float_case(rng, rows, k, n, sizes, dtype=jnp.bfloat16):
    w = rng.standard_normal((len(sizes), k, n))
    w[np.asarray(sizes) == 0] = np.nan  # an empty group's weight is never read
    return activations(rng, rows, k, sizes, dtype), jnp.asarray(w, dtype)


def check_float(x, w, sizes, config=None):
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = gmm.grouped_matmul(x, w, group_sizes, config=config, interpret=INTERPRET)
    clean_w = jnp.where(jnp.isnan(w), 0, w)
    want = grouped_matmul_reference(zero_unused_rows(x, sizes), clean_w, group_sizes)
    check(got, want, x.dtype, sizes)


def int4_case(rng, rows, k, n, sizes, group, dtype=jnp.bfloat16):
    per_expert = [quantize_int4(rng.standard_normal((k, n)).astype(np.float32), group) for _ in sizes]
    canonical = [jnp.asarray(np.stack([p[name] for p in per_expert])) for name in ("packed", "scales", "offsets")]
    return activations(rng, rows, k, sizes, dtype), canonical


def check_int4(x, canonical, sizes, config=None):
    group_sizes = jnp.asarray(sizes, jnp.int32)
    weights = gmm.prepare_int4(*canonical)
    got = gmm.int4_grouped_matmul(x, weights, group_sizes, config=config, interpret=INTERPRET)
    want = int4_grouped_matmul_reference(zero_unused_rows(x, sizes), *canonical, group_sizes)
    check(got, want, x.dtype, sizes)


def fp8_case(rng, rows, k, n, sizes, dtype=jnp.bfloat16):
    per_expert = []
    for _ in sizes:  # output channels of very different magnitudes: the weight scales matter
        w = rng.standard_normal((k, n)) * rng.uniform(0.1, 3.0, (1, n))
        per_expert.append(quantize_fp8(w.astype(np.float32)))
    canonical = [jnp.asarray(np.stack([p[name] for p in per_expert])) for name in ("weight", "scales")]
    return activations(rng, rows, k, sizes, dtype, spread=True), canonical


def check_fp8(x, canonical, sizes, config=None):
    group_sizes = jnp.asarray(sizes, jnp.int32)
    weights = gmm.prepare_fp8(*canonical)
    got = gmm.fp8_grouped_matmul(x, weights, group_sizes, config=config, interpret=INTERPRET)
    want = fp8_grouped_matmul_reference(zero_unused_rows(x, sizes), *canonical, group_sizes)
    check(got, want, x.dtype, sizes)


# -- 0. the references and the work list (no kernel) ------------------------------------


def test_references_match_float64_numpy():
    rng = np.random.default_rng(0)
    rows, k, n, sizes = 23, 64, 48, [5, 0, 11, 4, 0]  # two rows past the groups
    x = np.asarray(jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16), np.float64)
    w = np.asarray(jnp.asarray(rng.standard_normal((len(sizes), k, n)), jnp.bfloat16), np.float64)
    groups = rows_of_groups(sizes)
    want = np.zeros((rows, n))
    for r, g in enumerate(groups):
        want[r] = x[r] @ w[g]
    got = as_f64(
        grouped_matmul_reference(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(sizes))
    )
    np.testing.assert_allclose(got, want, **tolerance(jnp.bfloat16, want))
    assert not got[len(groups) :].any()

    # int4: the same loop on each expert's dequantized weight.
    xb = jnp.asarray(x, jnp.bfloat16)
    _, canonical = int4_case(rng, rows, k, n, sizes, 32)
    dense = [as_f64(dequantize_int4(*(c[e] for c in canonical), jnp.bfloat16)) for e in range(len(sizes))]
    want = np.zeros((rows, n))
    for r, g in enumerate(groups):
        want[r] = x[r] @ dense[g]
    got = as_f64(int4_grouped_matmul_reference(xb, *canonical, jnp.asarray(sizes)))
    np.testing.assert_allclose(got, want, **tolerance(jnp.bfloat16, want))

    # fp8: x quantized per row to e4m3, products exact in float64, both scales applied.
    _, (weight, scales) = fp8_case(rng, rows, k, n, sizes)
    amax = np.abs(x).max(axis=1)
    x_scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    xq = as_f64(jnp.asarray(np.clip(x / x_scale[:, None], -448, 448), jnp.float32).astype(jnp.float8_e4m3fn))
    want = np.zeros((rows, n))
    for r, g in enumerate(groups):
        want[r] = (xq[r] @ as_f64(weight[g])) * x_scale[r] * as_f64(scales[g])
    got = as_f64(fp8_grouped_matmul_reference(xb, weight, scales, jnp.asarray(sizes)))
    np.testing.assert_allclose(got, want, **tolerance(jnp.bfloat16, want))


def enumerate_items(sizes, rows, tile):
    """(group, tile) pairs the plain way: each group's rows, the tiles they touch."""
    items, start = [], 0
    for g, size in enumerate(sizes):
        end = min(start + size, rows)
        items += [(g, t) for t in range(start // tile, (end - 1) // tile + 1)] if end > start else []
        start = end
    return items


@pytest.mark.parametrize(
    "sizes,rows,tile",
    [
        ([5, 0, 9, 4], 20, 8),  # an empty group, a tile shared by three groups, rows left over
        ([0, 0, 37], 37, 8),  # all rows in the last group, M not a multiple of the tile
        ([37, 0, 0], 37, 16),
        ([0, 0, 0], 9, 8),  # nothing to do
        ([8, 8, 8], 24, 8),  # groups on tile boundaries
        ([1] * 64 + [0] * 64, 64, 8),  # a decode step: one row per expert, half the experts idle
        ([30, 30], 40, 8),  # sizes past M are cut
    ],
)
def test_work_items_enumerate_each_tile_and_group_once(sizes, rows, tile):
    work = gmm.work_items(jnp.asarray(sizes, jnp.int32), rows, tile)
    items = np.asarray(work.items)
    assert items.shape == (gmm.num_work_items(rows, len(sizes), tile), 3)
    want = enumerate_items(sizes, rows, tile)
    used = items[:, 2] == 1
    assert [tuple(it) for it in items[used][:, :2]] == want
    assert used[: len(want)].all() and not used[len(want) :].any()
    # Each used row points at the item of its own group and tile.
    groups = rows_of_groups(sizes)[:rows]
    row_item = np.asarray(work.row_item)
    np.testing.assert_array_equal(np.asarray(work.row_used), np.arange(rows) < len(groups))
    for r, g in enumerate(groups):
        assert tuple(items[row_item[r], :2]) == (g, r // tile), r


def test_random_group_sizes_stay_within_the_static_bound():
    """Random loads (some experts idle, some rows past the groups) on two fixed shapes,
    one compiled work list each: a prefill-like one and a decode-like one."""
    rng = np.random.default_rng(3)
    for groups, rows, tile in [(17, 200, 16), (40, 64, 8)]:
        listed = jax.jit(gmm.work_items, static_argnums=(1, 2))
        for _ in range(10):
            sizes = rng.multinomial(int(rng.integers(0, rows + 1)), rng.dirichlet(np.ones(groups) * 0.3))
            items = np.asarray(listed(jnp.asarray(sizes, jnp.int32), rows, tile).items)
            want = enumerate_items(list(sizes), rows, tile)
            assert [tuple(it) for it in items[items[:, 2] == 1][:, :2]] == want


# -- 1. interpreted (or, with JAXSERVE_MGPU_ON_GPU=1, compiled) -------------------------

SMALL = gmm.TuningConfig(tile_t=8, tile_k=64, max_concurrent_steps=2)


@pytest.mark.interpret
@pytest.mark.parametrize(
    "rows,sizes",
    [
        (20, [5, 0, 9, 4]),  # an empty middle group, a tile with three groups, two rows past them
        (37, [0, 37, 0]),  # all rows in one group (empty first and last), a partial last tile
        (9, [0, 0, 0, 9]),  # one group, the last
        (16, [1, 1, 1, 1, 0, 0, 1, 1]),  # decode-like: single rows, some experts idle
        (13, [0, 0, 0]),  # no rows at all: zeros
    ],
)
def test_float_group_sizes(rows, sizes):
    rng = np.random.default_rng(rows)
    check_float(*float_case(rng, rows, 128, 64, sizes), sizes, config=SMALL)


@pytest.mark.interpret
def test_float_default_config_and_wider_tiles():
    """The default config (tile_k 128, tile_t from rows per group) and two 64-wide N tiles."""
    rng = np.random.default_rng(5)
    sizes = [11, 7, 0, 22]
    check_float(*float_case(rng, 45, 256, 128, sizes), sizes)
    check_float(*float_case(rng, 45, 128, 64, sizes), sizes, config=gmm.TuningConfig(tile_t=16, tile_k=32))


@pytest.mark.interpret
def test_float16_and_warp_specialized():
    rng = np.random.default_rng(16)
    sizes = [3, 0, 6]
    check_float(*float_case(rng, 10, 64, 64, sizes, jnp.float16), sizes, config=SMALL)
    ws = gmm.TuningConfig(tile_t=8, tile_k=64, max_concurrent_steps=2, warp_specialized=True)
    check_float(*float_case(rng, 10, 128, 64, sizes), sizes, config=ws)


@pytest.mark.interpret
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_experts(group):
    """N = 96: a full and a padded 64-row tile; K = 256 spans several quantization groups."""
    rng = np.random.default_rng(group)
    sizes = [4, 0, 10, 3]
    check_int4(*int4_case(rng, 19, 256, 96, sizes, group), sizes, config=gmm.TuningConfig(tile_t=8))


@pytest.mark.interpret
def test_fp8_experts():
    rng = np.random.default_rng(8)
    sizes = [0, 12, 1, 6]
    check_fp8(*fp8_case(rng, 21, 256, 96, sizes), sizes, config=gmm.TuningConfig(tile_t=8, max_concurrent_steps=2))
    sizes = [0, 9]
    check_fp8(*fp8_case(rng, 9, 128, 64, sizes, jnp.float16), sizes)


@pytest.mark.interpret
def test_quantized_warp_specialized():
    rng = np.random.default_rng(9)
    sizes = [5, 0, 4]
    ws = gmm.TuningConfig(tile_t=8, max_concurrent_steps=2, warp_specialized=True)
    check_int4(*int4_case(rng, 9, 128, 64, sizes, 64), sizes, config=ws)
    check_fp8(*fp8_case(rng, 9, 128, 64, sizes), sizes, config=ws)


# -- validation (no kernel) -------------------------------------------------------------


def test_unsupported_inputs_raise_clear_errors():
    s = jax.ShapeDtypeStruct
    x, w, sizes = s((16, 128), jnp.bfloat16), s((4, 128, 64), jnp.bfloat16), s((4,), jnp.int32)
    assert gmm.unsupported_reason(x, w, sizes) is None
    assert "bf16 or f16" in gmm.unsupported_reason(s((16, 128), jnp.float32), s((4, 128, 64), jnp.float32), sizes)
    assert "x's dtype" in gmm.unsupported_reason(x, s((4, 128, 64), jnp.float16), sizes)
    assert "multiple of 64" in gmm.unsupported_reason(x, s((4, 128, 96), jnp.bfloat16), sizes)
    assert "group_sizes" in gmm.unsupported_reason(x, w, s((3,), jnp.int32))
    assert "x must be" in gmm.unsupported_reason(s((16, 64), jnp.bfloat16), w, sizes)
    assert "does not split K" in gmm.unsupported_reason(x, w, sizes, gmm.TuningConfig(k_splits=2))
    assert "shared memory" in gmm.unsupported_reason(
        s((4096, 2048), jnp.bfloat16), s((4, 2048, 64), jnp.bfloat16), sizes, gmm.TuningConfig(max_concurrent_steps=8)
    )
    with pytest.raises(NotImplementedError, match="multiple of 64"):
        gmm.grouped_matmul(jnp.zeros((2, 128), jnp.bfloat16), jnp.zeros((4, 128, 96), jnp.bfloat16), jnp.ones(4, int))

    dense_int4 = gmm.Int4KernelWeights(s((64, 128), jnp.int4), s((4, 64), jnp.float32), s((4, 64), jnp.float32), 64)
    assert "stacked" in gmm.int4_unsupported_reason(x, dense_int4, sizes)
    g16 = gmm.Int4KernelWeights(s((4, 64, 128), jnp.int4), s((4, 8, 64), jnp.float32), s((4, 8, 64), jnp.float32), 64)
    assert "multiple of 32" in gmm.int4_unsupported_reason(x, g16, sizes)
    assert "kernel layout" in gmm.int4_unsupported_reason(x, (w,), sizes)
    fp8 = gmm.Fp8KernelWeights(s((4, 64, 128), jnp.float8_e4m3fn), s((4, 64), jnp.float32), 64)
    assert gmm.fp8_unsupported_reason(x, fp8, sizes) is None
    bf16 = gmm.Fp8KernelWeights(s((4, 64, 128), jnp.bfloat16), s((4, 64), jnp.float32), 64)
    assert "e4m3" in gmm.fp8_unsupported_reason(x, bf16, sizes)


def test_default_config_tiles_rows_per_group():
    # Qwen3-30B-A3B (128 experts, top-8): decode 8 tokens -> 64 rows, half a row per
    # expert; a 256-token chunk 16 per expert; 2048 tokens fill 128-row tiles.
    assert [gmm.default_config(t * 8, 128).tile_t for t in (8, 256, 2048)] == [8, 16, 128]
    assert gmm.num_work_items(64, 128, 8) == 8 + 127


# -- 2. lowered for an H100 / H200 at Qwen3-30B-A3B's expert shapes ----------------------


@pytest.mark.parametrize("kind", ["float", "int4", "fp8"])
@pytest.mark.parametrize("tokens", MOE_TOKENS)
@pytest.mark.parametrize("name,k,n", QWEN3_MOE_PROJECTIONS, ids=[p[0] for p in QWEN3_MOE_PROJECTIONS])
def test_lowers_for_hopper(name, k, n, tokens, kind):
    rows = tokens * QWEN3_MOE_TOP_K
    exported, smem = lower_grouped_matmul(kind, rows, k, n)
    assert exported.platforms == ("cuda",)
    assert "mosaic_gpu" in exported.mlir_module()
    if smem:  # the private hook exists in jax 0.11.2 and 0.12
        config = gmm.default_config(rows, QWEN3_MOE_EXPERTS)
        assert len(smem) == 1 and smem[0] <= gmm.smem_bytes(kind, config, 2) <= gmm.SMEM_BYTES, (smem, config)


def test_lowers_warp_specialized_and_float16():
    config = gmm.TuningConfig(warp_specialized=True)
    for kind in ("float", "int4", "fp8"):
        lower_grouped_matmul(kind, 2048, 2048, 1536, config=config)
        lower_grouped_matmul(kind, 64, 768, 2048, dtype=jnp.float16)


# -- production shapes on a real GPU (JAXSERVE_MGPU_ON_GPU=1) ----------------------------


def routed_sizes(rng, tokens, experts=QWEN3_MOE_EXPERTS, top_k=QWEN3_MOE_TOP_K):
    """Group sizes of a random router: each token's top-k of random scores."""
    scores = rng.standard_normal((tokens, experts))
    chosen = np.argsort(-scores, axis=1)[:, :top_k]
    return [int(c) for c in np.bincount(chosen.ravel(), minlength=experts)]


@jax.jit
def _nan_for_empty(w, sizes):
    return jnp.where((sizes == 0)[:, None, None], jnp.nan, w)


def device_cases(seed, rows, k, n, sizes):
    """x and the three kinds of expert weights drawn on the device (128 experts' weights
    take minutes to quantize with NumPy): bf16 (NaN for empty experts), canonical int4
    (random nibbles, group 128), canonical fp8 (e4m3 within range, per-channel scales)."""
    keys = jax.random.split(jax.random.key(seed), 6)
    g = len(sizes)
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16).at[sum(sizes) :].set(jnp.nan)
    w = _nan_for_empty(jax.random.normal(keys[1], (g, k, n), jnp.bfloat16), jnp.asarray(sizes))
    packed = jax.random.randint(keys[2], (g, k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.uniform(keys[3], (g, k // 128, n), jnp.float32, 0.01, 0.02)
    int4 = [packed, scales, -8.5 * scales]
    fp8 = jnp.clip(jax.random.normal(keys[4], (g, k, n), jnp.float32) * 100, -448, 448).astype(jnp.float8_e4m3fn)
    fp8 = [fp8, jax.random.uniform(keys[5], (g, n), jnp.float32, 1e-3, 2e-3)]
    return x, w, int4, fp8


@pytest.mark.skipif(not ON_GPU, reason="production shapes need a GPU (set JAXSERVE_MGPU_ON_GPU=1)")
@pytest.mark.parametrize("routing", ["random", "one_expert"])
@pytest.mark.parametrize("tokens", MOE_TOKENS)
@pytest.mark.parametrize("name,k,n", QWEN3_MOE_PROJECTIONS, ids=[p[0] for p in QWEN3_MOE_PROJECTIONS])
def test_production_shapes_on_gpu(name, k, n, tokens, routing):
    rows = tokens * QWEN3_MOE_TOP_K
    sizes = routed_sizes(np.random.default_rng(tokens), tokens) if routing == "random" else [0] * 5 + [rows] + [0] * 122
    x, w, int4, fp8 = device_cases(tokens + k, rows, k, n, sizes)
    check_float(x, w, sizes)
    check_int4(x, int4, sizes)
    check_fp8(x, fp8, sizes)


@pytest.mark.interpret
@pytest.mark.parametrize("kind", ["bf16", "int4", "fp8"])
def test_expert_layers_in_the_kernel_layout_equal_their_reference(kind):
    """The model's stacked expert projections (jaxserve.model.moe), switched to the Mosaic GPU
    kernels as select_matmul does on a Hopper GPU, give what they gave on the references."""
    from flax import nnx

    from jaxserve.model.moe import ExpertLinear, QuantizedExpertLinear
    from jaxserve.model.quantization import QuantConfig, quantize

    e, din, dout = 4, 128, 64
    rng = np.random.default_rng(3)
    w = rng.standard_normal((e, din, dout)).astype(np.float32) / din**0.5
    if kind == "bf16":
        layer = ExpertLinear(e, din, dout, jnp.bfloat16, nnx.Rngs(0))
        layer.kernel[...] = jnp.asarray(w, jnp.bfloat16)
    else:
        layer = QuantizedExpertLinear(e, din, dout, QuantConfig.for_method(kind))
        pieces = [quantize(w[i], QuantConfig.for_method(kind)) for i in range(e)]
        for leaf in pieces[0]:
            getattr(layer, leaf)[...] = jnp.asarray(np.stack([p[leaf] for p in pieces]))
    x = jnp.asarray(rng.standard_normal((24, din)), jnp.bfloat16)
    group_sizes = jnp.asarray([7, 0, 12, 3], jnp.int32)
    want = np.asarray(layer(x, group_sizes), np.float32)

    def program():  # a new function each time: make_jaxpr caches by the callable
        return str(jax.make_jaxpr(lambda x, g: layer(x, g))(x, group_sizes))

    assert "ragged_dot" in program()  # the reference
    layer.use_kernel_layout(interpret=True)
    assert "ragged_dot" not in program(), "the reference still runs"
    got = np.asarray(layer(x, group_sizes), np.float32)
    np.testing.assert_allclose(got[:22], want[:22], rtol=2e-2, atol=2e-2)
    assert np.abs(want[:22]).max() > 0.5
