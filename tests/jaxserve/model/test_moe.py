"""The mixture-of-experts pieces against oracles we did not write: the router against NumPy
(ties included) and against transformers' routers, and the sorted grouped-matmul form of
the experts (values and gradients) against the dense form that runs every expert on every
token and masks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.moe import Experts, route, run_experts


def numpy_route(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax in float32, the k largest with ties to the lower expert index, renormed if asked."""
    z = logits.astype(np.float32)
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, chosen, -1)
    return (weights / weights.sum(-1, keepdims=True) if norm else weights), chosen


@pytest.mark.parametrize("norm", [True, False])
def test_route_equals_numpy_including_ties(norm):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 8)).astype(np.float32)
    logits[:16, 5] = logits[:16, 2]  # ties inside and at the edge of the top k
    logits[16:32] = 0.25  # every expert tied
    logits[32:40, [1, 4, 6]] = logits[32:40, [0]] + 3.0  # three tied winners for two places
    weights, chosen = route(jnp.asarray(logits), 3, norm_topk_prob=norm, weights_in_float32=True)
    want_weights, want_chosen = numpy_route(logits, 3, norm)
    np.testing.assert_array_equal(np.asarray(chosen), want_chosen)
    np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-6, atol=1e-7)
    assert np.asarray(chosen)[16].tolist() == [0, 1, 2]


ROUTERS = {  # architecture: (the transformers router, config fields)
    "Qwen3Moe": (
        "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
        dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
    ),
    "Qwen2Moe": (
        "qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter",
        dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=False),
    ),
    "Mixtral": ("mixtral.modeling_mixtral.MixtralTopKRouter", dict(num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", sorted(ROUTERS))
def test_route_equals_transformers_router(arch, dtype):
    """Weights, experts and the weights' dtype as Hugging Face's router gives them (float32
    softmax of logits in the model dtype; Qwen casts the weights back, Mixtral keeps float32).
    Inputs without ties: on ties torch.topk's order is unspecified (it differs between CPU and
    GPU); ours goes to the lower expert index (test above), as vLLM's routing kernel does."""
    path, fields = ROUTERS[arch]
    module, name = path.rsplit(".", 1)
    router_cls = getattr(__import__(f"transformers.models.{module}", fromlist=[name]), name)
    hf_config = getattr(transformers, f"{arch}Config")(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, **fields
    )
    cfg = ModelConfig.from_hf_dict({**hf_config.to_dict(), "architectures": [f"{arch}ForCausalLM"]})
    torch.manual_seed(0)
    router = router_cls(hf_config).to(getattr(torch, dtype))
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight))
        x = torch.randn(40, 32).to(router.weight.dtype)
        hf_logits, hf_weights, hf_chosen = router(x)
    logits = jnp.asarray(hf_logits.float().numpy()).astype(dtype)  # exact: float32 holds bfloat16
    weights, chosen = route(
        logits,
        cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob,
        weights_in_float32=cfg.routing_weights_in_float32,
    )
    np.testing.assert_array_equal(np.asarray(chosen), hf_chosen.numpy())
    assert str(weights.dtype) == str(hf_weights.dtype).removeprefix("torch.")
    np.testing.assert_allclose(np.asarray(weights, np.float32), hf_weights.float().numpy(), rtol=1e-6, atol=1e-6)


def tiny_experts(num_experts=5, d=16, f=24):
    cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=11,
        hidden_size=d,
        intermediate_size=f,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        num_experts=num_experts,
        num_experts_per_tok=2,
        moe_intermediate_size=f,
    )
    return cfg, Experts(cfg, jnp.float32, nnx.Rngs(0))


def dense_experts(experts: Experts, x, weights, chosen, num_experts):
    """Every expert on every token, weighted by a [T, E] matrix that is zero off the chosen ones."""
    mix = jnp.zeros((x.shape[0], num_experts)).at[jnp.arange(x.shape[0])[:, None], chosen].add(weights)
    gate, up, down = (p.kernel[...] for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    h = jax.nn.silu(jnp.einsum("td,edf->etf", x, gate)) * jnp.einsum("td,edf->etf", x, up)
    return jnp.einsum("etf,efd,te->td", h, down, mix)


@pytest.mark.parametrize("load", ["random", "all to one expert", "one expert idle"])
def test_sorted_experts_and_their_gradients_equal_the_dense_form(load):
    cfg, experts = tiny_experts()
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((13, cfg.hidden_size)), jnp.float32)
    logits = rng.standard_normal((13, cfg.num_experts)).astype(np.float32)
    if load == "all to one expert":
        logits[:, 3] += 100.0
    elif load == "one expert idle":
        logits[:, 1] -= 100.0
    weights, chosen = route(jnp.asarray(logits), 2, norm_topk_prob=True, weights_in_float32=True)
    graphdef, params = nnx.split(experts)

    def loss(params, x, weights, form):
        out = form(nnx.merge(graphdef, params), x, weights, chosen, cfg.num_experts)
        return jnp.sum(out * jnp.cos(out)), out

    (_, got), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(params, x, weights, run_experts)
    (_, want), want_grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(params, x, weights, dense_experts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    if load == "one expert idle":  # no gradient reaches an expert no token chose
        assert not np.asarray(grads[0]["gate_proj"]["kernel"][...])[1].any()
