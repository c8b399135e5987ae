"""Shared fixtures: tiny random checkpoints on disk, built once per test session."""

from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    from jaxserve.weights import load_model

    return load_model(str(tiny_llama_dir), use_cache=False, progress=False)
