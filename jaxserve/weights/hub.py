"""Models on the Hugging Face hub, named as vLLM names them.

    owner/name                 a model repository: its config, safetensors and tokenizer
    owner/name-GGUF:Q4_K_M     one GGUF file of a repository, by its quantization type
    owner/name-GGUF:file.gguf  one GGUF file of a repository, by its name

each at a `revision` (a branch, tag or commit; None: the main branch). Telling a hub
reference from a local path needs neither the network nor jax, so the commands check a
--model before they load anything (`check_model_reference`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

FOLDER_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]  # what a model folder needs
SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


class HubReference(NamedTuple):
    repo_id: str  # "owner/name"
    gguf: str | None  # a .gguf file name or a quantization type naming one; None: the safetensors folder

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.gguf}" if self.gguf else self.repo_id


def parse_hub_reference(model: str) -> HubReference | None:
    """`model` as a hub reference, or None when it reads as a local path ('./x', '/x',
    'a/b/c', 'x.gguf')."""
    if model.startswith((".", "/", "~")):
        return None
    repo_id, _, gguf = model.partition(":")
    owner, _, name = repo_id.partition("/")
    if not owner or not name or "/" in name or name.endswith(".gguf") or ":" in gguf:
        return None
    return HubReference(repo_id, gguf or None)


def check_model_reference(model: str | None, revision: str | None = None) -> None:
    """Refuse, before anything loads, a --model that is neither an existing path nor a hub
    reference (FileNotFoundError), and a --revision for one that is local (ValueError)."""
    local = model is None or Path(model).expanduser().exists()
    if not local and parse_hub_reference(model) is None:
        raise FileNotFoundError(
            f"no model file or folder at {model!r} (nor is it a hub id: owner/name, owner/name-GGUF:Q4_K_M)"
        )
    if local and revision is not None:
        raise ValueError(f"--revision {revision} applies to a hub id; {model or 'the default model'} is local")


def resolve_model(model: str | None, revision: str | None = None) -> str | None:
    """A local path for `model`: a hub reference is downloaded (or found in the hub's cache)
    at `revision`; anything else is returned as it is."""
    check_model_reference(model, revision)
    if model is None or Path(model).expanduser().exists():
        return model
    return str(download(parse_hub_reference(model), revision))


def download(ref: HubReference, revision: str | None = None) -> Path:
    """The snapshot folder of `ref` (a safetensors model), or its one GGUF file."""
    from huggingface_hub import snapshot_download

    if ref.gguf is None:
        patterns = FOLDER_PATTERNS
    elif ref.gguf.endswith(".gguf"):
        patterns = [ref.gguf]
    else:  # the hub matches case-sensitively; files spell the type either way
        patterns = sorted({f"*{q}*.gguf" for q in (ref.gguf, ref.gguf.upper(), ref.gguf.lower())})
    at = f" at revision {revision!r}" if revision else ""
    try:
        folder = Path(snapshot_download(ref.repo_id, revision=revision, allow_patterns=patterns))
    except Exception as e:
        raise FileNotFoundError(f"could not download {str(ref)!r}{at} from the Hugging Face hub: {e}") from e
    return folder if ref.gguf is None else pick_gguf(folder, ref, at)


def pick_gguf(folder: Path, ref: HubReference, at: str = "") -> Path:
    """The one GGUF file of a downloaded snapshot that `ref` names."""
    if ref.gguf.endswith(".gguf"):
        path = folder / ref.gguf
        if not path.is_file():
            raise FileNotFoundError(f"{ref.repo_id}{at} has no file {ref.gguf!r}")
        return path
    # The type as a whole word of the name: Q4_K matches "x-Q4_K.gguf", not "x-Q4_K_M.gguf".
    word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(ref.gguf)}(?![A-Za-z0-9_])", re.IGNORECASE)
    found = sorted(p for p in folder.rglob("*.gguf") if word.search(p.name))
    names = [p.relative_to(folder).as_posix() for p in found]
    if any(SPLIT_GGUF.search(n) for n in names):
        raise ValueError(f"{ref}: split GGUF files {names} are not read; merge them into one (llama.cpp's gguf-split)")
    if len(found) != 1:
        what = f"{len(found)} files: {names}" if found else "no file"
        raise FileNotFoundError(
            f"{ref.repo_id}{at} has {what} of type {ref.gguf}; name the file: {ref.repo_id}:FILE.gguf"
        )
    return found[0]
