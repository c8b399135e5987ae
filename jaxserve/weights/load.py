"""Find a model, read its weights and tokenizer, and keep a converted copy for next time.

`load_model(None)` is the embedded default model. Other references: a Hugging Face
folder, a `.gguf` file, or a hub id (downloaded when the machine is online). The first
load converts the weights (dequantize, rename, quantize if asked) and saves the result
with orbax under the cache directory, keyed by dtype and quantization; the next load of
the same files restores that instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
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
from jaxserve.weights import compressed_tensors, safetensors_reader
from jaxserve.weights.default_model import default_model_path
from jaxserve.weights.fast_tokenizer import fast_tokenizer_class
from jaxserve.weights.gguf_reader import GGUFFile
from jaxserve.weights.gguf_tokenizer import tokenizer_from_gguf
from jaxserve.weights.params import ParamAssembler, build_model, place_params

logger = logging.getLogger(__name__)

CACHE_FORMAT = 4  # bump when the converted layout changes, so old caches are ignored


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


def default_cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_CACHE", Path.home() / ".cache" / "jaxserve"))


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
    entry = Path(cache_dir or default_cache_dir()) / _cache_key(source, dtype, quant)
    if use_cache and jax.distributed.is_initialized():
        # NOTE: orbax saves and restores as a collective of every jax.distributed process and
        # refuses arrays held by one; each node (jaxserve.parallel.multihost) converts on its own.
        logger.info("several nodes: the converted-weight cache is not used")
        use_cache = False
    loaded = None
    if use_cache and (entry / "complete").is_file():
        try:
            loaded = _restore(entry, source, dtype, quant, mesh)
        except Exception as e:  # a damaged cache is rebuilt, never fatal
            logger.warning("ignoring damaged weight cache %s: %s", entry, e)
    if loaded is None:
        loaded = _convert(source, dtype, quant, progress, mesh, entry if use_cache else None)
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


def _cache_key(source: Path, dtype, quant: QuantConfig | None) -> str:
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors")) + [source / "config.json"]
    stamp = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    scheme = None if quant is None else [quant.method, quant.kind, quant.group_size]
    digest = hashlib.sha256(json.dumps([CACHE_FORMAT, str(dtype), scheme, stamp]).encode()).hexdigest()[:16]
    return f"{source.stem}-{dtype}{'-' + quant.method if quant else ''}-{digest}"


def _convert(
    source: Path, dtype, quant: QuantConfig | None, progress: bool, mesh, cache_entry: Path | None
) -> LoadedModel:
    """Read and convert the weights on the host, save them to `cache_entry` (if any), then place them."""
    gguf = GGUFFile(source) if source.is_file() else None
    hf_config = _source_config(source, gguf)
    if gguf is not None:
        tensors, total = gguf.tensors(keep_q4=quant is not None and quant.method == "gguf"), gguf.num_tensors
    else:
        files = safetensors_reader.safetensors_files(source)
        total = safetensors_reader.count_tensors(files)
        if quant is not None and quant.method == "compressed-tensors":
            tensors = compressed_tensors.read_tensors(files, hf_config["quantization_config"])
        else:
            tensors = safetensors_reader.read_tensors(files)
    config = ModelConfig.from_hf_dict(hf_config)
    assembler = ParamAssembler(config, dtype, quant)
    if quant is not None and quant.kind == "int4":
        _log_group_sizes(assembler.specs, quant)
    for name, tensor in tqdm(
        tensors, total=total, desc=f"loading {source.name}", unit="tensor", disable=not progress, leave=False
    ):
        assembler.add(name, tensor)
    tokenizer = _load_tokenizer(source, gguf)
    host = assembler.take_host_params()
    if cache_entry is not None:
        # NOTE: saved from the host before placing: the cache holds the model's own K/V heads
        # (placing may repeat them), and any mesh can restore it.
        _save(cache_entry, host, tokenizer, hf_config, str(source))
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
    return fast_tokenizer_class().from_pretrained(str(folder))


def _save(entry: Path, params: dict, tokenizer, hf_config: dict, source: str) -> None:
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
    (tmp / "complete").write_text(source)
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

    with open(entry / "config.json") as f:
        hf_config = json.load(f)
    config = ModelConfig.from_hf_dict(hf_config)
    abstract = nnx.eval_shape(
        lambda: unstack_layers(DecoderLM(config, dtype=dtype, rngs=nnx.Rngs(0), quantization=quant))
    )
    graphdef, state = nnx.split(abstract)
    shapes = nnx.to_pure_dict(state)
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
    tokenizer = _fast_tokenizer(entry / "tokenizer") if (entry / "tokenizer").is_dir() else None
    return LoadedModel(config, model, tokenizer, str(source), True, hf_config, quant)
