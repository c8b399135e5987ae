"""Assembling Hugging Face-named tensors into the model's parameter tree."""

from __future__ import annotations

import re
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder import DecoderLM, unstack_layers
from jaxserve.model.quantization import QuantConfig, QuantizedWeight, quantize
from jaxserve.parallel.sharding import param_shardings, place_from_host, replicate_kv_heads, tensor_parallel_size

_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate", "shared_expert_gate"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias|k_scale|v_scale)$")
_KV_SCALES = ("k_scale", "v_scale")  # an attention layer's calibrated KV-cache scales (ModelConfig.kv_scales)
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(\w+)$")  # one expert's projection, stacked on [E]
# Mixtral's names for the same modules.
_MIXTRAL = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Tensors some checkpoints carry that the model derives itself.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


class WeightError(ValueError):
    """A checkpoint that does not fit its config: a missing, unknown or misshapen tensor."""


def param_path(name: str, cfg: ModelConfig) -> tuple[tuple[str, ...], int | None, bool] | None:
    """(path in the parameter tree, layer index or None, transpose?) for a HF tensor name.

    None for tensors the model does not use (a tied lm_head, rotary buffers). An expert's
    projection (`mlp.experts.{e}.gate_proj`) maps to the stacked one with the expert index
    after `experts` in the path: ("layers", "mlp", "experts", e, "gate_proj", "kernel").
    """
    if _IGNORED.search(name):
        return None
    if name == "model.embed_tokens.weight":
        return ("embed_tokens", "embedding"), None, False
    if name == "model.norm.weight":
        return ("norm", "weight"), None, False
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else (("lm_head", "kernel"), None, True)
    m = _LAYER.match(name)
    if not m:
        raise WeightError(f"unknown tensor {name!r} in checkpoint for {cfg.architecture}")
    layer, module, kind = int(m.group(1)), m.group(2), m.group(3)
    if cfg.architecture == "MixtralForCausalLM":
        module = ".".join(_MIXTRAL.get(part, part) for part in module.split("."))
    module = module.split(".")
    if layer >= cfg.num_layers:
        raise WeightError(f"tensor {name!r} is past num_hidden_layers={cfg.num_layers}")
    is_linear = module[-1] in _LINEARS
    leaf = "kernel" if (is_linear and kind == "weight") else kind
    if (e := _EXPERT.match(".".join(module))) and e.group(2) in _LINEARS:
        expert = int(e.group(1))
        if expert >= cfg.num_experts:
            raise WeightError(f"tensor {name!r} is past num_experts={cfg.num_experts}")
        module = ["mlp", "experts", expert, e.group(2)]
    return ("layers", *module, leaf), layer, is_linear and kind == "weight"


class ParamAssembler:
    """Collects tensors one at a time into the parameters of an (unstacked) model.

    Each tensor is converted as it arrives, to the model dtype or, for the projections of
    a quantized model, to its quantized parameters; so the host holds the converted model
    plus one float tensor, never a float copy of the whole checkpoint.
    """

    def __init__(self, cfg: ModelConfig, dtype, quantization: QuantConfig | None = None):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.quant = quantization
        abstract = nnx.eval_shape(
            lambda: unstack_layers(DecoderLM(cfg, dtype=dtype, rngs=nnx.Rngs(0), quantization=quantization))
        )
        self.graphdef, state = nnx.split(abstract)
        self.specs = dict(flatten_tree(nnx.to_pure_dict(state)))
        self.state = state
        self.params: dict[tuple, np.ndarray] = {}
        self._expert_rows: dict[tuple, set[int]] = {}  # stacked expert parameters: the experts that arrived

    def add(self, name: str, tensor: np.ndarray | QuantizedWeight) -> None:
        where = param_path(name, self.cfg)
        if where is None:
            return
        path, layer, transpose = where
        if layer is not None:
            path = (path[0], layer, *path[1:])
        expert = None
        if "experts" in path and isinstance(path[path.index("experts") + 1], int):  # one row of a stacked [E, ...]
            at = path.index("experts") + 1
            expert, path = path[at], path[:at] + path[at + 1 :]
        module = path[:-1]
        if self.quant is not None and transpose and module + ("kernel",) not in self.specs:  # a quantized projection
            self._add_quantized(name, module, tensor, expert)
            return
        if isinstance(tensor, QuantizedWeight):
            raise WeightError(f"tensor {name!r} is quantized, but its layer is not a quantized projection here")
        if path not in self.specs:
            raise WeightError(f"tensor {name!r} has no place in {self.cfg.architecture} with this config")
        value = tensor.T if transpose else tensor
        want = self.specs[path].shape[0 if expert is None else 1 :]
        if path[-1] in _KV_SCALES and np.size(value) in (1, self.cfg.num_kv_heads):
            # one per layer (strategy "tensor": [1]) or per KV head ("attn_head": [KV, 1, 1])
            value = np.broadcast_to(np.reshape(value, -1), want)
        if tuple(value.shape) != tuple(want):
            got, implied = tuple(tensor.shape), tuple(want[::-1]) if transpose else tuple(want)
            raise WeightError(f"tensor {name!r} has shape {got}, but the config implies {implied}")
        self._store(path, np.asarray(value, self.specs[path].dtype), expert)

    def _add_quantized(
        self, name: str, module: tuple, tensor: np.ndarray | QuantizedWeight, expert: int | None
    ) -> None:
        quant = self.quant.at(".".join(map(str, module)))  # a GGUF's layers may mix int4 and int8
        kind = quant.kind
        k, n = self.specs[module + (("packed",) if kind == "int4" else ("weight",))].shape[-2:]
        if kind == "int4":
            k *= 2
        if isinstance(tensor, QuantizedWeight):
            if tensor.kind != kind:
                raise WeightError(f"tensor {name!r} is {tensor.kind}, but this model quantizes it as {kind}")
            got, pieces = tuple(tensor.shape), tensor.params
        else:
            got = tuple(tensor.shape)
            pieces = quantize(tensor.T, quant) if got == (n, k) else {}
        if got != (n, k):
            raise WeightError(f"tensor {name!r} has shape {got}, but the config implies {(n, k)}")
        for leaf, value in pieces.items():
            spec = self.specs.get(module + (leaf,))
            want = None if spec is None else (tuple(spec.shape[0 if expert is None else 1 :]), str(spec.dtype))
            if want != (tuple(value.shape), str(value.dtype)):
                raise WeightError(
                    f"quantized tensor {name!r}: {leaf} is {(tuple(value.shape), str(value.dtype))}, "
                    f"expected {want} (a different group size?)"
                )
            self._store(module + (leaf,), value, expert)

    def _store(self, path: tuple, value: np.ndarray, expert: int | None) -> None:
        """A whole parameter, or one expert's row of a stacked one (allocated when its first
        expert arrives; host_params checks that every row came)."""
        if expert is None:
            self.params[path] = value
            return
        if path not in self.params:
            spec = self.specs[path]
            self.params[path] = np.zeros(spec.shape, spec.dtype)
            self._expert_rows[path] = set()
        self.params[path][expert] = value
        self._expert_rows[path].add(expert)

    def host_params(self) -> dict:
        """The converted parameters, still on the host, as a nested dict (what the orbax cache
        stores); raises if any tensor is missing."""
        missing = [_hf_name(path) for path in self.specs if path not in self.params]
        for path, rows in self._expert_rows.items():
            missing += [_hf_name(path, e) for e in range(self.specs[path].shape[0]) if e not in rows]
        if self.cfg.architecture == "MixtralForCausalLM":  # as its checkpoints name them
            missing = [_mixtral_name(name) for name in missing]
        missing = list(dict.fromkeys(missing))
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise WeightError(f"checkpoint is missing {', '.join(missing[:5])}{more}")
        return unflatten_tree({path: self.params[path] for path in self.specs})

    def build(self, mesh: jax.sharding.Mesh | None = None, expert_parallel: bool = False) -> DecoderLM:
        """The model with every parameter on the device (on `mesh`: each split across its
        devices as jaxserve.parallel.sharding says); raises if any tensor is missing."""
        return place_params(self.graphdef, self.state, self.take_host_params(), self.cfg, mesh, expert_parallel)

    def take_host_params(self) -> dict:
        """`host_params()`, handed over: the assembler keeps no reference, so whoever places
        them can free each array as it goes."""
        host, self.params, self._expert_rows = self.host_params(), {}, {}
        return host


def place_params(
    graphdef, state, host: dict, cfg: ModelConfig, mesh: jax.sharding.Mesh | None, expert_parallel: bool = False
) -> DecoderLM:
    """The model over `host` (a nested dict of NumPy arrays), moved to the device one array at
    a time, so host memory never holds two copies. On a mesh each array goes straight into its
    shards (K/V heads repeated here on the host first when there are fewer than devices): no
    device ever holds a whole split parameter (`expert_parallel`: experts split whole, on E)."""
    shardings = None
    if mesh is not None:
        host = replicate_kv_heads(host, cfg, tensor_parallel_size(mesh))
        shardings = dict(flatten_tree(param_shardings(host, mesh, expert_parallel)))
    flat = dict(flatten_tree(host))
    del host  # each array is dropped from the host as it is placed
    placed = {}
    for path in list(flat):
        value = flat.pop(path)
        placed[path] = jnp.asarray(value) if shardings is None else place_from_host(value, shardings[path])
    return build_model(graphdef, state, unflatten_tree(placed))


def build_model(graphdef, state, pure_params: dict) -> DecoderLM:
    nnx.replace_by_pure_dict(state, pure_params)
    return nnx.merge(graphdef, state)


def model_params(model: DecoderLM) -> dict:
    """The parameters as a plain nested dict of arrays (what the orbax cache stores)."""
    return nnx.to_pure_dict(nnx.state(model))


def _hf_name(path: tuple, expert: int | None = None) -> str:
    """The Hugging Face name of the tensor a parameter comes from (quantized pieces: their
    weight; a stacked expert parameter: expert `expert`'s, or "*" for all of them)."""
    if "experts" in path:
        at = path.index("experts") + 1
        path = path[:at] + ("*" if expert is None else str(expert),) + path[at:]
    if path == ("embed_tokens", "embedding"):
        return "model.embed_tokens.weight"
    if path == ("lm_head", "kernel"):
        return "lm_head.weight"
    leaf = path[-1] if path[-1] in ("bias", *_KV_SCALES) else "weight"
    if path[0] == "layers":
        return f"model.layers.{path[1]}.{'.'.join(path[2:-1])}.{leaf}"
    return f"model.{'.'.join(path[:-1])}.{leaf}"


def _mixtral_name(name: str) -> str:
    """Our (Qwen's) name of a MoE tensor in Mixtral's words: `mlp.experts.3.up_proj` is
    `block_sparse_moe.experts.3.w3` (the inverse of _MIXTRAL)."""
    words = {v: k for k, v in _MIXTRAL.items()}
    if ".mlp." not in name:
        return name
    return ".".join(words.get(part, part) for part in name.split("."))


def flatten_tree(tree: dict, prefix=()) -> Iterable[tuple[tuple[str, ...], jax.ShapeDtypeStruct]]:
    """(path, leaf) of a nested dict (a pure parameter dict); `unflatten_tree` inverts it."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flatten_tree(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def unflatten_tree(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree
