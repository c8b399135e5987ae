"""Find a model, read its weights and tokenizer, and keep a converted copy for next time.

`load_model(None)` is the embedded default model. Other references: a Hugging Face
folder, a `.gguf` file, or a hub id (downloaded when the machine is online). The first
load converts the weights (dequantize, rename, stack layers) and saves the result with
orbax under the cache directory; the next load of the same files restores that instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.config import ModelConfig
from jaxserve.default_model import default_model_path
from jaxserve.model import DecoderLM, unstack_layers
from jaxserve.weights import safetensors_reader
from jaxserve.weights.gguf_reader import GGUFFile
from jaxserve.weights.gguf_tokenizer import tokenizer_from_gguf
from jaxserve.weights.params import ParamAssembler, build_model, model_params

logger = logging.getLogger(__name__)

CACHE_FORMAT = 3  # bump when the converted layout changes, so old caches are ignored


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    model: DecoderLM
    tokenizer: object | None  # a transformers PreTrainedTokenizerBase; None if the folder has none
    source: str
    from_cache: bool
    hf_config: dict  # the config.json (or GGUF metadata) the config was read from


def default_cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_CACHE", Path.home() / ".cache" / "jaxserve"))


def load_model(
    model: str | None = None,
    *,
    dtype="float32",
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    progress: bool = True,
) -> LoadedModel:
    """Load `model` (None: the embedded default) as a `DecoderLM` with its tokenizer."""
    source = resolve_source(model)
    dtype = jnp.dtype(dtype)
    entry = Path(cache_dir or default_cache_dir()) / _cache_key(source, dtype)
    if use_cache and (entry / "complete").is_file():
        try:
            return _restore(entry, source, dtype)
        except Exception as e:  # a damaged cache is rebuilt, never fatal
            logger.warning("ignoring damaged weight cache %s: %s", entry, e)
    loaded = _convert(source, dtype, progress)
    if use_cache:
        _save(entry, loaded)
    return loaded


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
    if model.count("/") != 1 or model.startswith((".", "/")):
        raise FileNotFoundError(f"no model file or folder at {model!r} (and it does not look like a hub id)")
    return _download(model)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja"])
    except Exception as e:
        raise FileNotFoundError(f"could not download {repo_id!r} from the Hugging Face hub: {e}") from e
    return Path(folder)


def _cache_key(source: Path, dtype) -> str:
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors")) + [source / "config.json"]
    stamp = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    digest = hashlib.sha256(json.dumps([CACHE_FORMAT, str(dtype), stamp]).encode()).hexdigest()[:16]
    return f"{source.stem}-{dtype}-{digest}"


def _convert(source: Path, dtype, progress: bool) -> LoadedModel:
    gguf = GGUFFile(source) if source.is_file() else None
    if gguf is not None:
        hf_config = gguf.hf_config()
        tensors, total = gguf.tensors(), gguf.num_tensors
    else:
        with open(source / "config.json") as f:
            hf_config = json.load(f)
        files = safetensors_reader.safetensors_files(source)
        tensors, total = safetensors_reader.read_tensors(files), safetensors_reader.count_tensors(files)
    config = ModelConfig.from_hf_dict(hf_config)
    assembler = ParamAssembler(config, dtype)
    for name, tensor in tqdm(tensors, total=total, desc=f"loading {source.name}", unit="tensor",
                             disable=not progress, leave=False):
        assembler.add(name, tensor)
    model = unstack_layers(assembler.build())  # the serving layout: one array per layer's weight
    return LoadedModel(config, model, _load_tokenizer(source, gguf), str(source), False, hf_config)


def _load_tokenizer(source: Path, gguf: GGUFFile | None):
    if gguf is not None:
        return tokenizer_from_gguf(gguf.field)
    if not (source / "tokenizer.json").is_file():
        logger.warning("%s has no tokenizer.json; prompts must be given as token ids", source)
        return None
    return _fast_tokenizer(source)


def _fast_tokenizer(folder: Path):
    # NOTE: PreTrainedTokenizerFast, not AutoTokenizer: the latter imports torch when it is
    # installed, and the engine never needs it.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def _save(entry: Path, loaded: LoadedModel) -> None:
    import orbax.checkpoint as ocp

    tmp = entry.with_name(entry.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp.resolve() / "params", model_params(loaded.model))
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(str(tmp / "tokenizer"))
    with open(tmp / "config.json", "w") as f:
        json.dump(loaded.hf_config, f)
    (tmp / "complete").write_text(loaded.source)
    shutil.rmtree(entry, ignore_errors=True)
    tmp.rename(entry)


def _restore(entry: Path, source: Path, dtype) -> LoadedModel:
    import orbax.checkpoint as ocp

    with open(entry / "config.json") as f:
        hf_config = json.load(f)
    config = ModelConfig.from_hf_dict(hf_config)
    abstract = nnx.eval_shape(lambda: unstack_layers(DecoderLM(config, dtype=dtype, rngs=nnx.Rngs(0))))
    graphdef, state = nnx.split(abstract)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(entry.resolve() / "params", target)
    model = build_model(graphdef, state, params)
    tokenizer = _fast_tokenizer(entry / "tokenizer") if (entry / "tokenizer").is_dir() else None
    return LoadedModel(config, model, tokenizer, str(source), True, hf_config)
