"""The scheduler is pure Python + NumPy, and so are its tests: run on their own, they load no
jax (no conftest above may import it, nor any fixture they use)."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def no_jax_loaded(request):
    yield
    if all(HERE in item.path.parents for item in request.session.items):
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax", "torch"))
        assert not loaded, f"a pure-Python test run loaded {loaded[:5]}"
