"""A cache entry on disk: a converted model saved with orbax, restored (straight into its
shards on a mesh), or a variant derived from a lossless entry (jaxserve.weights.derive).
Where entries live and which are evicted: jaxserve.weights.cache."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder import DecoderLM, unstack_layers
from jaxserve.model.quantization import QuantConfig
from jaxserve.parallel.sharding import (
    is_kv_projection,
    kv_heads_for,
    param_shardings,
    place_from_host,
    replicate_kv_heads,
    tensor_parallel_size,
)
from jaxserve.weights import derive
from jaxserve.weights.cache import write_meta
from jaxserve.weights.params import build_model, flatten_tree, place_params

logger = logging.getLogger(__name__)


class Restored(NamedTuple):
    hf_config: dict
    config: ModelConfig
    model: DecoderLM
    tokenizer_dir: Path | None  # the saved tokenizer, if the model has one


def save(entry: Path, params: dict, tokenizer, hf_config: dict, meta: dict) -> None:
    """Write a converted model (host arrays) as `entry`, whole or not at all."""
    import orbax.checkpoint as ocp

    # NOTE: a temporary folder of this process's own: several processes may convert the same
    # weights at once (servers starting side by side); the first rename wins, the rest drop theirs.
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".", suffix=".tmp", dir=entry.parent))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp.resolve() / "params", params)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
    with open(tmp / "config.json", "w") as f:
        json.dump(hf_config, f)
    write_meta(tmp, **meta)
    (tmp / "complete").write_text(meta["source"])
    # NOTE: what is already there goes aside first: an entry that could not be restored (damaged),
    # or a complete one another process just wrote (the same weights, so either may win).
    old = tmp.with_name(tmp.name.removesuffix(".tmp") + ".old.tmp")
    try:
        entry.rename(old)
    except OSError:
        pass  # nothing there (or another process moved it)
    try:
        tmp.rename(entry)
    except OSError:
        if not (entry / "complete").exists():
            raise
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)


def restore(entry: Path, dtype, quant: QuantConfig | None, mesh, expert_parallel: bool = False) -> Restored:
    """The converted weights from the cache; on a mesh each restored straight into its shards
    (K/V projections whose heads must be repeated come to the host first, are repeated there,
    then placed)."""
    import orbax.checkpoint as ocp

    hf_config, config = _entry_config(entry)
    graphdef, state, shapes = _abstract_model(config, dtype, quant)
    if mesh is None:
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shapes)
    else:
        repeat = kv_heads_for(config, tensor_parallel_size(mesh)) != config.num_kv_heads

        def restored_as(path, x, sharding):
            if repeat and is_kv_projection(path):
                return np.empty(x.shape, x.dtype)  # to the host, repeated there before placing
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        target = jax.tree.map_with_path(restored_as, shapes, param_shardings(shapes, mesh, expert_parallel))
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(entry.resolve() / "params", target)
    if mesh is not None and repeat:
        params = replicate_kv_heads(params, config, tensor_parallel_size(mesh))
        params = jax.tree.map(
            lambda x, s: place_from_host(x, s) if isinstance(x, np.ndarray) else x,
            params,
            param_shardings(params, mesh, expert_parallel),
        )
    return Restored(hf_config, config, build_model(graphdef, state, params), _tokenizer_dir(entry))


def derive_from(base: Path, dtype, quant: QuantConfig | None, mesh, expert_parallel: bool = False) -> Restored:
    """The variant computed on the host from `base`, a lossless unquantized entry of the same
    checkpoint (jaxserve.weights.derive), then placed as a conversion's result is."""
    import orbax.checkpoint as ocp

    hf_config, config = _entry_config(base)
    base_dtype = jnp.dtype(json.loads((base / "meta.json").read_text())["dtype"])
    _, _, base_shapes = _abstract_model(config, base_dtype, None)
    with ocp.StandardCheckpointer() as ckpt:
        host = ckpt.restore(base.resolve() / "params", jax.tree.map(lambda x: np.empty(x.shape, x.dtype), base_shapes))
    graphdef, state, shapes = _abstract_model(config, dtype, quant)
    host = derive.derive_params(host, dict(flatten_tree(shapes)), quant)
    logger.info("weights: %s derived from the cached %s copy", quant.label if quant else dtype, base_dtype)
    model = place_params(graphdef, state, host, config, mesh, expert_parallel)
    return Restored(hf_config, config, model, _tokenizer_dir(base))


def _entry_config(entry: Path) -> tuple[dict, ModelConfig]:
    with open(entry / "config.json") as f:
        hf_config = json.load(f)
    return hf_config, ModelConfig.from_hf_dict(hf_config)


def _abstract_model(config: ModelConfig, dtype, quant: QuantConfig | None):
    """(graphdef, abstract state, shapes as a nested dict) of the unstacked model, nothing allocated."""
    abstract = nnx.eval_shape(
        lambda: unstack_layers(DecoderLM(config, dtype=dtype, rngs=nnx.Rngs(0), quantization=quant))
    )
    graphdef, state = nnx.split(abstract)
    return graphdef, state, nnx.to_pure_dict(state)


def _tokenizer_dir(entry: Path) -> Path | None:
    return entry / "tokenizer" if (entry / "tokenizer").is_dir() else None
