"""The few-token expert loop (moe.run_touched_experts) against the grouped matmul path
(moe.run_experts on grouped_matmul_reference) and a float64 NumPy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.model import moe
from jaxserve.model.config import ModelConfig


def experts_and_inputs(num_experts: int, k: int, tokens: int, dtype, seed: int = 0):
    cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=97,
        hidden_size=48,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        max_position_embeddings=64,
        num_experts=num_experts,
        num_experts_per_tok=k,
        moe_intermediate_size=40,
        norm_topk_prob=True,
    )
    experts = moe.Experts(cfg, dtype, nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size)), dtype)
    logits = jnp.asarray(rng.standard_normal((tokens, num_experts)), jnp.float32)
    weights, chosen = moe.route(logits, k, norm_topk_prob=True, weights_in_float32=True)
    return experts, x, weights, chosen


def numpy_oracle(experts: moe.Experts, x, weights, chosen) -> np.ndarray:
    """sum_j weights[t, j] * SwiGLU_{chosen[t, j]}(x[t]) in float64."""
    g, u, d = (np.asarray(p.kernel[...], np.float64) for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    x, weights, chosen = np.asarray(x, np.float64), np.asarray(weights, np.float64), np.asarray(chosen)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], chosen[t]):
            a = x[t] @ g[e]
            out[t] += w * (((a / (1 + np.exp(-a))) * (x[t] @ u[e])) @ d[e])
    return out


@pytest.mark.parametrize(("num_experts", "k", "tokens"), [(8, 2, 1), (8, 2, 5), (6, 3, 64), (16, 4, 3)])
def test_touched_experts_match_the_grouped_matmul_and_float64(num_experts, k, tokens):
    experts, x, weights, chosen = experts_and_inputs(num_experts, k, tokens, jnp.float32)
    got = np.asarray(moe.run_touched_experts(experts, x, weights, chosen, num_experts))
    grouped = np.asarray(moe.run_experts(experts, x, weights, chosen, num_experts))
    want = numpy_oracle(experts, x, weights, chosen)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got, grouped, atol=2e-5, rtol=2e-5)
    assert np.abs(want).max() > 0.1


def test_every_token_on_the_same_experts():
    """Uneven loads: all tokens chose experts 3 and 5; the six others are skipped."""
    experts, x, weights, _ = experts_and_inputs(8, 2, 7, jnp.float32, seed=1)
    chosen = jnp.tile(jnp.asarray([[5, 3]], jnp.int32), (7, 1))
    got = np.asarray(moe.run_touched_experts(experts, x, weights, chosen, 8))
    np.testing.assert_allclose(got, numpy_oracle(experts, x, weights, chosen), atol=2e-5, rtol=2e-5)


def test_bfloat16_rounds_like_the_grouped_matmul():
    experts, x, weights, chosen = experts_and_inputs(8, 2, 4, jnp.bfloat16, seed=2)
    got = moe.run_touched_experts(experts, x, weights, chosen, 8)
    grouped = moe.run_experts(experts, x, weights, chosen, 8)
    assert got.dtype == grouped.dtype == jnp.bfloat16
    got, grouped = np.asarray(got, np.float32), np.asarray(grouped, np.float32)
    np.testing.assert_allclose(got, grouped, atol=2e-2 * np.abs(grouped).max(), rtol=0)


def test_the_layer_takes_the_loop_up_to_its_token_limit():
    """Marked for the CPU (as select_matmul does), SparseMoE runs the loop for up to
    EXPERT_LOOP_MAX_TOKENS tokens and the grouped matmul above; both give the float64 answer
    (the program shows which ran: a while loop or none). Unmarked, it never loops."""
    cfg = ModelConfig(
        architecture="MixtralForCausalLM",
        vocab_size=97,
        hidden_size=48,
        intermediate_size=40,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        max_position_embeddings=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
        norm_topk_prob=True,
        routing_weights_in_float32=True,
    )
    layer = moe.SparseMoE(cfg, jnp.float32, nnx.Rngs(3))
    rng = np.random.default_rng(4)
    cases = ((moe.EXPERT_LOOP_MAX_TOKENS, True), (moe.EXPERT_LOOP_MAX_TOKENS + 1, False), (1, False))
    for tokens, loop in cases:
        layer.expert_loop_max_tokens = moe.EXPERT_LOOP_MAX_TOKENS if tokens > 1 else 0
        x = jnp.asarray(rng.standard_normal((tokens, 48)), jnp.float32)
        weights, chosen = moe.route(layer.gate(x), 2, norm_topk_prob=True, weights_in_float32=True)
        want = numpy_oracle(layer.experts, x, weights, chosen)
        np.testing.assert_allclose(np.asarray(layer(x)), want, atol=2e-5, rtol=2e-5)
        program = jax.jit(lambda x: layer(x)).lower(x).as_text()
        assert ("stablehlo.while" in program) == loop, tokens
