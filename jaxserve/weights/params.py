"""Assembling Hugging Face-named tensors into the model's stacked parameter tree."""

from __future__ import annotations

import re
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model import DecoderLM

_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# Tensors some checkpoints carry that the model derives itself.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")


class WeightError(ValueError):
    """A checkpoint that does not fit its config: a missing, unknown or misshapen tensor."""


def param_path(name: str, cfg: ModelConfig) -> tuple[tuple[str, ...], int | None, bool] | None:
    """(path in the parameter tree, layer index or None, transpose?) for a HF tensor name.

    None for tensors the model does not use (a tied lm_head, rotary buffers).
    """
    if _IGNORED.search(name):
        return None
    if name == "model.embed_tokens.weight":
        return ("embed_tokens", "embedding"), None, False
    if name == "model.norm.weight":
        return ("norm", "weight"), None, False
    if name == "lm_head.weight":
        return (None if cfg.tie_word_embeddings else (("lm_head", "kernel"), None, True))
    m = _LAYER.match(name)
    if not m:
        raise WeightError(f"unknown tensor {name!r} in checkpoint for {cfg.architecture}")
    layer, module, kind = int(m.group(1)), m.group(2).split("."), m.group(3)
    if layer >= cfg.num_layers:
        raise WeightError(f"tensor {name!r} is past num_hidden_layers={cfg.num_layers}")
    is_linear = module[-1] in _LINEARS
    leaf = "kernel" if (is_linear and kind == "weight") else kind
    return ("layers", *module, leaf), layer, is_linear and kind == "weight"


class ParamAssembler:
    """Collects tensors one at a time into host buffers shaped like the model's params."""

    def __init__(self, cfg: ModelConfig, dtype):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        abstract = nnx.eval_shape(lambda: DecoderLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
        self.graphdef, state = nnx.split(abstract)
        self.shapes = {path: leaf.shape for path, leaf in _flatten(nnx.to_pure_dict(state))}
        self.state = state
        self.buffers: dict[tuple[str, ...], np.ndarray] = {}
        self.filled: set[tuple[tuple[str, ...], int | None]] = set()

    def add(self, name: str, tensor: np.ndarray) -> None:
        where = param_path(name, self.cfg)
        if where is None:
            return
        path, layer, transpose = where
        if path not in self.shapes:
            raise WeightError(f"tensor {name!r} has no place in {self.cfg.architecture} with this config")
        value = tensor.T if transpose else tensor
        full = self.shapes[path]
        want = full[1:] if layer is not None else full
        if tuple(value.shape) != tuple(want):
            got = tuple(tensor.shape)
            raise WeightError(f"tensor {name!r} has shape {got}, but the config implies {tuple(want[::-1]) if transpose else tuple(want)}")
        buf = self.buffers.get(path)
        if buf is None:
            buf = self.buffers[path] = np.empty(full, np.float32)
        if layer is None:
            buf[...] = value
        else:
            buf[layer] = value
        self.filled.add((path, layer))

    def build(self) -> DecoderLM:
        """The model with every parameter on the device; raises if any tensor is missing."""
        missing = []
        for path, shape in self.shapes.items():
            layers = range(self.cfg.num_layers) if path[0] == "layers" else [None]
            missing += [_hf_name(path, i) for i in layers if (path, i) not in self.filled]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise WeightError(f"checkpoint is missing {', '.join(missing[:5])}{more}")
        pure = _unflatten({p: jnp.asarray(b, self.dtype) for p, b in self.buffers.items()})
        self.buffers.clear()
        return build_model(self.graphdef, self.state, pure)


def build_model(graphdef, state, pure_params: dict) -> DecoderLM:
    nnx.replace_by_pure_dict(state, pure_params)
    return nnx.merge(graphdef, state)


def model_params(model: DecoderLM) -> dict:
    """The parameters as a plain nested dict of arrays (what the orbax cache stores)."""
    return nnx.to_pure_dict(nnx.state(model))


def _hf_name(path: tuple[str, ...], layer: int | None) -> str:
    if path == ("embed_tokens", "embedding"):
        return "model.embed_tokens.weight"
    if path == ("lm_head", "kernel"):
        return "lm_head.weight"
    leaf = "weight" if path[-1] in ("kernel", "weight") else path[-1]
    inner = ".".join(path[1:-1])
    return f"model.layers.{layer}.{inner}.{leaf}" if layer is not None else f"model.{'.'.join(path[:-1])}.{leaf}"


def _flatten(tree: dict, prefix=()) -> Iterable[tuple[tuple[str, ...], jax.ShapeDtypeStruct]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _unflatten(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree
