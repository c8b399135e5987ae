"""The benchmarks whose default baseline is transformers say at once that torch is missing
(they used to convert and compile first, then fail with the subprocess's error hidden)."""

import importlib
import sys

import pytest

from jaxserve.extras import MissingExtra


@pytest.mark.parametrize("script", ["single_stream", "throughput"])
def test_benchmark_without_torch_says_install_the_test_extra(monkeypatch, script):
    module = importlib.import_module(f"benchmarks.{script}")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingExtra, match=r"^error: No module named torch: .* install the test extra"):
        module.main([])
