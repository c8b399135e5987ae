"""The C++ mixture-of-experts kernel (cpu_kernels.moe_experts) against a float64 NumPy oracle and
against moe.run_touched_experts (the lax loop it replaces) on the same random weights; the
untouched experts' weights are NaN, so reading one shows. Then the engine: its greedy tokens
with the kernel equal those of the grouped matmul reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.model import moe
from jaxserve.model.config import ModelConfig
from jaxserve.weights import load_model
from jaxserve.weights.load import default_cache_dir
from pallas_kernels import cpu_kernels
from tests.jaxserve.engine.test_engine import engine, run_alone, workload
from tests.jaxserve.model.test_moe_touched_experts import numpy_oracle
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.build(default_cache_dir()) is None


def make_experts(num_experts: int, dtype, seed: int) -> moe.Experts:
    """D 200 and F 300: the projections split over K unevenly, activation blocks (256 columns) ragged."""
    cfg = ModelConfig(
        architecture="MixtralForCausalLM",
        vocab_size=97,
        hidden_size=200,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=50,
        max_position_embeddings=64,
        num_experts=num_experts,
        num_experts_per_tok=2,
        moe_intermediate_size=300,
    )
    return moe.Experts(cfg, dtype, nnx.Rngs(seed))


def routed(tokens: int, num_experts: int, k: int, seed: int, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, 200)), dtype)
    logits = jnp.asarray(rng.standard_normal((tokens, num_experts)), jnp.float32)
    weights, chosen = moe.route(logits, k, norm_topk_prob=True, weights_in_float32=True)
    return x, weights, chosen


def poison_untouched(experts: moe.Experts, chosen) -> None:
    """NaN in every expert no token chose: the kernel must not read them."""
    untouched = np.setdiff1d(np.arange(experts.gate_proj.kernel.shape[0]), np.asarray(chosen))
    for proj in (experts.gate_proj, experts.up_proj, experts.down_proj):
        proj.kernel[...] = proj.kernel[...].at[untouched].set(jnp.nan)


def kernel(experts: moe.Experts, x, weights, chosen):
    return jax.jit(moe.run_touched_experts_in_cpp, static_argnums=4)(experts, x, weights, chosen, 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("tokens", "k"), [(1, 1), (1, 2), (3, 2), (3, 8), (64, 1), (64, 2), (64, 8)])
def test_kernel_equals_float64_and_the_expert_loop(tokens, k, dtype):
    """k 8 of 8 experts touches all; k 1 and 2 leave some untouched (their weights NaN)."""
    experts = make_experts(8, dtype, seed=tokens * 10 + k)
    x, weights, chosen = routed(tokens, 8, k, seed=k, dtype=dtype)
    loop = np.asarray(moe.run_touched_experts(experts, x, weights, chosen, 8), np.float64)
    poison_untouched(experts, chosen)
    got = kernel(experts, x, weights, chosen)
    assert got.dtype == x.dtype and got.shape == x.shape
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all()
    if dtype == jnp.float32:
        want = numpy_oracle(experts, x, weights, chosen)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(got, loop, atol=2e-5, rtol=2e-5)
    else:  # bf16 rounds each projection: a few of its ulps apart where the two sums round differently
        scale = np.abs(loop).max()
        np.testing.assert_allclose(got, loop, atol=2e-2 * scale, rtol=0)
        assert np.mean(np.abs(got - loop)) < 2e-3 * scale


def test_one_expert_chosen_by_every_token():
    """All 40 tokens chose expert 6, half of them expert 1 too, the other half expert 2."""
    experts = make_experts(8, jnp.float32, seed=5)
    x, weights, _ = routed(40, 8, 2, seed=5, dtype=jnp.float32)
    chosen = jnp.asarray([[6, 1] if t % 2 else [2, 6] for t in range(40)], jnp.int32)
    poison_untouched(experts, chosen)
    got = np.asarray(kernel(experts, x, weights, chosen), np.float64)
    np.testing.assert_allclose(got, numpy_oracle(experts, x, weights, chosen), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_token_gets_the_same_bits_whatever_the_other_tokens(dtype):
    """Each token's sums run in one order (by K, then by expert), whatever shares the call."""
    experts = make_experts(8, dtype, seed=7)
    x, weights, chosen = routed(24, 8, 2, seed=7, dtype=dtype)
    together = np.asarray(kernel(experts, x, weights, chosen), np.float32)
    for t in (0, 5, 23):
        alone = np.asarray(kernel(experts, x[t : t + 1], weights[t : t + 1], chosen[t : t + 1]), np.float32)
        np.testing.assert_array_equal(alone[0], together[t])


def test_mixed_dtypes_are_refused():
    experts = make_experts(4, jnp.float32, seed=0)
    x, weights, chosen = routed(2, 4, 2, seed=0, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="one dtype"):
        moe.run_touched_experts_in_cpp(experts, x, weights, chosen, 4)


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_engine_tokens_with_the_kernel_equal_the_reference(family, tmp_path):
    """The default backend (the C++ kernel for decode steps, checked in the compiled program)
    against the grouped matmul reference throughout; Qwen2-MoE has a shared expert."""
    make_tiny_model(family, tmp_path)
    loaded = load_model(str(tmp_path), use_cache=False, progress=False)
    prompts, params = workload(count=6)
    want = run_alone(engine(loaded, matmul_backend="reference"), prompts, params)
    eng = engine(loaded)
    layers = moe.moe_layers(loaded.model)
    assert layers and all(layer.few_tokens_runner is moe.run_touched_experts_in_cpp for _, layer in layers)
    x = jnp.zeros((3, loaded.model.cfg.hidden_size), loaded.model.dtype)
    assert cpu_kernels.MOE_EXPERTS_TARGET in jax.jit(lambda x: layers[0][1](x)).lower(x).as_text()
    assert run_alone(eng, prompts, params) == want
