"""The Mosaic GPU dense matmul (bf16 / f16 weights as the model stores them), tested without
a GPU as the quantized kernels are (test_quantized_matmul_mgpu.py).

1. Under the Mosaic GPU interpreter against a float64 NumPy product of the same (16-bit)
   inputs: both weight layouts ([K, N] and a tied head's [N, K]), bf16 and f16, token
   counts that are not multiples of 8, K steps of 128, 64 and 32, K splits, the
   warp-specialized pipeline.
2. Lowered for CUDA with `jax.export` (sm_90) at SmolLM2-135M's and a Llama-1B-like shape,
   decode and prefill, both layouts, and the batch-invariant config.

With JAXSERVE_MGPU_ON_GPU=1 the cases of 1 run compiled on the GPU.

Tolerance as in test_quantized_matmul_mgpu: float32 products of the same inputs summed in
another order, then rounded once to bf16 / f16.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.mosaic_lowering import DENSE_PROJECTIONS, lower_matmul
from pallas_kernels import quantized_matmul_mgpu as mgpu

ON_GPU = os.environ.get("JAXSERVE_MGPU_ON_GPU") == "1"
if ON_GPU and jax.devices()[0].platform != "gpu":
    pytest.skip("JAXSERVE_MGPU_ON_GPU=1 but there is no GPU", allow_module_level=True)

INTERPRET = None if ON_GPU else True


def tolerance(dtype, want):
    ulp = float(jnp.finfo(dtype).eps)  # 2^-7 for bf16, 2^-10 for f16
    return dict(rtol=2 * ulp, atol=2 * ulp * 1e-2 * float(np.abs(want).max()))


def as_f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def dense_case(rng, t, k, n, dtype=jnp.bfloat16, transposed=False):
    """x [T, K] and the weight as stored ([K, N], or [N, K] when transposed)."""
    w = rng.standard_normal((n, k) if transposed else (k, n)) * 0.1
    x = rng.standard_normal((t, k)) * rng.uniform(0.1, 10.0, (t, 1))
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


def check_dense(x, w, transposed=False, config=None):
    got = as_f64(mgpu.dense_matmul(x, w, transposed=transposed, config=config, interpret=INTERPRET))
    w64 = as_f64(w)
    want = as_f64(x) @ (w64.T if transposed else w64)
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **tolerance(x.dtype, want))


# -- 1. interpreted (or, with JAXSERVE_MGPU_ON_GPU=1, compiled) ---------------------

LAYOUTS = pytest.mark.parametrize("transposed", [False, True], ids=["k_n", "n_k"])


@pytest.mark.interpret
@LAYOUTS
@pytest.mark.parametrize(
    "t,k,n",
    [
        (1, 256, 64),  # one token, K steps of 128
        (7, 576, 192),  # SmolLM2's hidden: K steps of 64; its K/V projection's N
        (33, 96, 128),  # K steps of 32; 33 tokens: a partial token tile of 40
        (130, 128, 64),  # two token tiles of 128, the second nearly empty
    ],
)
def test_dense_matches_float64(t, k, n, transposed):
    rng = np.random.default_rng(t * 1000 + k)
    x, w = dense_case(rng, t, k, n, transposed=transposed)
    check_dense(x, w, transposed)


@pytest.mark.interpret
@LAYOUTS
def test_dense_float16(transposed):
    rng = np.random.default_rng(16)
    x, w = dense_case(rng, 5, 256, 128, jnp.float16, transposed)
    check_dense(x, w, transposed)


@pytest.mark.interpret
@LAYOUTS
def test_dense_k_splits_and_warp_specialized_pipeline(transposed):
    """Decode's K split (summed by XLA in float32) and the memory warpgroup's pipeline."""
    rng = np.random.default_rng(3)
    x, w = dense_case(rng, 3, 1024, 128, transposed=transposed)
    assert mgpu.default_config(3, 128, 1024).k_splits == 2  # what config=None runs here
    check_dense(x, w, transposed)
    ws = mgpu.TuningConfig(warp_specialized=True, max_concurrent_steps=2, tile_k=64, k_splits=4)
    check_dense(x, w, transposed, ws)


# -- validation (no kernel) -----------------------------------------------------------


def test_dense_unsupported_inputs():
    s = jax.ShapeDtypeStruct
    x = s((4, 256), jnp.bfloat16)
    assert mgpu.dense_unsupported_reason(x, s((256, 128), jnp.bfloat16)) is None
    assert mgpu.dense_unsupported_reason(x, s((128, 256), jnp.bfloat16), transposed=True) is None
    assert "multiple of 64" in mgpu.dense_unsupported_reason(x, s((256, 100), jnp.bfloat16))
    assert "x's dtype" in mgpu.dense_unsupported_reason(x, s((256, 128), jnp.float16))
    assert "bf16 or f16" in mgpu.dense_unsupported_reason(s((4, 256), jnp.float32), s((256, 128), jnp.float32))
    assert "x must be" in mgpu.dense_unsupported_reason(x, s((256, 128), jnp.bfloat16), transposed=True)
    assert "multiple of" in mgpu.dense_unsupported_reason(s((4, 100), jnp.bfloat16), s((100, 64), jnp.bfloat16))
    splits = mgpu.TuningConfig(tile_t=64, k_splits=2)
    assert "batch_invariant" in mgpu.dense_unsupported_reason(x, s((256, 128), jnp.bfloat16), False, splits, True)
    too_deep = mgpu.TuningConfig(tile_t=128, max_concurrent_steps=6)
    assert "shared memory" in mgpu.dense_unsupported_reason(x, s((256, 128), jnp.bfloat16), config=too_deep)
    with pytest.raises(NotImplementedError, match="multiple of 64"):
        mgpu.dense_matmul(jnp.zeros((4, 256), jnp.bfloat16), jnp.zeros((256, 100), jnp.bfloat16))


# -- 2. lowered for an H100 / H200 ----------------------------------------------------


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("tokens", [1, 256])
@pytest.mark.parametrize("name,k,n,transposed", DENSE_PROJECTIONS, ids=[s[0] for s in DENSE_PROJECTIONS])
def test_dense_lowers_for_hopper(name, k, n, transposed, tokens, batch_invariant):
    exported, smem = lower_matmul("dense", tokens, k, n, transposed=transposed, batch_invariant=batch_invariant)
    assert exported.platforms == ("cuda",)
    assert "mosaic_gpu" in exported.mlir_module()
    if smem:  # the hook exists in jax 0.11.2 and 0.12
        step = mgpu._k_step(k)
        config = mgpu.invariant_config(step) if batch_invariant else mgpu.default_config(tokens, n, k, tile_k=step)
        assert len(smem) == 1 and smem[0] <= mgpu.smem_bytes("dense", config, 4), (smem, config)
