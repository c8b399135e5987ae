"""Tensors from a Hugging Face folder: `model.safetensors` or shards listed in an index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

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
            raise FileNotFoundError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {folder} (and no other *.safetensors file)"
            )
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


def _open(path: Path):
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise WeightError(f"{path} is not a readable safetensors file (damaged or truncated?): {e}") from e
