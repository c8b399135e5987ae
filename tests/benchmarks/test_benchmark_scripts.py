"""The benchmark scripts still run (tiny sizes; their numbers are not checked here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args, env=None):
    out = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_scheduler_overhead_json():
    result = json.loads(run("benchmarks/scheduler_overhead.py", "--num-seqs", "32", "--steps", "20", "--json"))
    assert result["step"]["steps"] == 20
    assert 0 <= result["kv_waste"]["paged_waste"] < result["kv_waste"]["contiguous_waste"] < 1


@pytest.mark.slow
def test_kernel_benchmark_smoke_on_cpu(tmp_path):
    run("benchmarks/kernels.py", "--smoke", "--runs", "2", "--json", str(tmp_path / "k.json"))
    assert json.loads((tmp_path / "k.json").read_text())


def test_gpu_e2e_smoke_runs_the_reference_on_cpu(weights_cache, default_model):
    stdout = run("benchmarks/gpu_e2e.py", "--smoke", "--dtype", "float32", env={"JAXSERVE_CACHE": str(weights_cache)})
    assert "| kv-fp8   | reference  |" in stdout
    assert "Pallas backends not run: it needs a Hopper GPU" in stdout


def test_spec_decode_smoke(weights_cache, default_model):
    rows = json.loads(run("benchmarks/spec_decode.py", "--smoke", "--json", env={"JAXSERVE_CACHE": str(weights_cache)}))
    assert [(r["prompt_set"], r["batch"], r["method"]) for r in rows] == [
        (s, 1, m) for s in ("repetitive", "chat") for m in ("none", "ngram", "draft")
    ]
    for r in rows:
        assert r["requests"] == 2 and 2 <= r["output_tokens"] <= 32 and r["decode_tok_s"] > 0
        speculative = r["method"] != "none"
        assert (r["mismatches"] is not None) == speculative
        assert r["acceptance_rate"] is None or 0 <= r["acceptance_rate"] <= 1


def test_structured_smoke_with_profile(weights_cache, default_model):
    stdout = run("benchmarks/structured.py", "--smoke", "--profile", env={"JAXSERVE_CACHE": str(weights_cache)})
    # Both arms generate every token they were asked for (the grammar cannot end within 8).
    assert "| tokens generated, batch 1                |          8 |             8 |" in stdout
    assert "| tokens generated, batch 2                |         16 |            16 |" in stdout
    assert "constrained finish reasons: {1: {'length': 1}, 2: {'length': 2}}" in stdout
    for row in (
        "decode tok/s, batch 2",
        "time to first token (ms), cold grammar",
        "grammar compile alone (ms), cold",
        "| constrained                        |",
        "constrained: device time of its commonest step",
    ):
        assert row in stdout
    assert "the sampler alone, 2 rows, median ms: plain" in stdout


def test_disagg_smoke(weights_cache, default_model, tmp_path):
    """Colocated, then prefill + decode servers and the proxy, on a tiny mixed workload."""
    stdout = run(
        "benchmarks/disagg.py",
        "--num-decode",
        "2",
        "--num-prefill",
        "1",
        "--decode-input-len",
        "8",
        "--decode-output-len",
        "4",
        "--prefill-input-len",
        "40",
        "--prefill-output-len",
        "2",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--max-model-len",
        "128",
        "--kv-cache-memory",
        "64MiB",
        "--json",
        str(tmp_path / "d.json"),
        env={"JAXSERVE_CACHE": str(weights_cache)},
    )
    results = json.loads((tmp_path / "d.json").read_text())["results"]
    for setup in ("colocated", "disaggregated"):
        assert results[setup]["all"]["completed"] == 3 and results[setup]["all"]["failed"] == 0
    assert results["disaggregated"]["kv_mib_per_request"] > 0  # the long prompt's two full blocks at least
    assert "decode group p99 ITL, colocated / disaggregated" in stdout
