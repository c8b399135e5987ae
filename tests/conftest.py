"""Shared fixtures: tiny random checkpoints on disk, built once per test session."""

import os
from pathlib import Path

import jax
import pytest

from tests.tiny_models import make_tiny_char_tokenizer, make_tiny_model, make_tiny_tokenizer

# Tensor- and data-parallel tests need several devices. On the CPU jax makes them only if
# asked before its backend starts; programs on device 0 are the same either way.
if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 4)


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One persistent XLA cache for the session: the many engines the tests build compile
    the same programs, and each is compiled once."""
    from jaxserve.engine.llm_engine import enable_compilation_cache

    enable_compilation_cache(os.environ.get("JAXSERVE_CACHE") or tmp_path_factory.mktemp("jaxserve-cache"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    from jaxserve.weights import load_model

    return load_model(str(tiny_llama_dir), use_cache=False, progress=False)


@pytest.fixture(scope="session")
def tiny_llama_tok_dir(tmp_path_factory) -> Path:
    """The tiny Llama with a real tokenizer.json (whole words, BOS added) and a chat template."""
    folder = tmp_path_factory.mktemp("tiny-llama-tok")
    make_tiny_model("llama", folder)
    make_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_tok(tiny_llama_tok_dir):
    from jaxserve.weights import load_model

    return load_model(str(tiny_llama_tok_dir), use_cache=False, progress=False)


@pytest.fixture(scope="session")
def tiny_llama_chars(tmp_path_factory):
    """The tiny Llama with a byte-level tokenizer of one token per character: a grammar
    engine can spell any JSON, regex or choice with it (structured output)."""
    from jaxserve.weights import load_model

    folder = tmp_path_factory.mktemp("tiny-llama-chars")
    make_tiny_model("llama", folder)
    make_tiny_char_tokenizer(folder)
    return load_model(str(folder), use_cache=False, progress=False)


@pytest.fixture(scope="session")
def weights_cache(tmp_path_factory) -> Path:
    """A private cache dir for converted weights and compiled programs."""
    return tmp_path_factory.mktemp("jaxserve-cache")


@pytest.fixture(scope="session")
def default_model(weights_cache):
    """The embedded SmolLM2-135M-Instruct, converted once per session."""
    from jaxserve.weights import load_model

    return load_model(None, cache_dir=weights_cache, progress=False)


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own reading of the same GGUF file (its dequantizer and un-permutation)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.weights.default_model import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
