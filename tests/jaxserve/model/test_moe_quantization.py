"""Quantized experts (--quantization int4 / fp8 on Mixtral, Qwen2-MoE and Qwen3-MoE) against
transformers run on the weights our quantized parameters stand for: every projection, each
expert's included, set to its dequantized value (read with plain NumPy bit operations), the
router and the shared expert's gate left in float as we keep them. Prefill and decode."""

import copy
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxserve.model.kv_cache import allocate_kv_cache
from jaxserve.model.moe import QuantizedExpertLinear, SparseMoE
from jaxserve.model.quantization import QuantizedLinear
from jaxserve.weights import load_model
from tests.jaxserve.model.test_model_vs_hf import jitted_step
from tests.jaxserve.model.test_quantization import fake_quantize_e4m3_per_token, numpy_int4_weight, quantized_weight
from tests.paged import PagedSequences
from tests.tiny_models import make_tiny_model

MOE_MODELS = ["mixtral", "qwen2-moe", "qwen3-moe"]
# int4 needs a group (128, 64 or 32) dividing each projection's K: the tiny configs' 48-wide
# experts (Mixtral) and shared expert (Qwen2-MoE) are widened to 64 here.
INT4_WIDTHS = {"mixtral": dict(intermediate_size=64), "qwen2-moe": dict(shared_expert_intermediate_size=64)}
PROMPT_LENS = [11, 1, 16]
BLOCK_SIZE = 4
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", params=MOE_MODELS)
def tiny_moe(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, make_tiny_model(request.param, folder, **INT4_WIDTHS.get(request.param, {}))


def expert_weights(stacked: QuantizedExpertLinear) -> np.ndarray:
    """The float weights [E, K, N] a stacked quantized projection stands for, expert by expert."""
    if stacked.kind == "int4":
        packed, scales, offsets = (np.asarray(p[...]) for p in (stacked.packed, stacked.scales, stacked.offsets))
        return np.stack([numpy_int4_weight(packed[e], scales[e], offsets[e]) for e in range(packed.shape[0])])
    return np.asarray(stacked.weight[...]).astype(np.float64) * np.asarray(stacked.scales[...], np.float64)[:, None, :]


def set_linear(hf_linear, ours: QuantizedLinear) -> None:
    hf_linear.weight.copy_(torch.tensor(quantized_weight(ours).T, dtype=torch.float32))


def set_hf_weights_to_dequantized(hf_model, loaded) -> None:
    """Every projection of the transformers model set to what our quantized layer stands for.
    transformers holds the experts fused: gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F]."""
    with torch.no_grad():
        for ours, theirs in zip(loaded.model.layers, hf_model.model.layers):
            for name in ATTENTION:
                set_linear(getattr(theirs.self_attn, name), getattr(ours.self_attn, name))
            if not isinstance(ours.mlp, SparseMoE):  # a dense-MLP layer (Qwen2-MoE's mlp_only_layers)
                for name in MLP:
                    set_linear(getattr(theirs.mlp, name), getattr(ours.mlp, name))
                continue
            assert not isinstance(ours.mlp.gate, QuantizedLinear), "the router stays float"
            experts = ours.mlp.experts
            gate, up, down = (expert_weights(getattr(experts, name)) for name in MLP)  # [E, K, N]
            gate_up = np.concatenate([gate, up], axis=2).transpose(0, 2, 1)
            theirs.mlp.experts.gate_up_proj.copy_(torch.tensor(gate_up, dtype=torch.float32))
            theirs.mlp.experts.down_proj.copy_(torch.tensor(down.transpose(0, 2, 1), dtype=torch.float32))
            if hasattr(ours.mlp, "shared_expert"):
                assert not isinstance(ours.mlp.shared_expert_gate, QuantizedLinear)
                for name in MLP:
                    set_linear(getattr(theirs.mlp.shared_expert, name), getattr(ours.mlp.shared_expert, name))


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return fake_quantize_e4m3_per_token(None, (x,))[0]


def experts_with_e4m3_inputs(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts loop, each projection's input rounded to e4m3 per token by torch
    (what W8A8 does to every (token, expert) row)."""
    out = torch.zeros_like(hidden_states)
    f = self.down_proj.shape[-1]
    for t in range(hidden_states.shape[0]):
        for j, e in enumerate(top_k_index[t].tolist()):
            gate_up = torch.nn.functional.linear(e4m3(hidden_states[t : t + 1]), self.gate_up_proj[e])
            h = self.act_fn(gate_up[:, :f]) * gate_up[:, f:]
            out[t] += (torch.nn.functional.linear(e4m3(h), self.down_proj[e]) * top_k_weights[t, j])[0]
    return out


def hf_logits(hf_model, prompts, method):
    hooks = []
    if method == "fp8":
        for name, module in hf_model.named_modules():
            if name.rsplit(".", 1)[-1] in ATTENTION + MLP and isinstance(module, torch.nn.Linear):
                hooks.append(module.register_forward_pre_hook(fake_quantize_e4m3_per_token))
            elif name.endswith("mlp.experts"):
                module.forward = types.MethodType(experts_with_e4m3_inputs, module)
    try:
        with torch.no_grad():
            return [hf_model(torch.tensor([p])).logits[0].double().numpy() for p in prompts]
    finally:
        for h in hooks:
            h.remove()
        for name, module in hf_model.named_modules():
            if name.endswith("mlp.experts"):
                module.__dict__.pop("forward", None)


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_quantized_experts_equal_transformers_on_the_dequantized_weights(tiny_moe, method):
    folder, hf_model = tiny_moe
    hf_model = copy.deepcopy(hf_model)  # its weights are overwritten below
    loaded = load_model(str(folder), use_cache=False, progress=False, quantization=method)
    moe = next(layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoE))
    assert isinstance(moe.experts.gate_proj, QuantizedExpertLinear) and moe.experts.gate_proj.kind == method
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, loaded.config.vocab_size, n)) for n in PROMPT_LENS]
    float_want = hf_logits(hf_model, prompts, None)  # the checkpoint's own weights, before we overwrite them
    set_hf_weights_to_dequantized(hf_model, loaded)
    want = hf_logits(hf_model, prompts, method)
    step, state = jitted_step(loaded.model)

    # prefill: every position of every prompt
    seqs = PagedSequences(PROMPT_LENS, BLOCK_SIZE, num_blocks=20)
    kv = allocate_kv_cache(loaded.config, 20, BLOCK_SIZE, jnp.float32)
    logits, _ = step(state, kv, seqs.step(prompts, [(0, n) for n in PROMPT_LENS], pad_to=32, all_logits=True))
    got = np.split(np.asarray(logits, np.float64), np.cumsum(PROMPT_LENS)[:-1])
    for s, (g, w) in enumerate(zip(got, want)):
        assert np.abs(g - w).max() <= 1e-4, f"prefill, sequence {s}: max abs error {np.abs(g - w).max():.2e}"
    assert max(np.abs(g - f).max() for g, f in zip(got, float_want)) > 1e-3, (
        f"{method} should change the logits (else the comparison above checked the float model)"
    )

    # decode: prefill all but the last 5 tokens, then one token per step, batched
    seqs = PagedSequences(PROMPT_LENS, BLOCK_SIZE, num_blocks=20, seed=3)
    kv = allocate_kv_cache(loaded.config, 20, BLOCK_SIZE, jnp.float32)
    done = [max(1, n - 5) for n in PROMPT_LENS]
    logits, kv = step(state, kv, seqs.step(prompts, [(0, d) for d in done], pad_to=32))
    for s, d in enumerate(done):
        np.testing.assert_allclose(np.asarray(logits[s]), want[s][d - 1], atol=1e-4, rtol=0)
    while any(d < n for d, n in zip(done, PROMPT_LENS)):
        spans = [(d, d + 1) if d < n else (n - 1, n) for d, n in zip(done, PROMPT_LENS)]
        logits, kv = step(state, kv, seqs.step(prompts, spans, pad_to=8))
        for s, (start, _) in enumerate(spans):
            err = np.abs(np.asarray(logits[s], np.float64) - want[s][start]).max()
            assert err <= 1e-4, f"decode, sequence {s} position {start}: max abs error {err:.2e}"
        done = [min(d + 1, n) for d, n in zip(done, PROMPT_LENS)]
