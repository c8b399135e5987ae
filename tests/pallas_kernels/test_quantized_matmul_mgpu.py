"""The Mosaic GPU quantized matmuls (W4A16, FP8 W8A8), tested without a GPU in two ways.

1. Run under the Mosaic GPU interpreter on small shapes against the pure-JAX references
   (`int4_matmul_reference`, `fp8_matmul_reference`) on the canonical weights: token
   counts 1, 7, 8, 33, 200 (one token tile, a partial one, several), int4 group sizes 32,
   64, 128, N not a multiple of the 64-row tile, bf16 and f16 activations, K splits,
   reduced versions of the default model's projections, the warp-specialized pipeline.
2. Lowered for CUDA with `jax.export` at Llama-3-8B shapes (fused QKV 4096 x 6144, MLP
   4096 x 14336 and 14336 x 4096) for 1, 16 and 256 tokens, plain and warp-specialized
   pipelines; Mosaic GPU targets sm_90
   without a GPU and checks the shared-memory budget (227 KiB) while lowering.

With JAXSERVE_MGPU_ON_GPU=1 (benchmarks/gpu_check.sh) the same cases run compiled on
the GPU instead of interpreted, and production-shape cases are added against the
reference.

Tolerance: the kernels compute the same float32 products as the references (the same
dequantized weights, the same quantized activations) and differ only in the order of
float32 additions; the output is then rounded to bf16 / f16 once. So results may differ
by one rounding step of the output dtype: rtol = 2 ulp, plus an atol for sums that cancel.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.mosaic_lowering import LLAMA3_8B_PROJECTIONS, int4_weight_shapes, lower_matmul
from jaxserve.model.quantization import quantize_fp8, quantize_int4
from pallas_kernels import quantized_matmul_mgpu as mgpu
from pallas_kernels.quantized_matmul import fp8_matmul_reference, int4_matmul_reference

ON_GPU = os.environ.get("JAXSERVE_MGPU_ON_GPU") == "1"
if ON_GPU and jax.devices()[0].platform != "gpu":
    pytest.skip("JAXSERVE_MGPU_ON_GPU=1 but there is no GPU", allow_module_level=True)

INTERPRET = None if ON_GPU else True


def tolerance(dtype, want):
    ulp = float(jnp.finfo(dtype).eps)  # 2^-7 for bf16, 2^-10 for f16
    return dict(rtol=2 * ulp, atol=2 * ulp * 1e-2 * float(np.abs(want).max()))


def int4_case(rng, t, k, n, group, dtype=jnp.bfloat16):
    w = rng.standard_normal((k, n)).astype(np.float32)
    params = quantize_int4(w, group)
    canonical = [jnp.asarray(params[name]) for name in ("packed", "scales", "offsets")]
    x = jnp.asarray(rng.standard_normal((t, k)), dtype)
    return x, canonical


def fp8_case(rng, t, k, n, dtype=jnp.bfloat16):
    # Rows of very different magnitudes: per-token activation scales must matter.
    w = rng.standard_normal((k, n)).astype(np.float32) * rng.uniform(0.1, 3.0, (1, n)).astype(np.float32)
    params = quantize_fp8(w)
    canonical = [jnp.asarray(params[name]) for name in ("weight", "scales")]
    x = rng.standard_normal((t, k)) * rng.uniform(0.01, 10.0, (t, 1))
    return jnp.asarray(x, dtype), canonical


def as_f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def check_int4(x, canonical, config=None):
    got = as_f64(mgpu.int4_matmul(x, mgpu.prepare_int4(*canonical), config=config, interpret=INTERPRET))
    want = as_f64(int4_matmul_reference(x, *canonical))
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **tolerance(x.dtype, want))


def check_fp8(x, canonical, config=None):
    got = as_f64(mgpu.fp8_matmul(x, mgpu.prepare_fp8(*canonical), config=config, interpret=INTERPRET))
    want = as_f64(fp8_matmul_reference(x, *canonical))
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **tolerance(x.dtype, want))


# -- 1. interpreted (or, with JAXSERVE_MGPU_ON_GPU=1, compiled) ---------------------

TOKENS = [1, 7, 8, 33, 200]


@pytest.mark.interpret
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("tokens", TOKENS)
def test_int4_token_counts_and_groups(tokens, group):
    """N = 96: one full 64-row tile and a padded one; K = 256 spans several groups."""
    rng = np.random.default_rng(tokens * 1000 + group)
    check_int4(*int4_case(rng, tokens, 256, 96, group))


@pytest.mark.interpret
@pytest.mark.parametrize("tokens", TOKENS)
def test_fp8_token_counts(tokens):
    rng = np.random.default_rng(tokens)
    check_fp8(*fp8_case(rng, tokens, 256, 96))


@pytest.mark.interpret
@pytest.mark.parametrize("kind,tokens", [("int4", 1), ("int4", 33), ("fp8", 8), ("fp8", 200)])
def test_warp_specialized_pipeline(kind, tokens):
    """A memory warpgroup issues the TMA copies, the compute warpgroup does the math."""
    rng = np.random.default_rng(tokens)
    config = mgpu.TuningConfig(warp_specialized=True, max_concurrent_steps=2)
    if kind == "int4":
        check_int4(*int4_case(rng, tokens, 256, 96, 64), config=config)
    else:
        check_fp8(*fp8_case(rng, tokens, 256, 96), config=config)


@pytest.mark.interpret
def test_float16_activations():
    rng = np.random.default_rng(16)
    check_int4(*int4_case(rng, 5, 256, 64, 64, jnp.float16))
    check_fp8(*fp8_case(rng, 5, 256, 64, jnp.float16))


@pytest.mark.interpret
@pytest.mark.parametrize("k_splits", [2, 4])
def test_k_splits_sum_partial_products(k_splits):
    """K cut into parts whose float32 partial products XLA adds (the decode default)."""
    rng = np.random.default_rng(k_splits)
    config = mgpu.TuningConfig(k_splits=k_splits, tile_k=64, max_concurrent_steps=2)
    check_int4(*int4_case(rng, 3, 512, 64, 128), config=config)
    check_fp8(*fp8_case(rng, 3, 512, 64), config=config)


@pytest.mark.interpret
@pytest.mark.parametrize("k,n,group", [(576, 192, 64), (1536, 64, 128)])
def test_default_model_projections_reduced(k, n, group):
    """SmolLM2-135M's K (hidden 576: group 64, K steps of 64; intermediate 1536) with N
    cut down (192 is its K/V projection; the 576 / 1536 outputs are the same tiles more
    times) so the interpreter stays quick."""
    rng = np.random.default_rng(k)
    check_int4(*int4_case(rng, 4, k, n, group))
    check_fp8(*fp8_case(rng, 4, k, n))


def test_stacked_layers_convert_like_single_ones():
    """prepare_* keep leading (layer) axes: the scanned model's stacked parameters."""
    rng = np.random.default_rng(0)
    layers = [int4_case(rng, 1, 128, 80, 32)[1] for _ in range(2)]
    stacked = mgpu.prepare_int4(*(jnp.stack(p) for p in zip(*layers)))
    for i, canonical in enumerate(layers):
        single = mgpu.prepare_int4(*canonical)
        for name in ("q", "scales", "offsets"):
            np.testing.assert_array_equal(getattr(stacked, name)[i], getattr(single, name))
    assert stacked.n == 80 and stacked.q.shape == (2, 128, 128)


def test_int4_kernel_layout_decodes_to_the_same_weight():
    """The kernel layout (signed int4 [N, K], offsets + 8 * scales) stands for the same
    float weight as the canonical one, padded with zero output channels."""
    rng = np.random.default_rng(1)
    _, (packed, scales, offsets) = int4_case(rng, 1, 64, 70, 32)
    w = mgpu.prepare_int4(packed, scales, offsets)
    rows = np.arange(64) // 32
    kernel_w = (as_f64(w.q.astype(jnp.float32)) * as_f64(w.scales)[rows].T + as_f64(w.offsets)[rows].T).T
    from pallas_kernels.quantized_matmul import dequantize_int4

    np.testing.assert_allclose(kernel_w[:, :70], as_f64(dequantize_int4(packed, scales, offsets)), rtol=1e-6, atol=1e-6)
    assert not kernel_w[:, 70:].any()


# -- validation (no kernel) -----------------------------------------------------------


def test_unsupported_inputs_raise_clear_errors():
    rng = np.random.default_rng(2)
    x, canonical = int4_case(rng, 2, 128, 64, 32)
    weights = mgpu.prepare_int4(*canonical)
    assert "bf16 or f16" in mgpu.int4_unsupported_reason(x.astype(jnp.float32), weights)
    with pytest.raises(NotImplementedError, match="bf16 or f16"):
        mgpu.int4_matmul(x.astype(jnp.float32), weights)
    assert "kernel layout" in mgpu.int4_unsupported_reason(x, canonical)
    assert "x must be" in mgpu.int4_unsupported_reason(x[:, :64], weights)
    # Group 16 (K 128, 8 groups) is below the 32-element K step.
    s = jax.ShapeDtypeStruct
    g16 = mgpu.Int4KernelWeights(s((64, 128), jnp.int4), s((8, 64), jnp.float32), s((8, 64), jnp.float32), 64)
    assert "group size 16" in mgpu.int4_unsupported_reason(x, g16)
    fp8_w = mgpu.Fp8KernelWeights(s((64, 100), jnp.float8_e4m3fn), s((64,), jnp.float32), 64)
    assert "multiple of" in mgpu.fp8_unsupported_reason(s((2, 100), jnp.bfloat16), fp8_w)
    bf16_w = mgpu.Fp8KernelWeights(s((64, 128), jnp.bfloat16), s((64,), jnp.float32), 64)
    assert "e4m3" in mgpu.fp8_unsupported_reason(s((2, 128), jnp.bfloat16), bf16_w)
    too_deep = mgpu.TuningConfig(tile_t=128, max_concurrent_steps=8)
    assert "shared memory" in mgpu.int4_unsupported_reason(
        s((256, 4096), jnp.bfloat16), int4_weight_shapes(4096, 4096, 128), too_deep
    )
    with pytest.raises(ValueError, match="tile_t"):
        mgpu.TuningConfig(tile_t=12)
    with pytest.raises(ValueError, match="tile_k"):
        mgpu.TuningConfig(tile_k=48)
    with pytest.raises(ValueError, match="K steps"):
        mgpu.int4_matmul(x, weights, config=mgpu.TuningConfig(k_splits=3, tile_k=32), interpret=True)


def test_default_config_splits_k_to_fill_the_sms():
    # Decode: 64 output tiles (N 4096) -> 2 splits (128 CTAs on 132 SMs); 96 (N 6144) -> 4
    # (3 waves of quarter-K work instead of 1 wave of full K on 96 SMs); 224 -> 4.
    assert [mgpu.default_config(1, n, 4096).k_splits for n in (4096, 6144, 14336)] == [2, 4, 4]
    assert mgpu.default_config(256, 14336, 4096).k_splits == 1
    assert mgpu.default_config(256, 4096, 14336).tile_t == 128
    assert mgpu.default_config(7, 4096, 4096).tile_t == 8


# -- 2. lowered for an H100 / H200 at production shapes ----------------------------
# (the shapes live in benchmarks/mosaic_lowering.py: the sm_90a compile report uses them too)


def _check_smem(smem, kind, config):
    if smem:  # the hook exists in jax 0.11.2 and 0.12
        assert len(smem) == 1 and smem[0] <= mgpu.SMEM_BYTES, smem
        assert smem[0] <= mgpu.smem_bytes(kind, config, 4), (smem, config)


@pytest.mark.parametrize("warp_specialized", [False, True], ids=["pipelined", "warp_specialized"])
@pytest.mark.parametrize("kind", ["int4", "fp8"])
@pytest.mark.parametrize("tokens", [1, 16, 256])
@pytest.mark.parametrize("name,k,n", LLAMA3_8B_PROJECTIONS, ids=[s[0] for s in LLAMA3_8B_PROJECTIONS])
def test_lowers_for_hopper(name, k, n, tokens, kind, warp_specialized):
    config = mgpu.TuningConfig(warp_specialized=warp_specialized)
    exported, smem = lower_matmul(kind, tokens, k, n, config=config)
    assert exported.platforms == ("cuda",)
    assert "mosaic_gpu" in exported.mlir_module()
    _check_smem(smem, kind, mgpu._finish_config(mgpu.default_config(tokens, n, k), tokens, n, k))


@pytest.mark.parametrize("group,tokens", [(32, 8), (64, 128)])
def test_lowers_other_group_sizes(group, tokens):
    """GGUF's Q4 blocks (group 32) and the 64 fallback: K steps of the group size."""
    exported, smem = lower_matmul("int4", tokens, 4096, 4096, group=group)
    config = mgpu._finish_config(mgpu.default_config(tokens, 4096, 4096, tile_k=group), tokens, 4096, 4096)
    _check_smem(smem, "int4", config)


@pytest.mark.parametrize(
    "config",
    [
        mgpu.TuningConfig(tile_t=64, a_via_smem=True, k_splits=1),
        mgpu.TuningConfig(tile_t=128, max_concurrent_steps=3, k_splits=1),
        mgpu.TuningConfig(tile_t=8, max_concurrent_steps=6, k_splits=4),
    ],
)
def test_lowers_other_configs(config):
    _, smem = lower_matmul("int4", 64, 4096, 6144, config=config)
    _check_smem(smem, "int4", config)
    _, smem = lower_matmul("fp8", 64, 4096, 6144, config=config)
    _check_smem(smem, "fp8", config)


def test_lowers_default_model_and_float16():
    """SmolLM2-135M (hidden 576, intermediate 1536) in f16: K steps of 64 for K = 576."""
    for k, n in [(576, 576), (576, 192), (576, 1536), (1536, 576)]:
        lower_matmul("int4", 8, k, n, group=64 if k == 576 else 128, dtype=jnp.float16)
        lower_matmul("fp8", 8, k, n, dtype=jnp.float16)


def test_shared_memory_overflow_is_caught_when_lowering(monkeypatch):
    """A config past 227 KiB fails at lowering, not on the GPU (shown with our own check off)."""
    config = mgpu.TuningConfig(tile_t=128, max_concurrent_steps=8, k_splits=1)
    assert mgpu.smem_bytes("int4", config, 2) > mgpu.SMEM_BYTES
    monkeypatch.setattr(mgpu, "int4_unsupported_reason", lambda *args, **kwargs: None)
    with pytest.raises(Exception, match="shared memory"):
        lower_matmul("int4", 128, 4096, 4096, config=config)


# -- production shapes on a real GPU (JAXSERVE_MGPU_ON_GPU=1) ------------------------


@pytest.mark.skipif(not ON_GPU, reason="production shapes need a GPU (set JAXSERVE_MGPU_ON_GPU=1)")
@pytest.mark.parametrize("tokens", [1, 16, 256])
@pytest.mark.parametrize("name,k,n", LLAMA3_8B_PROJECTIONS, ids=[s[0] for s in LLAMA3_8B_PROJECTIONS])
@pytest.mark.parametrize("warp_specialized", [False, True], ids=["pipelined", "warp_specialized"])
def test_production_shapes_on_gpu(name, k, n, tokens, warp_specialized):
    rng = np.random.default_rng(tokens)
    config = mgpu.TuningConfig(warp_specialized=warp_specialized)
    check_int4(*int4_case(rng, tokens, k, n, 128), config=config)
    check_fp8(*fp8_case(rng, tokens, k, n), config=config)
