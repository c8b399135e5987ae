"""A model's parameters counted from its config: how many (in all, and active per token),
their bytes in the layout the engine loads (quantized projections, the rest in the model
dtype), one device's share under tensor or expert parallelism, and the bytes a step reads.

A dense layer is attention and an MLP. A mixture-of-experts layer (ModelConfig.is_moe_layer)
replaces the MLP by a router [D, E] (model dtype, never quantized) and E experts, each a
gate/up [D, F_moe] and down [F_moe, D] quantized like a dense MLP; Qwen2-MoE adds a shared
expert every token takes (a dense MLP of shared_expert_intermediate_size) and its sigmoid
gate [D, 1]. A token multiplies by the top k experts only, so

    active parameters = total - (E - k) * 3 * D * F_moe, for each MoE layer

(embeddings and LM head included, as model cards count them). A step of B tokens reads
only the experts some token was routed to. With uniform routing each token takes k
distinct experts of E, so it misses a given expert with probability 1 - k/E, and B
independent tokens touch on average

    E * (1 - (1 - k/E) ** B)    distinct experts per MoE layer

(k at B = 1, tending to E as B grows). Real routers are not uniform: skew means fewer
distinct experts at a given B, so this is the upper end of what a step reads.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

from jaxserve.model.config import ModelConfig
from jaxserve.model.quantization import QuantConfig


def attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(K, N) of a layer's q, k, v and o projections, by name."""
    d, dh = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * dh, cfg.num_kv_heads * dh
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d)}


def mlp_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """(K, N) of a gated MLP's gate, up and down projections (also one expert's), by name."""
    return {"gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}


def layer_projections(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, int]]:
    """(K, N) of the quantizable projections of decoder layer `layer` that every token
    multiplies by, by module path in the layer: attention, and the dense MLP (or, in a MoE
    layer, the shared expert if any). The routed experts are counted apart (`expert_shapes`)."""
    shapes = {f"self_attn.{name}": shape for name, shape in attention_shapes(cfg).items()}
    if not cfg.is_moe_layer(layer):
        mlp = mlp_shapes(cfg.hidden_size, cfg.intermediate_size)
        return shapes | {f"mlp.{name}": shape for name, shape in mlp.items()}
    if cfg.shared_expert_intermediate_size:
        mlp = mlp_shapes(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        return shapes | {f"mlp.shared_expert.{name}": shape for name, shape in mlp.items()}
    return shapes


def expert_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(K, N) of one routed expert's projections (none for a dense model)."""
    return list(mlp_shapes(cfg.hidden_size, cfg.moe_intermediate_size).values()) if cfg.is_moe else []


def num_moe_layers(cfg: ModelConfig) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def _unquantized_layer_params(cfg: ModelConfig, layer: int) -> int:
    """A layer's parameters kept in the model dtype: norms, biases, router and shared gate."""
    d, dh = cfg.hidden_size, cfg.head_dim
    n = 2 * d + (2 * dh if cfg.qk_norm else 0)
    if cfg.attention_bias:
        n += (cfg.num_heads + 2 * cfg.num_kv_heads) * dh
    if cfg.o_proj_bias:
        n += d
    if cfg.is_moe_layer(layer):
        n += d * cfg.num_experts  # the router
        if cfg.shared_expert_intermediate_size:
            n += d  # the shared expert's sigmoid gate [D, 1]
    return n


# -- counts ----------------------------------------------------------------------------


class ParamCounts(NamedTuple):
    """Parameters in all, and those one token multiplies by or gathers (embeddings and LM
    head included in both); equal for a dense model."""

    total: int
    active: int


def parameter_counts(cfg: ModelConfig) -> ParamCounts:
    """The model's parameters as Hugging Face counts them (a tied table once)."""
    layers = sum(
        sum(k * n for k, n in layer_projections(cfg, i).values()) + _unquantized_layer_params(cfg, i)
        for i in range(cfg.num_layers)
    )
    tables = (1 if cfg.tie_word_embeddings else 2) * cfg.vocab_size * cfg.hidden_size
    one_expert = sum(k * n for k, n in expert_shapes(cfg))
    experts = num_moe_layers(cfg) * cfg.num_experts * one_expert
    idle = num_moe_layers(cfg) * (cfg.num_experts - cfg.num_experts_per_tok) * one_expert
    total = layers + experts + tables + cfg.hidden_size  # and the final norm
    return ParamCounts(total, total - idle)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights each token multiplies by in the layers (not the LM head): attention, the
    dense MLPs, and in MoE layers the router, the shared expert and the top k experts."""
    per_token = 0
    for i in range(cfg.num_layers):
        per_token += sum(k * n for k, n in layer_projections(cfg, i).values())
        if cfg.is_moe_layer(i):
            per_token += cfg.hidden_size * cfg.num_experts  # the router
            per_token += cfg.hidden_size if cfg.shared_expert_intermediate_size else 0
            per_token += cfg.num_experts_per_tok * sum(k * n for k, n in expert_shapes(cfg))
    return per_token


def expected_distinct_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Experts of one MoE layer that `tokens` tokens touch on average under uniform
    routing: E * (1 - (1 - k/E) ** B). Each token picks k distinct experts of E, so it
    misses a given one with probability 1 - k/E, and B independent tokens all miss it
    with probability (1 - k/E) ** B."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


# -- bytes -----------------------------------------------------------------------------


def projection_bytes(k: int, n: int, dtype, quant: QuantConfig | None) -> int:
    """A [K, N] projection's parameter bytes in the layout `QuantizedLinear` keeps."""
    if quant is None:
        return k * n * jnp.dtype(dtype).itemsize
    if quant.kind == "int4":  # packed nibbles, a float32 scale and offset per group (act-order: an int32 order)
        return k // 2 * n + 2 * (k // quant.group_size_for(k)) * n * 4 + (4 * k if quant.act_order else 0)
    if quant.kind in ("int8", "int8_asym"):  # a byte a value, a float32 scale (and offset) per group
        return k * n + (2 if quant.kind == "int8_asym" else 1) * (k // quant.group_size_for(k)) * n * 4
    if quant.kind == "fp8_block":  # e4m3, a float32 scale per block
        bn, bk = quant.block
        return k * n + -(-k // bk) * -(-n // bn) * 4
    return k * n + n * 4  # fp8 e4m3, a float32 scale per output channel


def embedding_bytes(cfg: ModelConfig, dtype) -> int:
    return cfg.vocab_size * cfg.hidden_size * jnp.dtype(dtype).itemsize


def expert_bytes(cfg: ModelConfig, dtype, quant: QuantConfig | None = None) -> int:
    """One routed expert's bytes (quantized like a dense MLP, expert by expert)."""
    if quant is not None and cfg.is_moe:
        quant.check_experts()
    return sum(projection_bytes(k, n, dtype, quant) for k, n in expert_shapes(cfg))


class WeightBytes(NamedTuple):
    """The parameters' bytes in two parts: what every step reads (but an untied embedding
    table, of which a step gathers its tokens' rows only) and the routed experts."""

    embedding_table: int  # the untied input table (0 when tied: it is the LM head then)
    always_read: int  # attention, dense MLPs, norms, biases, routers, shared experts, LM head
    experts: int  # every MoE layer's E experts

    @property
    def total(self) -> int:
        return self.embedding_table + self.always_read + self.experts


def weight_parts(cfg: ModelConfig, dtype, quant: QuantConfig | None = None) -> WeightBytes:
    item = jnp.dtype(dtype).itemsize
    layers = sum(
        sum(
            projection_bytes(k, n, dtype, quant and quant.at(f"layers.{i}.{name}"))
            for name, (k, n) in layer_projections(cfg, i).items()
        )
        + _unquantized_layer_params(cfg, i) * item
        for i in range(cfg.num_layers)
    )
    table = embedding_bytes(cfg, dtype)  # the LM head stays unquantized
    return WeightBytes(
        embedding_table=0 if cfg.tie_word_embeddings else table,
        always_read=layers + table + cfg.hidden_size * item,
        experts=num_moe_layers(cfg) * cfg.num_experts * expert_bytes(cfg, dtype, quant),
    )


def weight_bytes(cfg: ModelConfig, dtype, quant: QuantConfig | None = None) -> int:
    """The parameters' bytes: quantized projections and experts, the rest (embeddings,
    norms, biases, routers, LM head) in the model dtype."""
    return weight_parts(cfg, dtype, quant).total


def device_weight_bytes(
    cfg: ModelConfig, dtype, quant: QuantConfig | None = None, *, tp: int = 1, expert_parallel: bool = False
) -> int:
    """One device's share over `tp` devices: 1/tp of every weight (tensor parallelism
    splits each expert's F_moe too), except that with `expert_parallel` a device holds
    ceil(E / tp) experts whole."""
    w = weight_parts(cfg, dtype, quant)
    if not expert_parallel or not cfg.is_moe:
        return w.total // tp
    experts_here = math.ceil(cfg.num_experts / tp)
    return (w.embedding_table + w.always_read) // tp + num_moe_layers(cfg) * experts_here * expert_bytes(
        cfg, dtype, quant
    )


def streamed_weight_bytes(
    cfg: ModelConfig,
    dtype,
    quant: QuantConfig | None = None,
    *,
    tokens: float | None = None,
    tp: int = 1,
    expert_parallel: bool = False,
) -> float:
    """Weight bytes one step of `tokens` tokens reads, per device over `tp`: all of them,
    except an untied embedding table (a step gathers only its tokens' rows) and, in MoE
    layers, the experts no token was routed to (expected_distinct_experts; None: all).
    With expert parallelism a device reads its own ceil(E / tp) experts' touched share."""
    w = weight_parts(cfg, dtype, quant)
    touched = 1.0
    if cfg.is_moe and tokens is not None:
        touched = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, tokens) / cfg.num_experts
    if not expert_parallel or not cfg.is_moe:
        return (w.always_read + touched * w.experts) / tp
    experts_here = math.ceil(cfg.num_experts / tp) * num_moe_layers(cfg) * expert_bytes(cfg, dtype, quant)
    return w.always_read / tp + touched * experts_here
