"""Find a model, read its weights and tokenizer, and keep a converted copy for next time.

`load_model(None)` is the embedded default model. Other references: a Hugging Face
folder, a `.gguf` file, or a hub id (downloaded when the machine is online). The first
load converts the weights (dequantize, rename, quantize if asked) and saves the result
with orbax under the cache directory (jaxserve.weights.cache: keyed by the files' content,
then by dtype and quantization); the next load of the same content restores that instead, and
a variant that can be computed exactly from a cached float copy is derived from it
(jaxserve.weights.derive) rather than converted and stored again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder import DecoderLM, unstack_layers
from jaxserve.model.quantization import QuantConfig, weight_bytes
from jaxserve.parallel.sharding import (
    is_kv_projection,
    kv_heads_for,
    param_shardings,
    place_from_host,
    replicate_kv_heads,
    tensor_parallel_size,
)
from jaxserve.weights import cache, compressed_tensors, derive, safetensors_reader
from jaxserve.weights.cache import default_cache_dir
from jaxserve.weights.default_model import default_model_path
from jaxserve.weights.gguf_reader import GGUFFile
from jaxserve.weights.gguf_tokenizer import tokenizer_from_gguf
from jaxserve.weights.params import ParamAssembler, _flatten, build_model, place_params

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    model: DecoderLM
    tokenizer: object | None  # a transformers PreTrainedTokenizerBase; None if the folder has none
    source: str
    from_cache: bool
    hf_config: dict  # the config.json (or GGUF metadata) the config was read from
    quantization: QuantConfig | None = None

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.model)


def load_model(
    model: str | None = None,
    *,
    dtype="float32",
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    progress: bool = True,
    quantization: str | None = None,
    tokenizer: str | Path | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> LoadedModel:
    """Load `model` (None: the embedded default) as a `DecoderLM` with its tokenizer.

    `mesh` (jaxserve.parallel.sharding.make_mesh): each parameter is placed straight into its
    shards on the mesh's devices as it is read, never whole on one device (for tensor
    parallelism; K/V heads repeated when the model has fewer than devices). None: one device.

    `quantization` ("int4", "fp8", "gguf"; None: as the checkpoint is) stores the
    attention and MLP projections quantized (see jaxserve.model.quantization). `tokenizer`: a
    folder with a tokenizer.json to use instead of the model's own (weights without one).
    """
    tokenizer_override = load_tokenizer(tokenizer) if tokenizer is not None else None  # fail before the weights
    source = resolve_source(model)
    dtype = jnp.dtype(dtype)
    quant = resolve_quantization(source, quantization)
    cache_root = Path(cache_dir or default_cache_dir())
    if use_cache and jax.distributed.is_initialized():
        # NOTE: orbax saves and restores as a collective of every jax.distributed process and
        # refuses arrays held by one; each node (jaxserve.parallel.multihost) converts on its own.
        logger.info("several nodes: the converted-weight cache is not used")
        use_cache = False
    entry = cache.checkpoint_dir(cache_root, source) / cache.variant_name(dtype, quant) if use_cache else None
    loaded = _from_cache(entry, source, dtype, quant, mesh) if use_cache else None
    if loaded is None:
        loaded = _convert(source, dtype, quant, progress, mesh, entry)
        if entry is not None and (entry / "complete").is_file():
            cache.mark_used(entry)
            for gone in cache.evict_to_fit(cache_root, cache.max_bytes_from_env(), keep=entry):
                logger.info("weight cache over its cap: removed %s/%s", gone.model, gone.variant)
    if tokenizer_override is not None:
        loaded.tokenizer = tokenizer_override
    logger.info(
        "weights: %.1f MiB resident, %s",
        loaded.weight_bytes / 2**20,
        quant.label if quant else f"{dtype} (not quantized)",
    )
    return loaded


def resolve_quantization(source: Path, method: str | None) -> QuantConfig | None:
    """How the model at `source` will be stored: as asked, or as its checkpoint already is
    (a compressed-tensors checkpoint); a clear error when the two disagree."""
    if source.is_file():  # a GGUF file
        return QuantConfig.for_method(method)
    with open(source / "config.json") as f:
        spec = json.load(f).get("quantization_config")
    if method == "gguf":
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's own 4-bit blocks; {source} is not a .gguf file")
    if spec is None:
        return QuantConfig.for_method(method)
    quant = compressed_tensors.checkpoint_quant_config(spec)  # refuses GPTQ, AWQ, ... by name
    if method not in (None, "none", quant.kind):
        raise ValueError(f"{source} is already quantized ({quant.label}); it cannot be loaded as {method!r}")
    return quant


def resolve_source(model: str | None) -> Path:
    """A local `.gguf` file or HF folder for a model reference (downloading a hub id)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return path.resolve()
    if path.exists():
        raise ValueError(f"{path} is neither a .gguf file nor a model folder")
    if not _is_hub_id(model):
        raise FileNotFoundError(f"no model file or folder at {model!r} (and it does not look like a hub id)")
    return _download(model)


def read_hf_config(model: str | None) -> tuple[dict, str]:
    """The config.json (or a GGUF file's metadata as one) of `model` and where it came
    from, without reading weights; a hub id fetches its config.json alone."""
    path = Path(model).expanduser() if model else None
    if path is not None and not path.exists() and _is_hub_id(model):
        from huggingface_hub import hf_hub_download

        try:
            config_file = hf_hub_download(model, "config.json")
        except Exception as e:
            raise FileNotFoundError(f"could not download {model!r}'s config.json from the Hugging Face hub: {e}") from e
        with open(config_file) as f:
            return json.load(f), model
    source = resolve_source(model)
    return _source_config(source, GGUFFile(source) if source.is_file() else None), str(source)


def _is_hub_id(model: str) -> bool:
    return model.count("/") == 1 and not model.startswith((".", "/"))


def _source_config(source: Path, gguf: GGUFFile | None) -> dict:
    if gguf is not None:
        return gguf.hf_config()
    with open(source / "config.json") as f:
        return json.load(f)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja"])
    except Exception as e:
        raise FileNotFoundError(f"could not download {repo_id!r} from the Hugging Face hub: {e}") from e
    return Path(folder)


def weights_digest(source: Path) -> str:
    """A digest of a model's weight files, cheap for any size (several nodes compare theirs,
    jaxserve.parallel.multihost): each file's name, size and first MiB, where a safetensors file
    lists every tensor's name, shape and offset and a GGUF file keeps its metadata."""
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors")) + [source / "config.json"]
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name} {path.stat().st_size}\n".encode())
        with open(path, "rb") as f:
            digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


def _from_cache(entry: Path, source: Path, dtype, quant: QuantConfig | None, mesh) -> LoadedModel | None:
    """The variant restored from `entry`, or derived from a lossless base of the same
    checkpoint; None when neither is there. A damaged entry is removed (and rebuilt), never fatal."""
    used = entry
    try:
        if (entry / "complete").is_file():
            loaded = _restore(entry, source, dtype, quant, mesh)
        elif derive.can_derive(quant) and (base := cache.lossless_base(entry.parent, entry.name)):
            used = base
            loaded = _derive(base, source, dtype, quant, mesh)
        else:
            return None
    except Exception as e:
        logger.warning("removing damaged weight cache %s: %s", used, e)
        shutil.rmtree(used, ignore_errors=True)
        return None
    cache.mark_used(used)
    return loaded


def _convert(
    source: Path, dtype, quant: QuantConfig | None, progress: bool, mesh, cache_entry: Path | None
) -> LoadedModel:
    """Read and convert the weights on the host, save them to `cache_entry` (if any), then place them."""
    gguf = GGUFFile(source) if source.is_file() else None
    hf_config = _source_config(source, gguf)
    stored: set = set()  # a safetensors checkpoint's own dtypes
    if gguf is not None:
        tensors, total = gguf.tensors(keep_q4=quant is not None and quant.method == "gguf"), gguf.num_tensors
    else:
        files = safetensors_reader.safetensors_files(source)
        total = safetensors_reader.count_tensors(files)
        if quant is not None and quant.method == "compressed-tensors":
            tensors = compressed_tensors.read_tensors(files, hf_config["quantization_config"])
        else:
            tensors = safetensors_reader.read_tensors(files)
            stored = safetensors_reader.stored_dtypes(files)  # NOTE: read_tensors upcasts all to float32
    config = ModelConfig.from_hf_dict(hf_config)
    assembler = ParamAssembler(config, dtype, quant)
    if quant is not None and quant.kind == "int4":
        _log_group_sizes(assembler.specs, quant)
    source_dtypes = set()  # what the checkpoint's tensors arrived as: is this copy lossless?
    for name, tensor in tqdm(
        tensors, total=total, desc=f"loading {source.name}", unit="tensor", disable=not progress, leave=False
    ):
        source_dtypes.add(tensor.dtype if isinstance(tensor, np.ndarray) else None)
        assembler.add(name, tensor)
    tokenizer = _load_tokenizer(source, gguf)
    host = assembler.take_host_params()
    if cache_entry is not None:
        # NOTE: saved from the host before placing: the cache holds the model's own K/V heads
        # (placing may repeat them), and any mesh can restore it.
        lossless = quant is None and derive.holds_exactly(stored or source_dtypes, dtype)
        meta = {"source": str(source), "dtype": str(dtype), "quantization": quant and quant.method}
        _save(cache_entry, host, tokenizer, hf_config, {**meta, "lossless": lossless})
    model = place_params(assembler.graphdef, assembler.state, host, config, mesh)  # unstacked: the serving layout
    return LoadedModel(config, model, tokenizer, str(source), False, hf_config, quant)


def _log_group_sizes(specs: dict, quant: QuantConfig) -> None:
    """Say which int4 group size each projection got (a K the preferred size does not divide gets a smaller one)."""
    groups: dict[int, set[str]] = {}
    for path, spec in specs.items():
        if path[0] == "layers" and path[-1] == "scales":
            k = 2 * specs[path[:-1] + ("packed",)].shape[0]
            groups.setdefault(k // spec.shape[0], set()).add(path[-2])
    for group, names in sorted(groups.items()):
        note = "" if group == quant.group_size else f" (K not a multiple of {quant.group_size})"
        logger.info("int4 group size %d for %s%s", group, ", ".join(sorted(names)), note)


def _load_tokenizer(source: Path, gguf: GGUFFile | None):
    if gguf is not None:
        return tokenizer_from_gguf(gguf.field)
    if not (source / "tokenizer.json").is_file():
        logger.warning("%s has no tokenizer.json; prompts must be given as token ids", source)
        return None
    return _fast_tokenizer(source)


def load_tokenizer(folder: str | Path):
    """The tokenizer in `folder` (its tokenizer.json, tokenizer_config.json, chat template)."""
    folder = Path(folder).expanduser()
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    return _fast_tokenizer(folder)


def _fast_tokenizer(folder: Path):
    # NOTE: PreTrainedTokenizerFast, not AutoTokenizer: the latter imports torch when it is
    # installed, and the engine never needs it.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def _save(entry: Path, params: dict, tokenizer, hf_config: dict, meta: dict) -> None:
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
    cache.write_meta(tmp, **meta)
    (tmp / "complete").write_text(meta["source"])
    if not (entry / "complete").exists():
        shutil.rmtree(entry, ignore_errors=True)  # an incomplete entry (a conversion that died)
    try:
        tmp.rename(entry)
    except OSError:
        if not (entry / "complete").exists():
            raise
    shutil.rmtree(tmp, ignore_errors=True)  # another process's complete entry is the same weights


def _restore(entry: Path, source: Path, dtype, quant: QuantConfig | None, mesh) -> LoadedModel:
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

        target = jax.tree.map_with_path(restored_as, shapes, param_shardings(shapes, mesh))
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(entry.resolve() / "params", target)
    if mesh is not None and repeat:
        params = replicate_kv_heads(params, config, tensor_parallel_size(mesh))
        params = jax.tree.map(
            lambda x, s: place_from_host(x, s) if isinstance(x, np.ndarray) else x,
            params,
            param_shardings(params, mesh),
        )
    model = build_model(graphdef, state, params)
    return LoadedModel(config, model, _entry_tokenizer(entry), str(source), True, hf_config, quant)


def _derive(base: Path, source: Path, dtype, quant: QuantConfig | None, mesh) -> LoadedModel:
    """The variant computed on the host from `base`, a lossless unquantized entry of the same
    checkpoint (jaxserve.weights.derive), then placed as a conversion's result is."""
    import orbax.checkpoint as ocp

    hf_config, config = _entry_config(base)
    base_dtype = jnp.dtype(json.loads((base / "meta.json").read_text())["dtype"])
    _, _, base_shapes = _abstract_model(config, base_dtype, None)
    with ocp.StandardCheckpointer() as ckpt:
        host = ckpt.restore(base.resolve() / "params", jax.tree.map(lambda x: np.empty(x.shape, x.dtype), base_shapes))
    graphdef, state, shapes = _abstract_model(config, dtype, quant)
    host = derive.derive_params(host, dict(_flatten(shapes)), quant)
    logger.info("weights: %s derived from the cached %s copy", quant.label if quant else dtype, base_dtype)
    model = place_params(graphdef, state, host, config, mesh)
    return LoadedModel(config, model, _entry_tokenizer(base), str(source), True, hf_config, quant)


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


def _entry_tokenizer(entry: Path):
    return _fast_tokenizer(entry / "tokenizer") if (entry / "tokenizer").is_dir() else None
