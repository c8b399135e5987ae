"""Model configuration: one frozen dataclass read from a Hugging Face `config.json`.

The decoder family is Llama-shaped. The supported architectures differ only in a few
switches, all of which live here:

| architecture        | QKV bias | q/k RMSNorm | sliding window | rope scaling   | MLP                      |
|---------------------|----------|-------------|----------------|----------------|--------------------------|
| LlamaForCausalLM    | optional | no          | no             | llama3, linear | dense                    |
| MistralForCausalLM  | no       | no          | optional       | no             | dense                    |
| Qwen2ForCausalLM    | yes      | no          | optional       | linear         | dense                    |
| Qwen3ForCausalLM    | optional | yes         | optional       | linear         | dense                    |
| MixtralForCausalLM  | no       | no          | optional       | no             | experts, top-k renormed  |
| Qwen2MoeForCausalLM | optional | no          | optional       | linear         | experts + shared expert  |
| Qwen3MoeForCausalLM | optional | yes         | optional       | linear         | experts                  |

A mixture-of-experts MLP (jaxserve.model.moe) routes each token to `num_experts_per_tok`
of `num_experts` experts: softmax over the router's logits in float32, the top k, renormed
to sum to one when `norm_topk_prob` (always for Mixtral). Qwen's MoE models keep a dense
MLP on the layers in `mlp_only_layers` and on those whose index + 1 is not a multiple of
`decoder_sparse_step`.

A compressed-tensors checkpoint may ship calibrated KV-cache scales (`kv_cache_scheme`:
a static `k_scale` and `v_scale` per attention layer, or per layer and KV head); `kv_scales`
names the 8-bit type they were calibrated for, and an 8-bit cache then stores K and V with
them (jaxserve.model.kv_cache) instead of a scale per token.

Anything outside that table is refused with an error that names the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for an architecture or a feature this engine does not have."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for long context (None in ModelConfig: plain)."""

    rope_type: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k and v projections
    o_proj_bias: bool = False  # Llama's and Qwen3's attention_bias also bias o_proj
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (0 experts: a dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's hidden size
    norm_topk_prob: bool = False  # renorm the top-k routing weights to sum to 1
    routing_weights_in_float32: bool = False  # Mixtral keeps them in float32; Qwen casts to the model dtype
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, sigmoid-gated
    dense_mlp_layers: tuple[int, ...] = ()  # layers of a MoE model that have a dense MLP instead
    kv_scales: str | None = None  # "fp8" or "int8": the checkpoint's k_scale / v_scale are for that type

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has experts (else a dense MLP)."""
        return self.is_moe and layer not in self.dense_mlp_layers

    def rope_inv_freq(self) -> np.ndarray:
        """Rotary inverse frequencies [head_dim // 2] in float32, scaled as configured."""
        exponents = np.arange(0, self.head_dim, 2, dtype=np.int64).astype(np.float32) / self.head_dim
        inv_freq = (1.0 / (np.float32(self.rope_theta) ** exponents)).astype(np.float32)
        s = self.rope_scaling
        if s is None:
            return inv_freq
        if s.rope_type == "linear":
            return (inv_freq / np.float32(s.factor)).astype(np.float32)
        # llama3: long wavelengths are divided by `factor`, short ones kept, and the band
        # between them interpolated smoothly.
        low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config dict, refusing what the engine cannot run."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else _architecture_from_model_type(hf.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _refuse_unsupported_fields(hf)

        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        bias = bool(hf.get("attention_bias", False)) and arch not in ("MistralForCausalLM", "MixtralForCausalLM")
        qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        if arch == "Qwen2MoeForCausalLM":
            bias = bool(hf.get("qkv_bias", True))  # Qwen2-MoE's name for q/k/v bias; no o_proj bias
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or bias,
            o_proj_bias=not qwen2 and bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=_sliding_window(hf, arch),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            kv_scales=_kv_scales(hf),
            **_moe_fields(hf, arch),
        )


def _architecture_from_model_type(model_type: str | None) -> str:
    by_type = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
    }
    if model_type not in by_type:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported")
    return by_type[model_type]


def _moe_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The ModelConfig fields of a mixture of experts (none for a dense architecture)."""
    if arch == "MixtralForCausalLM":
        return dict(
            num_experts=hf.get("num_local_experts", hf.get("num_experts", 8)),
            num_experts_per_tok=hf.get("num_experts_per_tok", 2),
            moe_intermediate_size=hf["intermediate_size"],  # Mixtral's experts are its MLPs
            norm_topk_prob=True,
            routing_weights_in_float32=True,
        )
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    defaults = {"Qwen2MoeForCausalLM": (60, 4), "Qwen3MoeForCausalLM": (128, 8)}[arch]  # transformers' own
    # NOTE: transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (Mixtral's name)
    num_experts = hf.get("num_experts", hf.get("num_local_experts", defaults[0]))
    layers = hf["num_hidden_layers"]
    if not num_experts:
        raise UnsupportedModelError(f"{arch} with num_experts={num_experts}: no experts")
    step = hf.get("decoder_sparse_step") or 1
    mlp_only = set(hf.get("mlp_only_layers") or ())
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=hf.get("num_experts_per_tok", defaults[1]),
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(
            hf.get("shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
        ),
        dense_mlp_layers=tuple(i for i in range(layers) if i in mlp_only or (i + 1) % step),
    )


_KV_SCHEME_TYPES = {"float": "fp8", "int": "int8"}


def _kv_scales(hf: dict[str, Any]) -> str | None:
    """The 8-bit type of a compressed-tensors `kv_cache_scheme` with static scales (None: no
    scheme, or a dynamic one, which ships no scales); refuses what an 8-bit cache cannot hold."""
    quant = hf.get("quantization_config") or {}
    scheme = quant.get("kv_cache_scheme") if quant.get("quant_method") == "compressed-tensors" else None
    if scheme is None or scheme.get("dynamic", False) is not False:
        return None
    kind = _KV_SCHEME_TYPES.get(scheme.get("type", "int"))
    if scheme.get("num_bits") != 8 or kind is None:
        raise UnsupportedModelError(
            f"kv_cache_scheme with num_bits={scheme.get('num_bits')!r} and type={scheme.get('type')!r} is not "
            "supported; the KV cache holds 8-bit floats (fp8) or integers (int8)"
        )
    if not scheme.get("symmetric", True):
        raise UnsupportedModelError("kv_cache_scheme with symmetric=false (a zero point) is not supported")
    if scheme.get("strategy", "tensor") not in ("tensor", "attn_head"):
        raise UnsupportedModelError(
            f"kv_cache_scheme strategy {scheme.get('strategy')!r} is not supported; 'tensor' (a scale per "
            "layer) and 'attn_head' (a scale per layer and KV head) are"
        )
    return kind


def _refuse_unsupported_fields(hf: dict[str, Any]) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only 'silu')")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    if hf.get("pretraining_tp", 1) != 1:
        raise UnsupportedModelError(f"pretraining_tp={hf['pretraining_tp']} is not supported (only 1)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={hf['partial_rotary_factor']} is not supported")
    quant = hf.get("quantization_config")
    # Those read by jaxserve.weights.compressed_tensors, gptq_awq and fp8_block, which check the rest.
    if quant and quant.get("quant_method") not in ("compressed-tensors", "gptq", "awq", "fp8"):
        raise UnsupportedModelError(
            f"quantization_config (quant_method={quant.get('quant_method')!r}) is not supported; use a "
            "compressed-tensors, GPTQ or AWQ checkpoint, an unquantized one (--quantization int4|int8|fp8) "
            "or a GGUF file"
        )
    layer_types = hf.get("layer_types")
    if layer_types and len(set(layer_types)) > 1:
        raise UnsupportedModelError(
            f"layer_types mixes {sorted(set(layer_types))}; per-layer attention types are not supported"
        )
    if hf.get("use_sliding_window") and 0 < hf.get("max_window_layers", 0) < hf["num_hidden_layers"]:
        raise UnsupportedModelError(
            f"max_window_layers={hf['max_window_layers']} (sliding window on some layers only) is not supported"
        )


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    # Older configs say rope_theta + rope_scaling; transformers 5 writes rope_parameters.
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    return params


def _rope_theta(hf: dict[str, Any]) -> float:
    return float(_rope_params(hf).get("rope_theta", hf.get("rope_theta", 10000.0)))


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling | None:
    p = _rope_params(hf)
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling("linear", float(p["factor"]))
    return RopeScaling(
        "llama3",
        float(p["factor"]),
        float(p.get("low_freq_factor", 1.0)),
        float(p.get("high_freq_factor", 4.0)),
        int(p.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(hf: dict[str, Any], arch: str) -> int | None:
    window = hf.get("sliding_window")
    if window is None or arch == "LlamaForCausalLM":
        return None
    if arch.startswith("Qwen"):
        # Qwen slides only when asked to, and only from layer max_window_layers on.
        if not hf.get("use_sliding_window") or hf.get("max_window_layers", 0) >= hf["num_hidden_layers"]:
            return None
    return int(window)
