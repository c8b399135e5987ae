"""The converted-weight cache on disk: one folder per checkpoint content, one subfolder per
variant (dtype and quantization), least recently used entries evicted past a size cap.

    $JAXSERVE_CACHE/                    (default ~/.cache/jaxserve)
      weights/
        hashes.json                     file -> [size, mtime_ns, sha256]: each file hashed once
        <content key>/                  one checkpoint's content, whatever its name, path or mtimes
          float32/                      a variant: params/ (orbax), tokenizer/, config.json,
          bfloat16-int4/                  meta.json, last_used (its mtime), complete
      xla/                              jax's compiled programs: listed, removed by `prune --all`
      cpu_kernels/ draft_heads/         left alone (a built library; trained draft heads)
      <stem>-<dtype>-<digest>/          the old mtime-keyed entries: never read, evicted first

The content key hashes every file the entry is made from (weights, config, tokenizer), so a
copied or touched checkpoint hits the same entry and an edited one gets a new one. Imports
no jax: `jaxserve cache ls` is quick.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxserve.weights.sizes import format_bytes, parse_bytes

logger = logging.getLogger(__name__)

CACHE_FORMAT = 6  # bump when the converted layout changes: old entries get other keys and age out (6: Q4_K kept)
# NOTE: 20 GiB holds every variant of a small model, or one 8B model in bf16 (16 GB), and
# leaves room on a laptop's disk; a checkpoint larger than the cap still loads and is cached
# (the entry in use is never evicted), it just pushes out everything else.
DEFAULT_MAX_BYTES = 20 * 2**30
MAX_BYTES_ENV = "JAXSERVE_CACHE_MAX_BYTES"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_HF_BLOB = re.compile(r"[0-9a-f]{64}")


def default_cache_dir() -> Path:
    return Path(os.environ.get("JAXSERVE_CACHE", Path.home() / ".cache" / "jaxserve"))


def max_bytes_from_env() -> int:
    """The cap: `$JAXSERVE_CACHE_MAX_BYTES` ('50GiB', ...) or DEFAULT_MAX_BYTES."""
    text = os.environ.get(MAX_BYTES_ENV)
    return DEFAULT_MAX_BYTES if not text else parse_bytes(text)


def source_files(source: Path) -> list[Path]:
    """The files a cache entry is made from: a GGUF file, or a folder's safetensors, config and tokenizer."""
    if source.is_file():
        return [source]
    extra = [source / name for name in ("config.json", *_TOKENIZER_FILES)]
    return sorted(source.glob("*.safetensors")) + [p for p in extra if p.is_file()]


def checkpoint_dir(cache_dir: Path, source: Path) -> Path:
    """The folder of `source`'s content under `cache_dir` (its files hashed, or their hashes remembered)."""
    root = cache_dir / "weights"
    files = source_files(source)
    hashes = file_hashes(files, root / "hashes.json")
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, [[p.name, hashes[p]] for p in files]]).encode())
    return root / key.hexdigest()[:16]


def variant_name(dtype, quant) -> str:
    """'float32', 'bfloat16-int4', ...: what sets one entry of a checkpoint apart from another
    (a method's second layout is named too: a block-wise FP8 checkpoint 'float32-fp8-fp8_block';
    a GGUF names the layouts its projections take, 'float32-gguf-int4g32-int8g16' for a Q4_K_M)."""
    if quant is None:
        return str(dtype)
    if quant.method == "gguf":
        layouts = sorted({(quant.kind, quant.group_size), *((k, g) for _, k, g in quant.exceptions)})
        return f"{dtype}-gguf-" + "-".join(f"{kind}g{group}" for kind, group in layouts)
    second = quant.method == "fp8" and quant.kind != "fp8"
    return f"{dtype}-{quant.method}" + (f"-{quant.kind}" if second else "")


def file_hashes(files: list[Path], index_path: Path) -> dict[Path, str]:
    """Each file's sha256, read from the index while its size and mtime match (a touched file
    is hashed again and gets the same hash). A Hugging Face hub file is its blob's name."""
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    found, todo = {}, []
    for path in files:
        st = path.stat()
        known = index.get(str(path))
        if known and known[:2] == [st.st_size, st.st_mtime_ns]:
            found[path] = known[2]
        elif _HF_BLOB.fullmatch(path.resolve().name) and path.resolve().parent.name == "blobs":
            found[path] = path.resolve().name  # NOTE: the hub names an LFS blob by its sha256
        else:
            todo.append((path, st))
    if todo:
        size = format_bytes(sum(st.st_size for _, st in todo))
        logger.info(
            "hashing %d file(s), %s, for the weight cache's key (once: remembered in %s)", len(todo), size, index_path
        )
        # hashlib lets go of the GIL: a sharded checkpoint's files are hashed side by side
        with ThreadPoolExecutor(min(4, len(todo))) as pool:
            digests = list(pool.map(lambda item: _sha256(item[0]), todo))
        for (path, st), digest in zip(todo, digests):
            found[path] = digest
            index[str(path)] = [st.st_size, st.st_mtime_ns, digest]
        _write_json(index_path, index)
    return found


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


@dataclasses.dataclass
class Entry:
    """One variant of one checkpoint on disk (or an old-format entry, `stale`)."""

    path: Path
    model: str  # the source's file or folder name (the content key, path.parent.name, tells copies apart)
    variant: str
    size: int
    last_used: float  # seconds since the epoch
    stale: bool = False  # old format: never read again

    @property
    def meta(self) -> dict:
        try:
            return json.loads((self.path / "meta.json").read_text())
        except (OSError, ValueError):
            return {}


def list_entries(cache_dir: Path) -> list[Entry]:
    """Every complete weight entry under `cache_dir`, old-format ones included, least recently used first."""
    entries = []
    for checkpoint in _subdirs(cache_dir / "weights"):
        for variant in _subdirs(checkpoint):
            if (variant / "complete").is_file():
                model = Path((variant / "complete").read_text()).name or checkpoint.name
                entries.append(Entry(variant, model, variant.name, _du(variant), _last_used(variant)))
    for old in _subdirs(cache_dir):
        if (old / "complete").is_file():  # the mtime-keyed format before content keys
            entries.append(Entry(old, old.name, "(old format)", _du(old), old.stat().st_mtime, stale=True))
    return sorted(entries, key=lambda e: (not e.stale, e.last_used))


def mark_used(entry: Path) -> None:
    """Record a hit (or a write) for the LRU order: the `last_used` file's mtime."""
    (entry / "last_used").touch()


def evict_to_fit(cache_dir: Path, max_bytes: int, keep: Path | None = None, dry_run: bool = False) -> list[Entry]:
    """Remove old-format entries, then the least recently used, until the weight entries take
    at most `max_bytes`; never `keep` (the entry in use). Returns what was (or would be) removed."""
    entries = list_entries(cache_dir)
    total = sum(e.size for e in entries)
    removed = []
    for entry in entries:
        if total <= max_bytes:
            break
        if keep is not None and entry.path.resolve() == Path(keep).resolve():
            continue
        if not dry_run:
            remove(entry)
        total -= entry.size
        removed.append(entry)
    return removed


def remove(entry: Entry) -> None:
    """Delete an entry (the checkpoint's folder too once it holds no variant)."""
    shutil.rmtree(entry.path, ignore_errors=True)
    checkpoint = entry.path.parent
    if not entry.stale and not any(_subdirs(checkpoint)):
        shutil.rmtree(checkpoint, ignore_errors=True)


def lossless_base(checkpoint: Path, exclude: str) -> Path | None:
    """A complete unquantized variant of `checkpoint` that holds the source's values exactly
    (other variants can be derived from it); the smallest if several."""
    bases = []
    for variant in _subdirs(checkpoint):
        if variant.name != exclude and (variant / "complete").is_file():
            try:
                meta = json.loads((variant / "meta.json").read_text())
            except (OSError, ValueError):
                continue
            if meta.get("lossless"):
                bases.append((_du(variant), variant))
    return min(bases)[1] if bases else None


def write_meta(entry: Path, **meta) -> None:
    with open(entry / "meta.json", "w") as f:
        json.dump({"format": CACHE_FORMAT, "created": time.time(), **meta}, f)


def _write_json(path: Path, value) -> None:
    # NOTE: written aside and renamed: processes starting side by side never read half a file
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _subdirs(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.endswith(".tmp"))
    except FileNotFoundError:
        return []


def _last_used(entry: Path) -> float:
    marker = entry / "last_used"
    return (marker if marker.exists() else entry).stat().st_mtime


def _du(folder: Path) -> int:
    """Bytes of the files under `folder`."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass  # removed meanwhile by another process
    return total
