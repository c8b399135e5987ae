"""Hub references (`owner/name` at a --revision, `owner/name-GGUF:Q4_K_M`) resolved by the
real huggingface_hub against a hub cache laid out as it lays one out, offline
(HF_HUB_OFFLINE=1: it answers from the cache alone, as on a machine with no network)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.weights.hub import HubReference, check_model_reference, parse_hub_reference

ROOT = Path(__file__).resolve().parents[3]
MAIN, V1, GGUF = "a" * 40, "b" * 40, "c" * 40
GGUF_FILES = [
    "m-Q4_K_M.gguf",
    "m-UD-Q4_K_M.gguf",
    "m-Q4_K.gguf",
    "m-Q8_0.gguf",
    "m-Q2_K-00001-of-00002.gguf",
    "m-Q2_K-00002-of-00002.gguf",
]


def snapshot(cache: Path, repo: str, refs: dict[str, str], files: dict[str, str]) -> None:
    """`repo` in a hub cache: each ref naming a commit, the commits' files (huggingface_hub's layout)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    for ref, commit in refs.items():
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    for path, text in files.items():
        (folder / "snapshots" / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / "snapshots" / path).write_text(text)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    snapshot(
        cache,
        "owner/name",
        {"main": MAIN, "v1": V1},
        {f"{MAIN}/config.json": '{"at": "main"}', f"{V1}/config.json": '{"at": "v1"}'},
    )
    snapshot(cache, "owner/name-GGUF", {"main": GGUF}, {f"{GGUF}/{name}": "" for name in GGUF_FILES})
    return cache


CASES = [
    ("owner/name", None),
    ("owner/name", "v1"),
    ("owner/name", V1),  # a commit hash
    ("owner/name", "v2"),
    ("owner/name-GGUF:Q8_0", None),
    ("owner/name-GGUF:q8_0", None),  # the type in either case
    ("owner/name-GGUF:Q4_K", None),  # a whole word: not m-Q4_K_M.gguf
    ("owner/name-GGUF:m-UD-Q4_K_M.gguf", None),
    ("owner/name-GGUF:Q4_K_M", None),
    ("owner/name-GGUF:Q3_K", None),
    ("owner/name-GGUF:Q2_K", None),
    ("owner/name-GGUF:other.gguf", None),
]


@pytest.fixture(scope="module")
def resolved(hub_cache) -> dict:
    """resolve_model(model, revision) of each case, in one process whose huggingface_hub reads
    only `hub_cache`: {case: {"path": ...} or {"error": ...}}."""
    code = (
        "import json, sys\n"
        "from jaxserve.weights.hub import resolve_model\n"
        "out = []\n"
        "for model, revision in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        out.append({'path': resolve_model(model, revision)})\n"
        "    except (OSError, ValueError) as e:\n"
        "        out.append({'error': str(e)})\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache), "HF_HOME": str(hub_cache.parent)}
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(CASES)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return dict(zip(CASES, json.loads(result.stdout.splitlines()[-1])))


def test_a_revision_picks_its_snapshot(resolved):
    main, v1 = resolved["owner/name", None]["path"], resolved["owner/name", "v1"]["path"]
    assert json.loads((Path(main) / "config.json").read_text()) == {"at": "main"}
    assert json.loads((Path(v1) / "config.json").read_text()) == {"at": "v1"}
    assert Path(resolved["owner/name", V1]["path"]) == Path(v1)
    assert "'owner/name' at revision 'v2'" in resolved["owner/name", "v2"]["error"]


def test_a_gguf_repo_file_by_type_or_name(resolved):
    for model, name in [
        ("owner/name-GGUF:Q8_0", "m-Q8_0.gguf"),
        ("owner/name-GGUF:q8_0", "m-Q8_0.gguf"),
        ("owner/name-GGUF:Q4_K", "m-Q4_K.gguf"),
        ("owner/name-GGUF:m-UD-Q4_K_M.gguf", "m-UD-Q4_K_M.gguf"),
    ]:
        assert Path(resolved[model, None]["path"]).name == name, model
    two = resolved["owner/name-GGUF:Q4_K_M", None]["error"]
    assert "2 files" in two and "m-UD-Q4_K_M.gguf" in two and "owner/name-GGUF:FILE.gguf" in two
    assert "no file of type Q3_K" in resolved["owner/name-GGUF:Q3_K", None]["error"]
    assert "split GGUF files" in resolved["owner/name-GGUF:Q2_K", None]["error"]
    assert "has no file 'other.gguf'" in resolved["owner/name-GGUF:other.gguf", None]["error"]


def test_references_and_paths():
    assert parse_hub_reference("Qwen/Qwen3-0.6B") == HubReference("Qwen/Qwen3-0.6B", None)
    assert parse_hub_reference("unsloth/Qwen3-0.6B-GGUF:Q4_K_M") == HubReference("unsloth/Qwen3-0.6B-GGUF", "Q4_K_M")
    for path in ("./Qwen3-0.6B", "/models/x", "~/x", "a/b/c", "x", "models/x.gguf", "a/b:c:d"):
        assert parse_hub_reference(path) is None, path
    check_model_reference("Qwen/Qwen3-0.6B", "main")  # nothing is fetched
    check_model_reference(str(ROOT), None)
    with pytest.raises(FileNotFoundError, match="no model file or folder at 'a/b/c'"):
        check_model_reference("a/b/c")
    with pytest.raises(ValueError, match="--revision v1 applies to a hub id"):
        check_model_reference(str(ROOT), "v1")
