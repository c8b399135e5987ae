"""The weight cache: keyed by content, variants derived from a lossless copy, LRU under a cap,
and `jaxserve cache {ls,prune}` (jaxserve.weights.cache_admin) on real entries."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxserve.weights import cache, cache_admin, safetensors_reader
from jaxserve.weights.load import load_model
from jaxserve.weights.sizes import format_bytes
from tests.tiny_models import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def load(model, cache_dir, **kw):
    return load_model(str(model), cache_dir=cache_dir, progress=False, **kw)


def params_of(loaded) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(loaded.model))]


def assert_bit_equal(a, b):
    for x, y in zip(params_of(a), params_of(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def variants(cache_dir) -> list[str]:
    return sorted(e.variant for e in cache.list_entries(cache_dir))


def forbid_reading_weights(monkeypatch):
    monkeypatch.setattr(safetensors_reader, "read_tensors", lambda *a, **k: pytest.fail("weights read again"))


def test_same_content_is_one_entry_wherever_and_whenever(tmp_path, tiny_llama_dir):
    first = load(tiny_llama_dir, tmp_path / "c")
    copy = shutil.copytree(tiny_llama_dir, tmp_path / "copy")  # another path, new mtimes
    os.utime(copy / "model.safetensors", (1e9, 1e9))  # touched: the index no longer matches
    again = load(copy, tmp_path / "c")
    assert (first.from_cache, again.from_cache) == (False, True)
    assert variants(tmp_path / "c") == ["float32"]
    index = json.loads((tmp_path / "c" / "weights" / "hashes.json").read_text())
    assert index[str(copy / "model.safetensors")][1] == 10**18  # rehashed once, remembered by its new mtime
    assert index[str(copy / "model.safetensors")][2] == index[str(tiny_llama_dir / "model.safetensors")][2]


def test_hub_files_are_named_by_their_sha256(tmp_path):
    """In the hub's cache a snapshot's file links to blobs/<sha256 of its bytes>: that name is the hash."""
    import hashlib

    data = b"weights" * 1000
    blob = tmp_path / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir()
    blob.write_bytes(data)
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "model.safetensors").symlink_to(blob)
    (tmp_path / "snapshot" / "config.json").write_text("{}")
    files = cache.source_files(tmp_path / "snapshot")
    hashes = cache.file_hashes(files, tmp_path / "hashes.json")
    assert [p.name for p in files] == ["model.safetensors", "config.json"]
    assert hashes[files[0]] == blob.name and hashes[files[1]] == hashlib.sha256(b"{}").hexdigest()
    assert list(json.loads((tmp_path / "hashes.json").read_text())) == [str(files[1])]  # only what was read


def test_changed_content_is_a_new_entry(tmp_path, tiny_llama_dir):
    load(tiny_llama_dir, tmp_path / "c")
    edited = shutil.copytree(tiny_llama_dir, tmp_path / "edited")
    tensors = load_file(edited / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, edited / "model.safetensors", metadata={"format": "pt"})
    loaded = load(edited, tmp_path / "c")
    assert not loaded.from_cache
    assert len({e.path.parent for e in cache.list_entries(tmp_path / "c")}) == 2


def test_variants_are_derived_from_the_float32_copy(tmp_path, tiny_llama_dir, monkeypatch):
    """A float32 copy of a float32 checkpoint is lossless: bf16, int4, int8 and fp8 come from
    it, bit for bit what converting the checkpoint gives, and need no entry of their own."""
    base = load(tiny_llama_dir, tmp_path)
    assert cache.list_entries(tmp_path)[0].meta["lossless"] is True
    forbid_reading_weights(monkeypatch)
    asks = [
        {"dtype": "bfloat16"},
        {"quantization": "int4"},
        {"quantization": "int8"},
        {"dtype": "bfloat16", "quantization": "fp8"},
    ]
    derived = [load(tiny_llama_dir, tmp_path, **kw) for kw in asks]
    monkeypatch.undo()
    for kw, loaded in zip(asks, derived):
        assert loaded.from_cache and loaded.config == base.config
        assert_bit_equal(loaded, load_model(str(tiny_llama_dir), use_cache=False, progress=False, **kw))
    assert variants(tmp_path) == ["float32"]


def test_a_bfloat16_checkpoint_derives_from_its_bfloat16_copy(tmp_path, monkeypatch):
    make_tiny_model("llama", tmp_path / "bf16", dtype="bfloat16")
    load(tmp_path / "bf16", tmp_path / "c", dtype="bfloat16")
    forbid_reading_weights(monkeypatch)
    int4 = load(tmp_path / "bf16", tmp_path / "c", dtype="bfloat16", quantization="int4")
    f32 = load(tmp_path / "bf16", tmp_path / "c", dtype="float32")
    monkeypatch.undo()
    assert int4.from_cache and f32.from_cache
    for loaded, kw in ((int4, {"dtype": "bfloat16", "quantization": "int4"}), (f32, {"dtype": "float32"})):
        assert_bit_equal(loaded, load_model(str(tmp_path / "bf16"), use_cache=False, progress=False, **kw))
    assert variants(tmp_path / "c") == ["bfloat16"]


def test_a_lossy_copy_is_no_base(tmp_path, tiny_llama_dir):
    """bf16 of a float32 checkpoint has lost bits: int4 is converted from the checkpoint and kept."""
    load(tiny_llama_dir, tmp_path, dtype="bfloat16")
    int4 = load(tiny_llama_dir, tmp_path, quantization="int4")
    assert not int4.from_cache
    assert variants(tmp_path) == ["bfloat16", "float32-int4"]
    assert not any(e.meta["lossless"] for e in cache.list_entries(tmp_path))


def test_the_cap_evicts_the_least_recently_used_never_the_entry_in_use(tmp_path, tiny_llama_dir, monkeypatch):
    load(tiny_llama_dir, tmp_path, dtype="bfloat16")
    load(tiny_llama_dir, tmp_path, quantization="int4")
    entries = {e.variant: e for e in cache.list_entries(tmp_path)}
    os.utime(entries["float32-int4"].path / "last_used", (1e9, 1e9))  # the int4 entry: used long ago
    assert load(tiny_llama_dir, tmp_path, dtype="bfloat16").from_cache  # a hit: bf16 is the most recent
    assert entries["bfloat16"].path.joinpath("last_used").stat().st_mtime > 1e9
    total = sum(e.size for e in entries.values())
    removed = cache.evict_to_fit(tmp_path, total - 1, dry_run=True)
    assert [e.variant for e in removed] == ["float32-int4"]
    assert cache.evict_to_fit(tmp_path, 0, keep=entries["bfloat16"].path, dry_run=True) == removed

    monkeypatch.setenv(cache.MAX_BYTES_ENV, "1")  # smaller than any entry: only the one just written stays
    fp8 = load(tiny_llama_dir, tmp_path, quantization="fp8")
    assert not fp8.from_cache and variants(tmp_path) == ["float32-fp8"]
    assert load(tiny_llama_dir, tmp_path, quantization="fp8").from_cache


def old_format_entry(cache_dir, name="tiny-float32-0123456789abcdef"):
    """An entry as the mtime-keyed cache (format 4) wrote it."""
    (cache_dir / name / "params").mkdir(parents=True)
    (cache_dir / name / "params" / "blob").write_bytes(b"x" * 1009)  # 1 KiB with `complete`
    (cache_dir / name / "complete").write_text("/somewhere/tiny")
    return cache_dir / name


def test_ls_and_prune(tmp_path, tiny_llama_dir, capsys):
    load(tiny_llama_dir, tmp_path, dtype="bfloat16")
    load(tiny_llama_dir, tmp_path)
    old = old_format_entry(tmp_path)
    (tmp_path / "xla").mkdir()
    (tmp_path / "xla" / "program").write_bytes(b"y" * 2048)
    entries = {e.variant: e for e in cache.list_entries(tmp_path)}
    assert cache_admin.main(["ls", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["MODEL", "VARIANT", "SIZE", "LAST", "USED"]
    rows = {line.split()[1]: line for line in out[1:4]}
    assert set(rows) == {"float32", "bfloat16", "(old"} and "(base)" in rows["float32"]
    assert out[4].startswith("total: 3 entries, ") and "cap 20.0 GiB" in out[4]
    assert out[5] == f"compiled programs ({tmp_path / 'xla'}): 1 files, 2.0 KiB"

    cache_admin.main(["prune", "--cache-dir", str(tmp_path), "--dry-run"])  # under the cap: the old entry only
    assert capsys.readouterr().out.splitlines() == [
        f"would remove {old.name} (old format) (1.0 KiB)",
        "would remove 1 entries, 1.0 KiB",
    ]
    assert old.is_dir()
    keep = entries["float32"].size + entries["bfloat16"].size // 2  # room for the float32 entry, used last
    cache_admin.main(["prune", "--cache-dir", str(tmp_path), "--max-bytes", str(keep)])
    gone = capsys.readouterr().out.splitlines()
    assert [line.split()[1:3] for line in gone[:2]] == [[old.name, "(old"], [entries["bfloat16"].model, "bfloat16"]]
    assert variants(tmp_path) == ["float32"] and not old.exists()

    cache_admin.main(["prune", "--cache-dir", str(tmp_path), "--all"])
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "removed compiled programs (1 files, 2.0 KiB)",
        f"removed 1 entries, {format_bytes(entries['float32'].size + 2048)}",
    ]
    assert cache.list_entries(tmp_path) == [] and not (tmp_path / "xla").exists()
    assert not any(p.is_dir() for p in (tmp_path / "weights").iterdir())  # the checkpoint's folder went too


def test_cache_command_runs_as_a_module_without_jax(tmp_path):
    old_format_entry(tmp_path)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAXSERVE_CACHE": str(tmp_path), cache.MAX_BYTES_ENV: "1GiB"}
    code = "import sys; from jaxserve.weights import cache_admin; cache_admin.main(['ls'])"
    code += "; assert 'jax' not in sys.modules"
    ls = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
    )
    assert ls.returncode == 0, ls.stderr
    assert "(old format)" in ls.stdout and "cap 1.0 GiB" in ls.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "jaxserve.weights.cache_admin", "prune", "--max-bytes", "lots"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "not a size: 'lots'" in bad.stderr


def test_the_default_models_float32_copy_is_a_base(default_model, weights_cache, monkeypatch):
    """A GGUF file's blocks dequantized to float32 are exact: int4 over bf16 of the default model
    comes from that copy, bit for bit what converting the file gives."""
    from jaxserve.weights.gguf_reader import GGUFFile

    monkeypatch.setattr(GGUFFile, "tensors", lambda *a, **k: pytest.fail("the GGUF file read again"))
    derived = load_model(None, cache_dir=weights_cache, dtype="bfloat16", quantization="int4", progress=False)
    monkeypatch.undo()
    assert derived.from_cache
    assert_bit_equal(derived, load_model(None, dtype="bfloat16", quantization="int4", use_cache=False, progress=False))
