"""Checkpoints saved in the compressed-tensors format (llm-compressor's, what vLLM loads).

Two of its schemes map exactly onto the layouts of `QuantizedLinear` (see
`pallas_kernels.quantized_matmul`; HF stores weights [N, K], we hold them [K, N]):

    pack-quantized    int4 weights per group along K, symmetric or with zero points:
                      w = scale * (q - zp), q and zp signed, each stored as the unsigned
                      nibble q + 8, eight to an int32 word, lowest nibble first. Viewed as
                      bytes that is our nibble order, so packed = bytes.T, and
                      w = scale * nibble + offset with offset = -scale * (zp + 8).
    float-quantized   e4m3 weights with a scale per output channel or per tensor -> fp8.
                      Activations are always quantized per token on the fly, so a static
                      `input_scale` is read past.

In a mixture of experts each expert's projections are quantized tensors of their own
(`mlp.experts.{e}.gate_proj.weight_packed`, Mixtral's `block_sparse_moe.experts.{e}.w1`),
stacked by weights.params as they arrive; the router (`mlp.gate`) and Qwen2-MoE's
`shared_expert_gate` stay float (real checkpoints list them in `ignore`).

Everything else is refused by name: other `quant_method`s (GPTQ and AWQ are `gptq_awq`'s), other formats
and schemes (int8, nvfp4, channel-wise int4, ...), mixed schemes, and checkpoints that
leave some attention, MLP or expert projection unquantized (our layers are all or nothing).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.model.quantization import QuantConfig, QuantizedWeight
from jaxserve.weights.params import WeightError
from jaxserve.weights.safetensors_reader import read_raw_tensors

logger = logging.getLogger(__name__)

SUPPORTED = (
    "jaxserve loads compressed-tensors checkpoints (pack-quantized int4, float-quantized fp8), "
    "GPTQ and AWQ int4 checkpoints, block-wise FP8 checkpoints, or quantizes float checkpoints itself "
    "(--quantization int4|int8|fp8)"
)
_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROJECTION_MODULE = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj"
    r"|mlp\.(shared_expert\.|experts\.\d+\.)?(gate|up|down)_proj"  # dense MLP, Qwen MoE experts
    r"|block_sparse_moe\.experts\.\d+\.w[123])$"  # Mixtral's experts
)
# Per-module tensors of compressed-tensors quantization: a projection's must be ours to read;
# anywhere else they mean a module we keep in float is quantized.
_QPARAMS = {
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_g_idx",
    "weight_global_scale",
    "input_scale",
    "input_zero_point",
    "input_global_scale",
}
_UNUSED = {"input_scale", "input_zero_point"}  # activations are quantized per token at run time
_Q_SCALE = "q_scale"  # attention's query quantization: not done here (k_scale, v_scale: ModelConfig.kv_scales)


@dataclasses.dataclass(frozen=True)
class _Scheme:
    """One config group's weights, as far as loading them is concerned."""

    quant: QuantConfig
    zero_points: bool = False  # int4 asymmetric: a packed weight_zero_point per group
    activations: str = "dynamic"  # fp8: "dynamic", "static" (an input_scale we ignore) or "none"

    @property
    def pieces(self) -> frozenset[str]:
        """The tensors each quantized projection stores (besides its bias)."""
        if self.quant.kind == "fp8":
            return frozenset({"weight", "weight_scale"})
        int4 = {"weight_packed", "weight_scale", "weight_shape"}
        return frozenset(int4 | {"weight_zero_point"} if self.zero_points else int4)


def checkpoint_quant_config(spec: dict, hf_config: dict | None = None) -> QuantConfig:
    """The QuantConfig of a config.json's `quantization_config`; refuses other methods,
    formats and schemes by name. `hf_config`: the whole config.json, to check that the
    targets cover the model's own projections (None: a dense model's)."""
    scheme = _parse(spec, hf_config)
    if scheme.activations == "static":
        logger.info(
            "compressed-tensors: the checkpoint's static input_scale is ignored; "
            "activations are quantized per token on the fly"
        )
    elif scheme.activations == "none" and scheme.quant.kind == "fp8":
        logger.info("compressed-tensors: fp8 weight-only checkpoint; activations are still quantized per token (W8A8)")
    return scheme.quant


def read_tensors(
    files: list[Path], spec: dict, hf_config: dict | None = None
) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
    """(Hugging Face name, tensor) for a compressed-tensors checkpoint: one QuantizedWeight
    per projection (named `....q_proj.weight`), float32 arrays for everything else.

    A projection's pieces are held only until the last of them arrives (tensors come in
    name order within a shard, so that is normally the next few tensors)."""
    scheme = _parse(spec, hf_config)
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in read_raw_tensors(files):
        module, _, leaf = name.rpartition(".")
        if leaf == _Q_SCALE or (leaf in _UNUSED and PROJECTION_MODULE.match(module)):
            continue
        if PROJECTION_MODULE.match(module) and leaf != "bias":
            if leaf not in scheme.pieces:
                raise _unexpected_piece(name, leaf, scheme)
            pieces = pending.setdefault(module, {})
            pieces[leaf] = tensor
            if pieces.keys() == scheme.pieces:
                del pending[module]
                yield f"{module}.weight", _convert(module, pieces, scheme.quant)
        elif leaf in _QPARAMS:
            raise WeightError(
                f"tensor {name!r}: {module} is quantized in this checkpoint, but jaxserve quantizes "
                "only the attention, MLP and expert projections (the rest, a MoE router included, "
                "stays in the model dtype)"
            )
        else:
            yield name, np.asarray(tensor, np.float32)
    for module, pieces in pending.items():
        if pieces.keys() == {"weight"}:
            raise _unquantized(module, scheme)
        raise WeightError(
            f"quantized module {module} is incomplete: it has {', '.join(sorted(pieces))} "
            f"but no {', '.join(sorted(scheme.pieces - pieces.keys()))}"
        )


# -- quantization_config ------------------------------------------------------------------


def _parse(spec: dict, hf_config: dict | None) -> _Scheme:
    """The one scheme every config group uses, checked to cover every projection."""
    method = spec.get("quant_method")
    if method != "compressed-tensors":
        raise WeightError(f"quantization_config.quant_method {method!r} is not supported; {SUPPORTED}")
    if (spec.get("sparsity_config") or {}).get("format", "dense") != "dense":
        raise WeightError(
            f"compressed-tensors sparsity ({spec['sparsity_config']['format']}) is not supported; {SUPPORTED}"
        )
    if spec.get("transform_config"):
        raise WeightError(
            "compressed-tensors transforms (rotations applied at run time) are not supported; " + SUPPORTED
        )
    groups = spec.get("config_groups") or {}
    if not groups:
        raise WeightError("compressed-tensors quantization_config has no config_groups")
    schemes = {name: _group_scheme(name, group, spec.get("format")) for name, group in groups.items()}
    if len(set(schemes.values())) > 1:
        described = "; ".join(f"{name}: {s.quant.label}" for name, s in schemes.items())
        raise WeightError(
            f"compressed-tensors config_groups use different schemes ({described}); "
            "jaxserve needs one scheme for every projection"
        )
    targets = [t for g in groups.values() for t in g.get("targets") or []]
    # NOTE: the model config is read only now: it refuses other quantization methods less clearly
    config = ModelConfig.from_hf_dict(hf_config) if hf_config is not None else None
    tied = config is not None and config.tie_word_embeddings  # no lm_head module of its own to quantize
    _check_coverage(targets, spec.get("ignore") or [], _projections(config), check_lm_head=not tied)
    return next(iter(schemes.values()))


def _group_scheme(name: str, group, default_format: str | None) -> _Scheme:
    """The _Scheme of one config group, or a WeightError naming what it is."""
    if not isinstance(group, dict):  # {"W4A16": ["Linear"]}: a recipe's shorthand, not a saved config
        raise WeightError(f"compressed-tensors config group {name!r} is a preset name, not a saved scheme")
    fmt = group.get("format") or default_format
    weights, acts = group.get("weights"), group.get("input_activations")
    if weights is None:
        raise WeightError(f"compressed-tensors config group {name!r} quantizes no weights; {SUPPORTED}")
    wtype, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    what = (
        f"format {fmt!r} with {wtype}{bits} weights (strategy {strategy!r}"
        + (f", group {weights.get('group_size')}" if strategy == "group" else "")
        + ") and "
        + (f"{acts.get('type')}{acts.get('num_bits')} activations" if acts else "float activations")
    )
    refused = WeightError(f"compressed-tensors config group {name!r}: {what} is not supported; {SUPPORTED}")
    if group.get("output_activations") or weights.get("dynamic"):
        raise refused
    if fmt == "pack-quantized" and (wtype, bits, strategy) == ("int", 4, "group") and acts is None:
        group_size = weights.get("group_size")
        if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
            raise refused
        if weights.get("actorder") == "group":  # a weight_g_idx permutes the groups along K
            raise WeightError(
                f"compressed-tensors config group {name!r}: int4 with actorder 'group' "
                f"(weight_g_idx) is not supported; {SUPPORTED}"
            )
        asymmetric = not weights.get("symmetric", True)
        return _Scheme(QuantConfig("compressed-tensors", "int4", group_size), zero_points=asymmetric)
    # naive-quantized stores float8 weights exactly as float-quantized does
    fp8_weights = fmt in ("float-quantized", "naive-quantized") and (wtype, bits) == ("float", 8)
    if fp8_weights and strategy in ("channel", "tensor"):
        if acts is None:
            return _Scheme(QuantConfig("compressed-tensors", "fp8"), activations="none")
        if (acts.get("type"), acts.get("num_bits")) == ("float", 8):
            static = not acts.get("dynamic")
            return _Scheme(QuantConfig("compressed-tensors", "fp8"), activations="static" if static else "dynamic")
    raise refused


def _projections(config: ModelConfig | None) -> list[tuple[int, str]]:
    """(layer, module) of each kind of projection the model has, in the first layer of each
    kind: attention, then the dense MLP and / or expert 0's and the shared expert's."""
    if config is None or not config.is_moe:
        return [(0, p) for p in _ATTENTION + _MLP]
    out = [(0, p) for p in _ATTENTION]
    moe_layer = next((i for i in range(config.num_layers) if config.is_moe_layer(i)), None)
    if moe_layer is not None:
        if config.architecture == "MixtralForCausalLM":
            out += [(moe_layer, f"block_sparse_moe.experts.0.{w}") for w in ("w1", "w2", "w3")]
        else:
            out += [(moe_layer, f"mlp.experts.0.{p.split('.')[1]}") for p in _MLP]
        if config.shared_expert_intermediate_size:
            out += [(moe_layer, f"mlp.shared_expert.{p.split('.')[1]}") for p in _MLP]
    if config.dense_mlp_layers:
        out += [(config.dense_mlp_layers[0], p) for p in _MLP]
    return out


def _check_coverage(
    targets: list[str], ignore: list[str], projections: list[tuple[int, str]], *, check_lm_head: bool = True
) -> None:
    """Refuse a config that leaves a projection in float or quantizes the LM head (judged
    on the first layer of each kind; read_tensors catches any other layer left out)."""
    for layer, projection in projections:
        name = f"model.layers.{layer}.{projection}"
        if not any(_matches(name, t) for t in targets):
            raise WeightError(
                f"compressed-tensors targets {targets} leave {projection} unquantized; jaxserve "
                "does not load partly quantized models (every attention and MLP projection or none)"
            )
        hit = [i for i in ignore if _matches(name, i) or (not i.startswith("re:") and i.endswith("." + projection))]
        if hit:
            raise WeightError(
                f"compressed-tensors ignore entry {hit[0]!r} leaves {projection} unquantized; jaxserve "
                "does not load partly quantized models (every attention and MLP projection or none)"
            )
    if (
        check_lm_head
        and any(_matches("lm_head", t) for t in targets)
        and not any(_matches("lm_head", i) for i in ignore)
    ):
        raise WeightError(
            "this compressed-tensors checkpoint quantizes lm_head; jaxserve keeps the LM head in the model dtype"
        )


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' matching of a Linear module: its class name, its exact name, or
    a "re:" pattern matched from the start of the name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in ("Linear", name)


def _unexpected_piece(name: str, leaf: str, scheme: _Scheme) -> WeightError:
    if leaf == "weight":  # an int4 checkpoint with a float projection
        return _unquantized(name.rpartition(".")[0], scheme)
    if leaf == "weight_g_idx":
        return WeightError(f"tensor {name!r}: int4 with activation-order group indices is not supported; {SUPPORTED}")
    return WeightError(
        f"unexpected tensor {name!r} in a {scheme.quant.label} checkpoint "
        f"(a quantized projection stores {', '.join(sorted(scheme.pieces))})"
    )


def _unquantized(module: str, scheme: _Scheme) -> WeightError:
    return WeightError(
        f"{module} is stored unquantized in a {scheme.quant.label} checkpoint; jaxserve does not "
        "load partly quantized models (check the quantization_config ignore list)"
    )


# -- one projection -----------------------------------------------------------------------


def _convert(module: str, pieces: dict[str, np.ndarray], quant: QuantConfig) -> QuantizedWeight:
    return _convert_int4(module, pieces, quant.group_size) if quant.kind == "int4" else _convert_fp8(module, pieces)


def _convert_int4(module: str, pieces: dict[str, np.ndarray], group: int) -> QuantizedWeight:
    """pack-quantized pieces -> our packed [K/2, N], scales and offsets [K/group, N]."""
    n, k = (int(x) for x in np.asarray(pieces["weight_shape"]).reshape(-1))
    if k % 2 or k % group:
        raise WeightError(
            f"{module}: K={k} is not a multiple of the int4 group size {group} in quantization_config "
            "(int4 also needs an even K)"
        )
    packed, scale = pieces["weight_packed"], pieces["weight_scale"]
    words = -(-k // 8)
    if packed.dtype != np.int32 or packed.shape != (n, words):
        raise WeightError(
            f"{module}.weight_packed is {packed.dtype} {packed.shape}, expected int32 {(n, words)} "
            f"for weight_shape {(n, k)}"
        )
    if scale.shape != (n, k // group):
        raise WeightError(
            f"{module}.weight_scale has shape {scale.shape}, expected {(n, k // group)} for group size {group}"
        )
    # The int32 words' little-endian bytes hold k = 2j in the low nibble of byte j and
    # 2j + 1 in the high one: our packing, along the other axis.
    nibble_bytes = packed.view(np.uint8)[:, : k // 2]  # [N, K/2]
    scale = scale.astype(np.float32)  # [N, K/group]
    zero = _stored_zero_points(module, pieces.get("weight_zero_point"), scale.shape)
    offsets = -scale * zero  # scale * (nibble - 8 - zp), zp stored as zp + 8
    params = {
        "packed": np.ascontiguousarray(nibble_bytes.T),
        "scales": np.ascontiguousarray(scale.T),
        "offsets": np.ascontiguousarray(offsets.T),
    }
    return QuantizedWeight("int4", params, (n, k))


def _stored_zero_points(module: str, zp: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray | float:
    """Zero points + 8 as float32 [N, groups] (8 when symmetric). Packed int32 [N/8, groups]
    (nibbles along N, as the weights are along K); older checkpoints stored int8 [N, groups]."""
    n, groups = shape
    if zp is None:
        return np.float32(8)
    if zp.dtype == np.int8 and zp.shape == shape:
        return zp.astype(np.float32) + 8
    if zp.dtype != np.int32 or zp.shape != (-(-n // 8), groups):
        raise WeightError(f"{module}.weight_zero_point is {zp.dtype} {zp.shape}, expected int32 {(-(-n // 8), groups)}")
    nibble_bytes = np.ascontiguousarray(zp.T).view(np.uint8)  # [groups, N/2]
    nibbles = np.stack([nibble_bytes & 0xF, nibble_bytes >> 4], axis=-1).reshape(groups, -1)[:, :n]
    return nibbles.T.astype(np.float32)


def _convert_fp8(module: str, pieces: dict[str, np.ndarray]) -> QuantizedWeight:
    """float-quantized pieces -> our weight [K, N] e4m3 and per-channel scales [N]."""
    weight, scale = pieces["weight"], pieces["weight_scale"].astype(np.float32).reshape(-1)
    if weight.dtype != ml_dtypes.float8_e4m3fn or weight.ndim != 2:
        raise WeightError(f"{module}.weight is {weight.dtype} {weight.shape}, expected a 2-D float8_e4m3fn tensor")
    n, k = weight.shape
    if scale.size not in (1, n):
        raise WeightError(
            f"{module}.weight_scale has {scale.size} values, expected 1 (per tensor) or {n} (per channel)"
        )
    scales = np.broadcast_to(scale, (n,)).astype(np.float32)  # a per-tensor scale is every channel's
    return QuantizedWeight("fp8", {"weight": np.ascontiguousarray(weight.T), "scales": scales}, (n, k))
