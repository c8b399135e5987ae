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
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder import DecoderLM
from jaxserve.model.quantization import QuantConfig, weight_bytes
from jaxserve.weights import cache, cache_entry, compressed_tensors, derive, fp8_block, gptq_awq, safetensors_reader
from jaxserve.weights.cache import default_cache_dir
from jaxserve.weights.default_model import default_model_path
from jaxserve.weights.fast_tokenizer import fast_tokenizer_class
from jaxserve.weights.gguf_reader import GGUFFile
from jaxserve.weights.gguf_tokenizer import tokenizer_from_gguf
from jaxserve.weights.hub import check_model_reference, download, parse_hub_reference
from jaxserve.weights.params import ParamAssembler, place_params

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
    expert_parallel: bool = False,
) -> LoadedModel:
    """Load `model` (None: the embedded default) as a `DecoderLM` with its tokenizer.

    `mesh` (jaxserve.parallel.sharding.make_mesh): each parameter is placed straight into its
    shards on the mesh's devices as it is read, never whole on one device (for tensor
    parallelism; K/V heads repeated when the model has fewer than devices). None: one device.
    `expert_parallel`: a mixture of experts' experts are split whole over the mesh (each
    device holds E / tp of them, jaxserve.parallel.experts), not each expert on its F axis.

    `quantization` ("int4", "int8", "fp8", "gguf"; None: as the checkpoint is) stores the
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
    loaded = _from_cache(entry, source, dtype, quant, mesh, expert_parallel) if use_cache else None
    if loaded is None:
        loaded = _convert(source, dtype, quant, progress, mesh, entry, expert_parallel)
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
    (compressed-tensors, GPTQ, AWQ or block-wise FP8); a clear error when the two disagree."""
    if source.is_file():  # a GGUF file: its own blocks as int4, or as int8 where none is 4-bit
        return GGUFFile(source).quant_config() if method == "gguf" else QuantConfig.for_method(method)
    with open(source / "config.json") as f:
        hf_config = json.load(f)
    spec = hf_config.get("quantization_config")
    if method == "gguf":
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's own blocks; {source} is not a .gguf file")
    if spec is None or _kv_cache_only(spec):  # unquantized weights (calibrated KV scales: ModelConfig.kv_scales)
        return QuantConfig.for_method(method)
    if spec.get("quant_method") in gptq_awq.METHODS:
        quant = gptq_awq.checkpoint_quant_config(spec)
    elif spec.get("quant_method") in fp8_block.METHODS:
        quant = fp8_block.checkpoint_quant_config(spec)
    else:  # refuses other methods by name, and targets that leave one of the model's projections in float
        quant = compressed_tensors.checkpoint_quant_config(spec, hf_config)
    if method not in (None, "none", quant.kind):
        raise ValueError(f"{source} is already quantized ({quant.label}); it cannot be loaded as {method!r}")
    return quant


def _kv_cache_only(spec: dict) -> bool:
    """A compressed-tensors checkpoint that quantizes only the KV cache (llm-compressor's
    kv_cache_scheme with no config_groups): its weights are plain tensors."""
    return (
        spec.get("quant_method") == "compressed-tensors"
        and not spec.get("config_groups")
        and bool(spec.get("kv_cache_scheme"))
    )


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
    check_model_reference(model)
    return download(parse_hub_reference(model))


def read_hf_config(model: str | None) -> tuple[dict, str]:
    """The config.json (or a GGUF file's metadata as one) of `model` and where it came
    from, without reading weights; a hub id fetches its config.json alone."""
    path = Path(model).expanduser() if model else None
    ref = parse_hub_reference(model) if path is not None and not path.exists() else None
    if ref is not None and ref.gguf is None:  # a GGUF file's metadata is its config: read below
        from huggingface_hub import hf_hub_download

        try:
            config_file = hf_hub_download(model, "config.json")
        except Exception as e:
            raise FileNotFoundError(f"could not download {model!r}'s config.json from the Hugging Face hub: {e}") from e
        with open(config_file) as f:
            return json.load(f), model
    source = resolve_source(model)
    return (_gguf_config(source) if source.is_file() else _source_config(source, None)), str(source)


def _gguf_config(source: Path) -> dict:
    """A GGUF file's metadata as a config, remembered under the cache folder by the file's
    path, size and modification time: the gguf package parses every field to give any (the
    default model's tokenizer is some 100,000 strings), 2.5 s of every start here."""
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    memo = default_cache_dir() / "gguf-configs" / f"{key}.json"
    try:
        return json.loads(memo.read_text())
    except (OSError, ValueError):
        pass
    config = GGUFFile(source).hf_config()
    try:
        text = json.dumps(config)
    except TypeError:  # a value JSON cannot hold: not remembered
        return config
    if json.loads(text) == config:  # kept only where it reads back the same
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            partial = memo.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(text)
            partial.replace(memo)
        except OSError:  # a read-only cache folder: read the file every time
            pass
    return config


def _source_config(source: Path, gguf: GGUFFile | None) -> dict:
    if gguf is not None:
        return gguf.hf_config()
    with open(source / "config.json") as f:
        return json.load(f)


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


def _from_cache(
    entry: Path, source: Path, dtype, quant: QuantConfig | None, mesh, expert_parallel: bool
) -> LoadedModel | None:
    """The variant restored from `entry`, or derived from a lossless base of the same
    checkpoint; None when neither is there."""
    used = entry
    try:
        if (entry / "complete").is_file():
            restored = cache_entry.restore(entry, dtype, quant, mesh, expert_parallel)
        elif derive.can_derive(quant) and (base := cache.lossless_base(entry.parent, entry.name)):
            used = base
            restored = cache_entry.derive_from(base, dtype, quant, mesh, expert_parallel)
        else:
            return None
        tokenizer = _fast_tokenizer(restored.tokenizer_dir) if restored.tokenizer_dir else None
    except Exception as e:  # a damaged entry is converted again (and replaced), never fatal
        logger.warning("ignoring damaged weight cache %s: %s", used, e)
        return None
    cache.mark_used(used)
    return LoadedModel(restored.config, restored.model, tokenizer, str(source), True, restored.hf_config, quant)


def _convert(
    source: Path,
    dtype,
    quant: QuantConfig | None,
    progress: bool,
    mesh,
    entry_dir: Path | None,
    expert_parallel: bool = False,
) -> LoadedModel:
    """Read and convert the weights on the host, save them to `entry_dir` (if any), then place them."""
    gguf = GGUFFile(source) if source.is_file() else None
    hf_config = _source_config(source, gguf)
    stored: set = set()  # a safetensors checkpoint's own dtypes
    if gguf is not None:
        keep = quant if quant is not None and quant.method == "gguf" else None  # the file's own blocks
        tensors, total = gguf.tensors(keep=keep), gguf.num_tensors
    else:
        files = safetensors_reader.safetensors_files(source)
        total = safetensors_reader.count_tensors(files)
        if quant is not None and quant.method == "compressed-tensors":
            tensors = compressed_tensors.read_tensors(files, hf_config["quantization_config"], hf_config)
        elif quant is not None and quant.method in gptq_awq.METHODS:
            tensors = gptq_awq.read_tensors(files, hf_config["quantization_config"])
        elif quant is not None and quant.kind == "fp8_block":
            tensors = fp8_block.read_tensors(files, hf_config["quantization_config"])
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
    if entry_dir is not None:
        # NOTE: saved from the host before placing: the cache holds the model's own K/V heads
        # (placing may repeat them), and any mesh can restore it.
        lossless = quant is None and derive.holds_exactly(stored or source_dtypes, dtype)
        meta = {"source": str(source), "dtype": str(dtype), "quantization": quant and quant.method}
        cache_entry.save(entry_dir, host, tokenizer, hf_config, {**meta, "lossless": lossless})
    # unstacked: the serving layout
    model = place_params(assembler.graphdef, assembler.state, host, config, mesh, expert_parallel)
    return LoadedModel(config, model, tokenizer, str(source), False, hf_config, quant)


def _log_group_sizes(specs: dict, quant: QuantConfig) -> None:
    """Say which int4 group size each projection got (a K the preferred size does not divide gets a smaller one)."""
    groups: dict[int, set[str]] = {}
    for path, spec in specs.items():
        packed = specs.get(path[:-1] + ("packed",))
        if path[0] == "layers" and path[-1] == "scales" and packed is not None:  # int4 (a GGUF may mix int8 in)
            k = 2 * packed.shape[0]
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
