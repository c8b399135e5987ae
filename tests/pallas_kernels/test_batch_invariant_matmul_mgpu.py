"""`batch_invariant=True` for the Mosaic GPU matmuls (dense, int4, fp8): a token's output row
has the same bits whatever else the call computes, in the interpreter (or, with
JAXSERVE_MGPU_ON_GPU=1, compiled on a GPU).

The row x0 makes a change of summation order visible after the rounding to bf16: two
huge terms cancel (x0 is +-4096 at k = 0 and K / 2, whose weight rows are equal and
4096 times the others), so the float32 sum's rounding errors along the way are large
next to the result. The default config splits K in two for up to 32 tokens (K = 1024,
N = 128: 2 CTAs) and not above, so x0 alone and x0 among 40 rows differ there: the
test that shows it keeps the property test honest.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxserve.model.quantization import quantize_fp8, quantize_int4
from pallas_kernels import quantized_matmul_mgpu as mgpu

ON_GPU = os.environ.get("JAXSERVE_MGPU_ON_GPU") == "1"
if ON_GPU and jax.devices()[0].platform != "gpu":
    pytest.skip("JAXSERVE_MGPU_ON_GPU=1 but there is no GPU", allow_module_level=True)

INTERPRET = None if ON_GPU else True
K, N, GROUP = 1024, 128, 128
HUGE = 4096.0
KINDS = ("dense", "int4", "fp8")


def cancelling_weight(rng) -> np.ndarray:
    """[K, N] float32 whose rows 0 and K / 2 are equal and huge; the int4 group holding K / 2
    copies the first one, so both quantize to the same values."""
    w = rng.standard_normal((K, N)).astype(np.float32)
    w[K // 2 : K // 2 + GROUP] = w[:GROUP]
    w[[0, K // 2]] *= HUGE
    return w


def cancelling_row(rng) -> jax.Array:
    x0 = rng.standard_normal(K)
    x0[0], x0[K // 2] = HUGE, -HUGE
    return jnp.asarray(x0, jnp.bfloat16)


@pytest.fixture(scope="module")
def matmuls():
    """kind -> f(x, batch_invariant) on one cancelling weight in that kind's layout."""
    w = cancelling_weight(np.random.default_rng(0))
    int4 = quantize_int4(w, GROUP)
    int4 = mgpu.prepare_int4(*(jnp.asarray(int4[name]) for name in ("packed", "scales", "offsets")))
    fp8 = quantize_fp8(w)
    fp8 = mgpu.prepare_fp8(jnp.asarray(fp8["weight"]), jnp.asarray(fp8["scales"]))
    dense = jnp.asarray(w, jnp.bfloat16)
    return {
        "dense": lambda x, inv: mgpu.dense_matmul(x, dense, batch_invariant=inv, interpret=INTERPRET),
        "int4": lambda x, inv: mgpu.int4_matmul(x, int4, batch_invariant=inv, interpret=INTERPRET),
        "fp8": lambda x, inv: mgpu.fp8_matmul(x, fp8, batch_invariant=inv, interpret=INTERPRET),
    }


def row_among_others(x0, num_tokens: int, where: int, seed: int) -> jax.Array:
    """x0 at row `where` of num_tokens rows; the others random, of varied magnitudes."""
    rng = np.random.default_rng(seed)
    others = rng.standard_normal((num_tokens, K)) * rng.uniform(0.01, 100.0, (num_tokens, 1))
    return jnp.asarray(others, jnp.bfloat16).at[where].set(x0)


@pytest.mark.interpret
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=6, deadline=None, derandomize=True)
@given(num_tokens=st.integers(1, 150), where=st.integers(0, 149))
@example(num_tokens=150, where=130)  # the third token tile
@example(num_tokens=65, where=64)  # alone in the second one
@example(num_tokens=9, where=8)  # a column OpenBLAS's Haswell kernel sums in another order (conftest)
def test_a_row_is_the_same_in_any_batch(matmuls, kind, num_tokens, where):
    """1..150 tokens: up to three token tiles of 64, x0 anywhere in them."""
    where %= num_tokens
    x0 = cancelling_row(np.random.default_rng(1))
    alone = np.asarray(matmuls[kind](x0[None], True))[0]
    batch = np.asarray(matmuls[kind](row_among_others(x0, num_tokens, where, num_tokens), True))
    assert np.array_equal(batch[where], alone)


@pytest.mark.interpret
@pytest.mark.parametrize("kind", KINDS)
def test_the_default_config_is_not_batch_invariant(matmuls, kind):
    """One token splits K in two, 40 tokens do not: x0's row changes in its last bits."""
    assert mgpu.default_config(1, N, K).k_splits == 2 and mgpu.default_config(40, N, K).k_splits == 1
    x0 = cancelling_row(np.random.default_rng(1))
    alone = np.asarray(matmuls[kind](x0[None], False))[0]
    batch = np.asarray(matmuls[kind](row_among_others(x0, 40, 17, 40), False))
    assert not np.array_equal(batch[17], alone)


def test_the_invariant_config_does_not_depend_on_the_token_count():
    config = mgpu.invariant_config(64)
    assert (config.tile_t, config.tile_k, config.k_splits) == (mgpu.INVARIANT_TILE_T, 64, 1)
    assert mgpu.is_invariant(config) and not mgpu.is_invariant(mgpu.TuningConfig(tile_t=64))
    s = jax.ShapeDtypeStruct
    weights = mgpu.Fp8KernelWeights(s((N, K), jnp.float8_e4m3fn), s((N,), jnp.float32), N)
    split = mgpu.TuningConfig(tile_t=8, k_splits=2)
    assert "batch_invariant" in mgpu.fp8_unsupported_reason(s((1, K), jnp.bfloat16), weights, split, True)
    with pytest.raises(NotImplementedError, match="batch_invariant"):
        mgpu.fp8_matmul(jnp.zeros((1, K), jnp.bfloat16), weights, config=split, batch_invariant=True)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_fp8_activation_quantization_is_row_wise(jitted):
    """Each row's e4m3 values and scale come from that row alone, eagerly (as the tests call
    the kernels) and under jit (as the model does). A scale once divided by 448 eagerly for a
    lone row but was multiplied by 1 / 448 for two or more."""
    from pallas_kernels.quantized_matmul import quantize_fp8_per_token

    quantize = jax.jit(quantize_fp8_per_token) if jitted else quantize_fp8_per_token
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((64, 256)) * rng.uniform(0.01, 100, (64, 1)), jnp.bfloat16)
    q, scale = quantize(x)
    for row in range(0, 64, 7):
        q1, scale1 = quantize(x[row : row + 1])
        assert np.array_equal(np.asarray(q[row : row + 1], np.float32), np.asarray(q1, np.float32))
        assert np.array_equal(np.asarray(scale[row : row + 1]), np.asarray(scale1))
