"""Shared fixtures (tiny random checkpoints on disk, built once per test session) and the
markers' rules.

This file imports no jax: `pytest tests/scheduler` runs pure Python (its conftest checks
that). The conftest of each folder whose tests run jax calls `use_jax()` when pytest
collects the folder, before any of its test modules is imported; the session's compilation
cache is switched on only once jax is loaded.
"""

import gc
import logging
import os
import sys
from pathlib import Path

# The Mosaic GPU interpreter does a wgmma with np.matmul. OpenBLAS's Haswell sgemm kernel (the
# one picked on AVX2 machines like CI's) sums output columns 8-23 of every 32 in another order
# than the rest, so a token's row changed with its place in the batch: the interpreter, not our
# kernels, broke the batch-invariance tests. A GPU's wgmma computes every element alike, as the
# Sandybridge kernel does. Set before numpy is first imported (OpenBLAS reads it when loaded),
# and over any value the machine sets (some set OPENBLAS_CORETYPE=Haswell in the environment).
os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import pytest  # noqa: E402

from tests.tiny_models import make_tiny_char_tokenizer, make_tiny_model, make_tiny_tokenizer  # noqa: E402


def use_jax() -> None:
    """Tensor- and data-parallel tests need several devices. On the CPU jax makes them only
    if asked before its backend starts; programs on device 0 are the same either way. (Not
    through the environment: servers and scripts the tests start must get jax's default.)"""
    import jax

    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        jax.config.update("jax_num_cpu_devices", 4)


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """One persistent XLA cache for the session: the many engines the tests build compile
    the same programs, and each is compiled once. Nothing to do where no jax was loaded."""
    if "jax" not in sys.modules:
        return
    from jaxserve.engine.builder import enable_compilation_cache

    enable_compilation_cache(os.environ.get("JAXSERVE_CACHE") or tmp_path_factory.mktemp("jaxserve-cache"))


@pytest.fixture(autouse=True)
def restore_log_levels():
    """A command's main() run in-process sets jaxserve's loggers' levels
    (jaxserve.logs.configure_logging: "warning" for most); the next test gets them back as
    they were, whatever order the tests run in (a worker of pytest -n runs its own order)."""
    from jaxserve.logs import OWN_LOGGERS

    levels = {name: logging.getLogger(name).level for name in OWN_LOGGERS}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture(scope="module", autouse=True)
def free_compiled_programs():
    """Each test module's compiled XLA programs are freed when it ends. Every executable
    jax keeps maps a few memory regions, and a full run compiles thousands: the process
    passed Linux's limit of 65530 maps (vm.max_map_count) about two thirds of the way
    through, and the next compile or cache write segfaulted when its mmap failed. The
    persistent cache makes the next module's recompiles cheap."""
    yield
    if "jax" not in sys.modules:
        return
    import jax

    jax.clear_caches()
    gc.collect()
    maps = _memory_map_count()
    if maps is not None and maps > _MAX_MAPS_AFTER_A_MODULE:
        raise RuntimeError(
            f"{maps} memory maps are still held after freeing the compiled programs, near Linux's "
            "limit of 65530 (vm.max_map_count): something keeps executables alive, and the run "
            "would segfault in a later compile"
        )


# Half the kernel's default vm.max_map_count: one module's compiles must fit in the rest.
_MAX_MAPS_AFTER_A_MODULE = 32768


def _memory_map_count() -> int | None:
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            return sum(1 for _ in maps)
    except OSError:  # not Linux
        return None


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


# -- markers (registered in pyproject.toml; --strict-markers) ---------------------------
#
# Most are given here from what a test uses, so they stay true as tests are added; a module
# marks itself (`pytestmark`) only where its use cannot be seen this way (a default-model
# server started without --model, `load_model(None)`, the interpreter through a helper).
#   server         a fixture `server` (the session's server), or a test or fixture that starts
#                  one with tests.api.conftest's run_server / serve_in_thread
#   default_model  the fixtures default_model, server, hf_default_model (all load SmolLM2-135M)
#   hf             a test or fixture that imports torch or transformers, or a module that does
#   slow           every default_model test ("runs the 135M default model"), and long work
#   interpret      Pallas kernels in the Mosaic GPU interpreter: marked by hand
SERVER_FIXTURES = {"server"}
SERVER_STARTERS = {"run_server", "serve_in_thread"}
DEFAULT_MODEL_FIXTURES = {"default_model", "server", "hf_default_model"}
HF_MODULES = ("torch", "transformers")


def _code_names(code) -> frozenset[str]:
    """The global and attribute names a function's code (nested functions included) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return frozenset(names)


def _module_uses_hf(module) -> bool:
    for value in vars(module).values():
        name = value.__name__ if isinstance(value, type(sys)) else getattr(value, "__module__", None)
        if isinstance(name, str) and name.split(".")[0] in HF_MODULES:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    hf_modules: dict[str, bool] = {}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        funcs = [getattr(item, "function", None)]
        infos = getattr(item, "_fixtureinfo", None)
        if infos is not None:
            funcs += [d.func for name in fixtures for d in infos.name2fixturedefs.get(name, ())]
        names = frozenset().union(*(_code_names(f.__code__) for f in funcs if hasattr(f, "__code__")))
        module = getattr(item, "module", None)
        if module is not None and module.__name__ not in hf_modules:
            hf_modules[module.__name__] = _module_uses_hf(module)

        if fixtures & SERVER_FIXTURES or names & SERVER_STARTERS:
            item.add_marker("server")
        if fixtures & DEFAULT_MODEL_FIXTURES:
            item.add_marker("default_model")
        if names & set(HF_MODULES) or (module is not None and hf_modules[module.__name__]):
            item.add_marker("hf")
        if item.get_closest_marker("default_model"):
            item.add_marker("slow")
