"""`jaxserve.model.weight_sizes` against numbers it did not compute: the parameters of the real
transformers models (torch, tiny configs), the arrays the real quantizers produce, a
Monte-Carlo simulation of routing, and the published sizes of Qwen3-30B-A3B and Mixtral-8x7B."""

import math

import numpy as np
import pytest

from jaxserve.model.config import ModelConfig
from jaxserve.model.quantization import QuantConfig, quantize
from jaxserve.model.sizing import DEVICES, Setup
from jaxserve.model.weight_sizes import (
    device_weight_bytes,
    expected_distinct_experts,
    expert_bytes,
    parameter_counts,
    streamed_weight_bytes,
    weight_bytes,
)

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# name -> (architecture, overrides): every MoE family, with dense-MLP layers, a shared expert, tied tables
TINY_MOE = {
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)),
    "qwen3-moe-mlp-only-tied": (
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=48,
            head_dim=24,
            mlp_only_layers=[0],
            tie_word_embeddings=True,
        ),
    ),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    "qwen2-moe-shared-sparse-step": (
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=80,
            decoder_sparse_step=2,
        ),
    ),
}


def hf_model(name):
    import torch
    import transformers

    arch, overrides = TINY_MOE[name]
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**TINY, **overrides)
    torch.manual_seed(0)
    return getattr(transformers, arch)(config).eval(), ModelConfig.from_hf_dict(config.to_dict())


def hf_counts(model, top_k: int) -> dict:
    """Counted from the torch model's own parameters: in all, active (each experts tensor
    [E, ...] weighted k / E) and the weights each token multiplies by (2-D and stacked
    expert matrices, not the input table; the LM head once even when tied)."""
    total = active = matmul = 0
    for name, p in model.named_parameters():  # a tied table appears once
        n = p.numel()
        if ".experts." in name:
            share = top_k / p.shape[0]
            total, active, matmul = total + n, active + n * share, matmul + n * share
            continue
        total, active = total + n, active + n
        if p.ndim == 2 and "embed_tokens" not in name:
            matmul += n
    if model.config.tie_word_embeddings:
        matmul += model.config.vocab_size * model.config.hidden_size
    return {"total": total, "active": round(active), "matmul": round(matmul)}


@pytest.mark.parametrize("name", list(TINY_MOE))
def test_parameter_counts_are_the_torch_models(name):
    model, cfg = hf_model(name)
    oracle = hf_counts(model, cfg.num_experts_per_tok)
    counts = parameter_counts(cfg)
    assert counts.total == oracle["total"] == sum(p.numel() for p in model.parameters())
    assert counts.active == oracle["active"] < counts.total
    # unquantized, the bytes are the parameters times the dtype's size
    assert weight_bytes(cfg, "float32") == 4 * oracle["total"]
    assert weight_bytes(cfg, "bfloat16") == 2 * oracle["total"]


@pytest.mark.parametrize("name", list(TINY_MOE))
def test_decode_at_batch_1_reads_the_active_weights_and_computes_with_them(name):
    """One token touches k experts: the step reads the active parameters (less the input
    table it only gathers from) plus the KV, and does 2 FLOPs per matmul weight."""
    model, cfg = hf_model(name)
    oracle = hf_counts(model, cfg.num_experts_per_tok)
    table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    context, kv_per_token = 10, 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    bound = Setup(cfg, "float32", kv_dtype="float32").decode_bound(DEVICES["h100"], 1, context)
    assert bound.bytes == 4 * (oracle["active"] - table) + (context + 1) * kv_per_token
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    assert bound.flops == 2 * oracle["matmul"] + attention
    # a long prompt touches every expert: all the weights but the input table are read
    everything = streamed_weight_bytes(cfg, "float32", tokens=10_000)
    assert everything == pytest.approx(4 * (oracle["total"] - table), rel=1e-12)


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_quantized_expert_bytes_are_what_the_quantizer_makes(method):
    """Each expert quantized like a dense MLP (the grouped matmul's stacked layouts)."""
    model, cfg = hf_model("qwen3-moe")
    quant = QuantConfig.for_method(method)
    experts = model.model.layers[0].mlp.experts
    gate_up, down = experts.gate_up_proj.detach().numpy(), experts.down_proj.detach().numpy()  # [E, 2F, D], [E, D, F]
    f = cfg.moe_intermediate_size
    for e in range(cfg.num_experts):
        # HF keeps [out, in]; QuantizedLinear quantizes [K=in, N=out]
        projections = (gate_up[e, :f].T, gate_up[e, f:].T, down[e].T)
        nbytes = sum(a.nbytes for w in projections for a in quantize(np.ascontiguousarray(w), quant).values())
        assert expert_bytes(cfg, "float32", quant) == nbytes


@pytest.mark.parametrize(("experts", "top_k", "tokens"), [(8, 2, 1), (8, 2, 3), (60, 4, 7), (128, 8, 16), (128, 8, 64)])
def test_distinct_experts_match_a_simulation(experts, top_k, tokens):
    """Each token routed to k distinct experts of E drawn uniformly (the top k of random
    logits); the mean number of distinct experts over many simulated steps."""
    rng = np.random.default_rng(0)
    trials = 4000
    logits = rng.random((trials, tokens, experts))
    chosen = np.argpartition(-logits, top_k - 1, axis=-1)[..., :top_k]  # [trials, B, k]
    touched = np.zeros((trials, experts), bool)
    np.put_along_axis(touched, chosen.reshape(trials, -1), True, axis=1)
    simulated = touched.sum(axis=1).mean()
    assert expected_distinct_experts(experts, top_k, tokens) == pytest.approx(simulated, rel=0.01, abs=0.05)


def test_distinct_experts_at_the_ends():
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(8, 2, 1) == pytest.approx(2)
    assert expected_distinct_experts(128, 8, 2000) == pytest.approx(128)
    assert expected_distinct_experts(8, 8, 1) == 8  # every expert, every token
    assert expected_distinct_experts(0, 0, 5) == 0  # a dense model
    steps = [expected_distinct_experts(64, 4, b) for b in (1, 2, 4, 8, 16, 32)]
    assert steps == sorted(steps) and steps[-1] < 64


def published(arch, **fields):
    return ModelConfig.from_hf_dict({"architectures": [arch], **fields})


QWEN3_30B_A3B = published(
    "Qwen3MoeForCausalLM",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)
MIXTRAL_8X7B = published(
    "MixtralForCausalLM",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
)


@pytest.mark.parametrize(
    ("cfg", "total", "active"),
    [(QWEN3_30B_A3B, 30.5e9, 3.3e9), (MIXTRAL_8X7B, 46.7e9, 12.9e9)],
    ids=["qwen3", "mixtral"],
)
def test_the_model_cards_sizes(cfg, total, active):
    """Qwen3-30B-A3B: 30.5B in all, 3.3B activated; Mixtral-8x7B: 46.7B, 12.9B active."""
    counts = parameter_counts(cfg)
    assert counts.total == pytest.approx(total, rel=0.005)
    assert counts.active == pytest.approx(active, rel=0.02)


def test_mixtral_turns_compute_bound_where_all_experts_are_read():
    """Context 1, bf16 on an H100: by then every expert is touched, so a step reads all the
    weights (but the input table) and computes with the active ones: the ridge is the data
    sheet's (989.4 / 3.35) times total / active, over 3x the dense model's batch."""
    cfg = MIXTRAL_8X7B
    setup = Setup(cfg, "bfloat16", kv_dtype="bfloat16")
    counts = parameter_counts(cfg)
    table = cfg.vocab_size * cfg.hidden_size
    ridge = 989.4 / 3.35 * (counts.total - table) / (counts.active - table)
    turn = setup.compute_bound_batch(DEVICES["h100"], context=1)
    assert 0.98 * ridge < turn < 1.02 * ridge
    assert turn > 3 * 989.4 / 3.35


def test_expert_parallel_holds_whole_experts_per_device():
    """8 experts over tp 2: 4 whole per device, the bytes tensor parallelism's halves give;
    over tp 3: 3 whole (ceil), more than a third of each."""
    cfg = MIXTRAL_8X7B
    one = expert_bytes(cfg, "bfloat16")
    assert one == 3 * 4096 * 14336 * 2
    experts = cfg.num_layers * 8 * one
    rest = weight_bytes(cfg, "bfloat16") - experts
    assert device_weight_bytes(cfg, "bfloat16", tp=2) == (rest + experts) // 2
    assert device_weight_bytes(cfg, "bfloat16", tp=2, expert_parallel=True) == rest // 2 + cfg.num_layers * 4 * one
    assert device_weight_bytes(cfg, "bfloat16", tp=3, expert_parallel=True) == rest // 3 + cfg.num_layers * 3 * one
    # a decode step of one token reads on average k/E of each device's experts
    per_device = streamed_weight_bytes(cfg, "bfloat16", tokens=1, tp=3, expert_parallel=True)
    untied_table = cfg.vocab_size * cfg.hidden_size * 2
    assert per_device == pytest.approx((rest - untied_table) / 3 + cfg.num_layers * 3 * one * 2 / 8)
    assert math.isclose(
        streamed_weight_bytes(cfg, "bfloat16", tokens=1, tp=2, expert_parallel=True),
        streamed_weight_bytes(cfg, "bfloat16", tokens=1, tp=2),
    )
