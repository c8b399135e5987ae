"""Tensors from a Hugging Face folder: `model.safetensors` or shards listed in an index."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxserve.weights.params import WeightError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def safetensors_files(folder: Path) -> list[Path]:
    """The shard files of a checkpoint folder, checked to exist."""
    index = folder / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [folder / n for n in names]
    elif (folder / SINGLE_FILE).is_file():
        files = [folder / SINGLE_FILE]
    else:
        found = sorted(p.name for p in folder.glob("*.safetensors"))
        if not found:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder} (and no other *.safetensors file)")
        files = [folder / n for n in found]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{INDEX_FILE} in {folder} lists shards that are not there: {', '.join(missing)}")
    return files


def count_tensors(files: list[Path]) -> int:
    total = 0
    for path in files:
        with _open(path) as f:
            total += len(f.keys())
    return total


def stored_dtypes(files: list[Path]) -> set[np.dtype]:
    """The dtypes the tensors are stored in (read_tensors hands every one over as float32)."""
    found = set()
    for path in files:
        with open(path, "rb") as f:
            found.update(np.dtype(dtype) for dtype, _, _ in _raw_header(path, f)[0].values())
    return found


def read_tensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) for every tensor of every shard."""
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except SafetensorError as e:
                    raise WeightError(f"{path} is damaged or truncated: reading {name!r} failed: {e}") from e
                yield name, np.asarray(tensor, np.float32)


# safetensors dtype codes -> numpy dtypes. safetensors' numpy framework cannot make float8
# arrays, so quantized checkpoints are read from the raw bytes (ml_dtypes comes with jax).
_RAW_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_MAX_HEADER = 100 << 20


def read_raw_tensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array in its stored dtype) for every tensor of every shard, by name within a
    shard (so a module's pieces arrive together). Arrays are read-only views of the bytes
    read; safetensors files are little-endian, as is every host jax runs on."""
    for path in files:
        with open(path, "rb") as f:
            header, data_start = _raw_header(path, f)
            size = path.stat().st_size
            for name in sorted(header):
                dtype, shape, (begin, end) = header[name]
                want = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                if end - begin != want or data_start + end > size:
                    raise WeightError(f"{path} is damaged or truncated: tensor {name!r} does not fit the file")
                f.seek(data_start + begin)
                yield name, np.frombuffer(f.read(want), dtype).reshape(shape)


def _raw_header(path: Path, f) -> tuple[dict[str, tuple], int]:
    """{name: (numpy dtype, shape, (begin, end))} and where the data starts."""
    damaged = f"{path} is not a readable safetensors file (damaged or truncated?)"
    prefix = f.read(8)
    if len(prefix) != 8:
        raise WeightError(damaged)
    (length,) = struct.unpack("<Q", prefix)
    if length > _MAX_HEADER:
        raise WeightError(damaged)
    try:
        entries = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightError(f"{damaged}: {e}") from e
    entries.pop("__metadata__", None)
    header = {}
    for name, entry in entries.items():
        if entry["dtype"] not in _RAW_DTYPES:
            raise WeightError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which jaxserve cannot read")
        header[name] = (_RAW_DTYPES[entry["dtype"]], tuple(entry["shape"]), tuple(entry["data_offsets"]))
    return header, 8 + length


def _open(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise WeightError(f"{path} is not a readable safetensors file (damaged or truncated?): {e}") from e
