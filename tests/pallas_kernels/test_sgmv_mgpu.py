"""LoRA's segmented gather matmul (pallas_kernels.sgmv_mgpu) on the Mosaic GPU grouped
matmul, tested without a GPU as the other kernels are:

1. Under the Mosaic GPU interpreter against `bgmv_reference` (the plain-jnp product the
   engine runs everywhere else): rows in any slot order, slot-0 rows ("no adapter") among
   them, slots no row uses, all rows in one adapter, no adapter at all, T not a multiple of
   the row tile, f16. The stacks of slot 0 and of the slots no row uses are NaN: a kernel
   that reads them shows.
2. Lowered for CUDA with `jax.export` at Llama-3-8B's projections (d 4096, KV 1024, MLP
   14336), 8 slots of rank 16 rounded up to 64, for 8, 256 and 2048 tokens.

With JAXSERVE_MGPU_ON_GPU=1 (benchmarks/gpu_check.sh) the cases of 1 run compiled on the GPU.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.mosaic_lowering import LLAMA3_8B_LORA, LORA_TOKENS, lower_sgmv
from jaxserve.model.lora import bgmv_reference
from pallas_kernels import grouped_matmul_mgpu as gmm
from pallas_kernels import sgmv_mgpu

ON_GPU = os.environ.get("JAXSERVE_MGPU_ON_GPU") == "1"
if ON_GPU and jax.devices()[0].platform != "gpu":
    pytest.skip("JAXSERVE_MGPU_ON_GPU=1 but there is no GPU", allow_module_level=True)
INTERPRET = None if ON_GPU else True


def stacks(rng, slots_used, n, d_in, d_out, rank, dtype):
    """A [n, d_in, rank] and B [n, rank, d_out]; slot 0 and the slots no row uses are NaN."""
    a = rng.standard_normal((n, d_in, rank)) / np.sqrt(d_in)
    b = rng.standard_normal((n, rank, d_out)) / np.sqrt(rank)
    unused = [s for s in range(n) if s == 0 or s not in slots_used]
    a[unused], b[unused] = np.nan, np.nan
    return jnp.asarray(a, dtype), jnp.asarray(b, dtype)


def check(rng, slots, n=5, d_in=128, d_out=128, rank=64, dtype=jnp.bfloat16):
    slots = np.asarray(slots, np.int32)
    x = jnp.asarray(rng.standard_normal((len(slots), d_in)), dtype)
    a, b = stacks(rng, set(slots.tolist()), n, d_in, d_out, rank, dtype)
    got = sgmv_mgpu.sgmv(x, a, b, jnp.asarray(slots), interpret=INTERPRET)
    clean = lambda s: jnp.where(jnp.isnan(s), 0, s)  # noqa: E731 (what the engine's empty slots hold)
    want = bgmv_reference(x, clean(a), clean(b), jnp.asarray(slots))
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all()
    # The same float32 products summed in another order, and the shrink rounded once to x's
    # dtype in both: a few units in the last place of the expand's inputs.
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(got, want, rtol=4 * eps, atol=4 * eps * np.abs(want).max())
    assert not got[slots == 0].any()  # rows without an adapter get exactly nothing
    return got


@pytest.mark.interpret
@pytest.mark.parametrize(
    "slots",
    [
        [3, 0, 1, 3, 3, 0, 1, 4, 1, 3, 0],  # unsorted, slot-0 rows among them, slot 2 unused
        [2] * 19,  # every row in one adapter, a partial last tile
        [1, 2, 3, 4],  # decode-like: a row per adapter
        [0, 0, 0],  # no adapter at all: zeros, no stack read
    ],
    ids=["mixed", "one-adapter", "row-per-adapter", "no-adapter"],
)
def test_sgmv_equals_the_bgmv_reference(slots):
    check(np.random.default_rng(len(slots)), slots)


@pytest.mark.interpret
def test_float16_wider_outputs_and_rank_128():
    rng = np.random.default_rng(7)
    check(rng, [1, 0, 2, 2, 1], n=3, d_in=64, d_out=192, rank=128, dtype=jnp.float16)


def test_kernel_rank_and_clear_refusals():
    assert [sgmv_mgpu.kernel_rank(r) for r in (1, 16, 64, 65)] == [64, 64, 64, 128]
    x = jax.ShapeDtypeStruct((8, 128), jnp.bfloat16)
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    assert sgmv_mgpu.unsupported_reason(x, s(3, 128, 64), s(3, 64, 128)) is None
    assert "multiple of 64" in sgmv_mgpu.unsupported_reason(x, s(3, 128, 16), s(3, 16, 128))
    assert "must agree" in sgmv_mgpu.unsupported_reason(x, s(3, 128, 64), s(2, 64, 128))
    f32 = jax.ShapeDtypeStruct((3, 128, 64), jnp.float32)
    assert "dtype" in sgmv_mgpu.unsupported_reason(x, f32, s(3, 64, 128))
    with pytest.raises(NotImplementedError, match="sgmv"):
        z = jnp.zeros
        sgmv_mgpu.sgmv(
            z((8, 128), jnp.bfloat16), z((3, 128, 16), jnp.bfloat16), z((3, 16, 128), jnp.bfloat16), z(8, int)
        )


@pytest.mark.parametrize("tokens", LORA_TOKENS)
@pytest.mark.parametrize("name,d_in,d_out", LLAMA3_8B_LORA, ids=[p[0] for p in LLAMA3_8B_LORA])
def test_lowers_for_hopper(name, d_in, d_out, tokens):
    exported, smem = lower_sgmv(tokens, d_in, d_out)
    assert exported.platforms == ("cuda",)
    assert "mosaic_gpu" in exported.mlir_module()
    if smem:  # the private hook exists in jax 0.11.2 and 0.12: the shrink and the expand
        assert len(smem) == 2 and max(smem) <= gmm.SMEM_BYTES, smem
