"""The benchmark scripts still run (tiny sizes; their numbers are not checked here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_e2e

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


def test_ngram_lookup_json():
    (row,) = json.loads(run("benchmarks/ngram_lookup.py", "--contexts", "600", "--steps", "20", "--json"))
    assert row["context"] == 600 and row["steps"] == 20  # the script asserts the two lookups agree


def test_cpu_kernel_benchmarks_json():
    """The C++ kernels' benchmarks: their paths agree (the scripts report the difference)."""
    args = ("--layers", "2", "--rounds", "1", "--repeats", "1", "--json")
    attention = json.loads(run("benchmarks/attention_cpu.py", "--rows", "3,20", *args))
    assert [r["rows"] for r in attention["results"]] == [3, 20]
    assert all(r["max_abs_diff"] < 1e-5 and r["kernel"]["gb_s"] > 0 for r in attention["results"])
    dense = json.loads(run("benchmarks/dense_cpu.py", "--rows", "17", *args))
    assert dense["results"][0]["max_rel_diff"] < 1e-5 and dense["results"][0]["kernel"]["gflops"] > 0


@pytest.mark.slow
def test_kernel_benchmark_smoke_on_cpu(tmp_path):
    run("benchmarks/kernels.py", "--smoke", "--runs", "2", "--json", str(tmp_path / "k.json"))
    result = json.loads((tmp_path / "k.json").read_text())
    assert len(result["cases"]) == 5 and len(result["matmul_cases"]) == 2 and len(result["gmm_cases"]) == 2
    assert all("ref_us" in r and "error" not in r for r in result["cases"])
    assert all("ragged_dot_us" in r and "error" not in r for r in result["gmm_cases"])


@pytest.mark.interpret
def test_grouped_matmul_benchmark_checks_the_interpreted_kernels(tmp_path):
    """--only gmm with --interpret: each kernel (bf16, int4, fp8 experts) against its reference
    on a random router's group sizes, timed beside ragged_dot."""
    from benchmarks import kernels

    path = tmp_path / "k.json"
    assert kernels.main(["--smoke", "--interpret", "--only", "gmm", "--runs", "1", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["gmm_cases"]
    assert [(r["tokens"], r["rows"], r["ok"]) for r in rows] == [(1, 2, True), (8, 16, True)]
    for r in rows:
        assert 1 <= r["active_experts"] <= 4
        assert all(r[f"{v}_rel_err"] <= kernels.MATMUL_TOL for v in ("gmm", "int4_gmm", "fp8_gmm")), r
        assert r["gmm_speedup"] > 0 and r["ragged_dot_speedup"] == 1


def test_kernels_rows_are_written_as_they_finish_and_a_mismatch_does_not_stop_the_run(tmp_path, monkeypatch, capsys):
    """The interpreted matmul kernels against a reference made wrong for one token count:
    that row is marked, the next case still runs, and the exit status says so. The JSON file
    holds each finished row before the next case starts."""
    from benchmarks import kernels
    from pallas_kernels.quantized_matmul import fp8_matmul_reference

    def wrong_for_one_token(x, weight, scales):
        return fp8_matmul_reference(x, weight, scales) * (2.0 if x.shape[0] == 1 else 1.0)

    monkeypatch.setitem(kernels.REFERENCES, "fp8", wrong_for_one_token)
    path, rows_seen = tmp_path / "k.json", []
    real_case = kernels.run_matmul_case

    def spy(*args, **kwargs):
        rows_seen.append(len(json.loads(path.read_text()).get("matmul_cases", [])))
        return real_case(*args, **kwargs)

    monkeypatch.setattr(kernels, "run_matmul_case", spy)
    status = kernels.main(["--smoke", "--interpret", "--only", "matmul", "--runs", "1", "--json", str(path)])
    assert status == 1
    assert rows_seen == [0, 1]
    first, second = json.loads(path.read_text())["matmul_cases"]
    assert (first["tokens"], first["ok"], first["mismatched"]) == (1, False, ["fp8", "fp8_ws"])
    assert first["int4_rel_err"] == 0 and first["fp8_rel_err"] > 0.4
    assert (second["tokens"], second["ok"]) == (8, True) and "fp8_ws_us" in second
    out = capsys.readouterr().out
    assert "MISMATCH fp8,fp8_ws" in out
    assert "1 case(s) MISMATCHED their reference or failed: small 256x192 t=1" in out


def test_kernels_error_is_recorded_and_an_interrupt_keeps_the_rows(tmp_path, monkeypatch, capsys):
    """A case that raises is a row with its error, and the run goes on; an interrupt (the
    SIGINT of gpu_check.sh's time limit) ends it with the finished rows on disk."""
    from benchmarks import kernels

    real_case, calls, interrupt = kernels.run_case, [], [True]

    def flaky(case, *args, **kwargs):
        calls.append(case.name)
        if len(calls) == 2:
            raise RuntimeError("kernel fell over")
        if len(calls) == 4 and interrupt:
            raise KeyboardInterrupt
        return real_case(case, *args, **kwargs)

    monkeypatch.setattr(kernels, "run_case", flaky)
    path = tmp_path / "k.json"
    assert kernels.main(["--smoke", "--only", "attention", "--runs", "1", "--json", str(path)]) == 130
    rows = json.loads(path.read_text())["cases"]
    assert [r["case"] for r in rows] == calls[:3]
    assert rows[1] == {
        "case": calls[1],
        "ok": False,
        "error": "RuntimeError: kernel fell over",
        "seconds": rows[1]["seconds"],
    }
    assert "ref_us" in rows[0] and "ref_us" in rows[2]
    out = capsys.readouterr().out
    assert f"{calls[1]:34} ERROR RuntimeError: kernel fell over" in out and "interrupted" in out

    calls.clear()
    interrupt.clear()
    assert kernels.main(["--smoke", "--only", "attention", "--runs", "1", "--json", str(path)]) == 1  # no interrupt
    assert len(json.loads(path.read_text())["cases"]) == 5


def test_moe_decode_smoke_on_tiny_models(tmp_path):
    """Both tiny models decode at each batch through the engine; the MoE has the dense model's
    active parameters plus its routers, and its profile charges time to its experts."""
    path = tmp_path / "moe.json"
    stdout = run(
        "benchmarks/moe_decode.py",
        "--smoke",
        "--batches",
        "1,4",
        "--models",
        "dense,moe",
        "--profile",
        "--json",
        str(path),
    )
    result = json.loads(path.read_text())
    params, layers, hidden = result["params"], 2, 64
    assert params["moe"]["active"] == params["dense"]["active"] + layers * hidden * 8
    assert params["moe"]["total"] > 3 * params["dense"]["total"] // 2
    one, four = result["rows"]
    assert (one["batch"], four["batch"]) == (1, 4)
    assert one["experts_touched"] == 2 and four["experts_touched"] == 8 * (1 - 0.75**4)
    assert 1 < one["bytes_ratio"] < 1.1 < four["bytes_ratio"]
    assert all(row[m]["step_ms"] > 0 and "moe_over_dense" in row for row in (one, four) for m in ("dense", "moe"))
    assert set(result["moe_profile"]) == {"1", "4"}
    assert all(parts["moe_experts"] > 0 for parts in result["moe_profile"].values())
    assert "|     4 | moe       |" in stdout and "MoE decode step, batch 4, by model part" in stdout


def test_lora_throughput_smoke(tmp_path):
    """The base model, the LoRA path with no adapter in use (the script checks it gives the
    base model's tokens) and mixes of 1 and 3 adapters (which must change tokens)."""
    path = tmp_path / "lora.json"
    stdout = run("benchmarks/lora_throughput.py", "--smoke", "--adapters", "1,3", "--json", str(path))
    rows = json.loads(path.read_text())
    assert [(r["config"], r["adapters"]) for r in rows] == [("base", None), ("lora-0", 0), ("lora-1", 1), ("lora-3", 3)]
    assert rows[0]["ratio_to_base"] == 1.0 and all(r["tokens_per_s"] > 0 and r["cpu_ms_per_token"] > 0 for r in rows)
    assert "lora-3" in stdout and "vs base" in stdout


def test_expert_dispatch_smoke_on_a_tiny_layer(tmp_path):
    """Both dispatches run the tiny MoE layer over 2 and 4 forced CPU devices (the script
    checks they agree before timing), at a token count 4 does not divide."""
    path = tmp_path / "dispatch.json"
    stdout = run(
        "benchmarks/expert_dispatch.py",
        *("--smoke", "--tps", "2,4", "--tokens", "1,6", "--rounds", "2", "--calls", "1", "--json", str(path)),
    )
    rows = json.loads(path.read_text())["rows"]
    assert [(r["tp"], r["tokens"]) for r in rows] == [(2, 1), (2, 6), (4, 1), (4, 6)]
    for row in rows:
        assert row["all-reduce"]["call_ms"] > 0 and row["all-to-all"]["cpu_ms_per_token"] > 0
        assert row["a2a_over_allreduce"] == row["all-to-all"]["call_ms"] / row["all-reduce"]["call_ms"]
    assert "|  4 |      6 | all-to-all |" in stdout


def test_gpu_e2e_smoke_on_a_random_model(tmp_path):
    path = tmp_path / "e2e.json"
    stdout = run("benchmarks/gpu_e2e.py", "--smoke", "--variants", "none,int4,fp8,kv-fp8", "--json", str(path))
    for variant in ("none", "int4", "fp8", "kv-fp8"):
        assert f"| {variant:<8} | reference  |" in stdout
    assert "Pallas backends not run: it needs a Hopper GPU" in stdout
    result = json.loads(path.read_text())
    assert result["model"] == "random tiny-shaped model, 2 layers"
    rows = result["variants"]["int4"]["rows"]
    assert len(rows) == 1 and [len(g) for g in rows[0]["greedy"]] == [4] * 8


def test_gpu_e2e_smoke_runs_the_reference_on_cpu(weights_cache, default_model):
    stdout = run(
        "benchmarks/gpu_e2e.py",
        "--model",
        "default",
        "--smoke",
        "--dtype",
        "float32",
        env={"JAXSERVE_CACHE": str(weights_cache)},
    )
    assert "| kv-fp8   | reference  |" in stdout
    assert "Pallas backends not run: it needs a Hopper GPU" in stdout


def greedy_run(tokens: list[list[int]], logprobs: list[list[dict]]) -> dict:
    return {"greedy": tokens, "logprobs": [[{str(t): lp for t, lp in d.items()} for d in lps] for lps in logprobs]}


def test_gpu_e2e_compare_tells_near_ties_from_mismatches():
    ref = greedy_run(
        [[5, 6, 7], [5, 6, 7], [5, 6, 7]],
        [[{5: -0.1, 9: -3}, {6: -0.7, 8: -0.75}, {7: -0.2, 1: -2}]] * 3,
    )
    ker = greedy_run(
        [[5, 6, 7], [5, 8, 7], [5, 9, 7]],  # identical; parts at a near tie; parts where 6 led by a lot
        [
            [{5: -0.1, 9: -3}, {6: -0.7, 8: -0.75}, {7: -0.2, 1: -2}],
            [{5: -0.12, 9: -3}, {8: -0.7, 6: -0.72}, {7: -0.2, 1: -2}],
            [{5: -0.1, 9: -3}, {9: -0.5, 6: -0.9}, {7: -0.2, 1: -2}],
        ],
    )
    check = gpu_e2e.compare(ref, ker)
    assert (check["identical"], check["near_ties"], check["ok"]) == (1, 1, False)
    assert check["mismatches"] == [dict(prompt=2, position=1, reference=[6, 7], kernel=[9, 7], margin=float("inf"))]
    assert check["max_logprob_diff"] == pytest.approx(0.02)

    drift = greedy_run([[5, 6, 7]], [[{5: -0.1}, {6: -1.5}, {7: -0.2}]])
    check = gpu_e2e.compare(greedy_run([[5, 6, 7]], [[{5: -0.1}, {6: -0.7}, {7: -0.2}]]), drift)
    assert (check["identical"], check["ok"]) == (1, False)  # the same tokens, but logprobs 0.8 apart


def run_gpu_check(tmp_path, *args):
    return subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable},
    )


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    """The default run's every step in its CPU form: what a lent GPU would run exists and parses."""
    out = run_gpu_check(tmp_path, "--dry-run")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "the steps' time limits add up to 540s (at most 540s" in out.stdout
    summary = (tmp_path / "dry-run" / "summary.txt").read_text().splitlines()
    names = [line.split()[0] for line in summary]
    assert names[:3] == ["versions", "compile", "numerics_attention_production"]
    assert names[-4:] == ["speed_attention", "speed_matmul", "speed_gmm", "e2e"]
    assert all(line.split()[1] == "ok" for line in summary), summary
    for name in ("speed_attention.json", "speed_matmul.json", "speed_gmm.json", "e2e.json"):
        assert json.loads((tmp_path / "dry-run" / name).read_text())


@pytest.mark.slow
def test_gpu_check_kvdefault_dry_run(tmp_path):
    """The kvdefault section's program, run for real on two CPU devices (tensor parallel 2)
    with no KV size given: the CPU's fixed 1 GiB on each device."""
    out = run_gpu_check(tmp_path, "--dry-run", "--only", "kvdefault")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log = (tmp_path / "dry-run" / "kvdefault.txt").read_text()
    assert "KV cache chosen (no size given, tensor parallel 2): 524288 blocks of 16 tokens" in log
    assert log.count("KV cache 1.07 GB (1.00 GiB) (the CPU: no memory figures)") == 2


def test_gpu_check_dry_run_refuses_limits_past_one_call(tmp_path):
    out = run_gpu_check(tmp_path, "--dry-run", "--only", "plan", "--only", "structured", "--only", "memory")
    assert out.returncode == 1
    assert "add up to 630s" in out.stdout and "run the sections apart with --only" in out.stderr
    assert [line.split()[:2] for line in (tmp_path / "dry-run" / "summary.txt").read_text().splitlines()] == [
        ["plan", "ok"],
        ["memory", "ok"],
        ["structured", "ok"],
    ]


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


@pytest.mark.slow
def test_batch_invariance_benchmark_smoke(tiny_llama_dir):
    result = json.loads(
        run(
            "benchmarks/batch_invariance.py",
            *("--model", str(tiny_llama_dir), "--rounds", "1", "--batch", "2", "--max-tokens", "4", "--json"),
        )
    )
    assert set(result) == {"batch", "single"} and all(row["cpu_ratio"] > 0 for row in result.values())


def test_decode_buckets_smoke(tiny_llama_dir):
    stdout = run(
        "benchmarks/decode_buckets.py",
        *("--model", str(tiny_llama_dir), "--batches", "8,9,17", "--rounds", "2", "--steps", "2"),
        *("--max-num-seqs", "24", "--context", "6"),
    )
    rows = [line.split("|")[1:4] for line in stdout.splitlines() if line.startswith("| ") and "batch" not in line]
    # batch -> (token bucket, head rows): steps of 8 above 8, up to max_num_seqs
    assert {int(b): (int(t), int(r)) for b, t, r in rows} == {8: (8, 8), 9: (16, 16), 17: (24, 24)}


def test_quantized_decode_smoke(tiny_llama_dir):
    stdout = run(
        "benchmarks/quantized_decode.py",
        *("--model", str(tiny_llama_dir), "--batches", "1,17", "--schemes", "int4", "--rounds", "1"),
        *("--steps", "2", "--max-num-seqs", "24", "--context", "6"),
    )
    assert "matmul backend: float32 cpu, int4 cpu" in stdout
    rows = [line.split("|")[1:3] for line in stdout.splitlines() if line.startswith("| ") and "batch" not in line]
    assert [(int(b), s.strip()) for b, s in rows] == [(1, "float32"), (1, "int4"), (17, "float32"), (17, "int4")]


def test_requantize_gguf_writes_the_same_model_in_q8_0(tmp_path):
    """Every weight matrix becomes Q8_0 within half a Q8_0 step of the source's values (plus
    what the step's float16 rounding moves the largest value by: 127 steps x 2^-11); the
    rest (norms, the tokenizer and other metadata) is copied, so the file loads as the same model."""
    import gguf
    import numpy as np

    from jaxserve.weights import load_model
    from tests.jaxserve.weights.test_gguf_weights import write_tiny_gguf

    src, dst = tmp_path / "tiny-Q4_0.gguf", tmp_path / "tiny-Q8_0.gguf"
    write_tiny_gguf(src, "llama", "Q4_0")
    stdout = run("benchmarks/requantize_gguf.py", str(src), str(dst))
    before, after = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    assert f"{sum(len(t.shape) == 2 for t in before.tensors)} tensors as Q8_0" in stdout

    def metadata(reader):  # less the header's counts and the file type, which change
        changing = ("GGUF.", "general.file_type")
        return {k: f.contents() for k, f in reader.fields.items() if not k.startswith(changing)}

    assert metadata(before) == metadata(after)
    assert after.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    for old, new in zip(before.tensors, after.tensors, strict=True):
        assert new.name == old.name and new.tensor_type.name == ("Q8_0" if len(old.shape) == 2 else "F32")
        was = gguf.quants.dequantize(old.data, old.tensor_type)
        step = np.abs(was).reshape(-1, 32).max(1, keepdims=True) / 127 if len(old.shape) == 2 else 0
        now = gguf.quants.dequantize(new.data, new.tensor_type)
        bound = step * (0.5 + 127 * 2.0**-11)
        assert np.all(np.abs((now - was).reshape(-1, 32 if len(old.shape) == 2 else 1)) <= bound), old.name
    loaded = load_model(str(dst), use_cache=False, progress=False, quantization="gguf")
    assert loaded.quantization.kind == "int8" and loaded.config == load_model(str(src), use_cache=False).config


def test_requantize_gguf_asks_for_llama_cpp_to_make_a_k_quant_mix(tmp_path):
    """Q4_K_M and the other mixes are llama.cpp's quantizer's: without its venv the script
    stops at once, saying how to make one, and writes nothing."""
    from tests.jaxserve.weights.test_gguf_weights import write_tiny_gguf

    src, dst = tmp_path / "tiny-Q4_0.gguf", tmp_path / "tiny-Q4_K_M.gguf"
    write_tiny_gguf(src, "llama", "Q4_0")
    args = [str(src), str(dst), "--type", "Q4_K_M", "--llama-cpp-python", str(tmp_path / "missing")]
    script = [sys.executable, "benchmarks/requantize_gguf.py"]
    out = subprocess.run([*script, *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "install_llama_cpp.sh" in out.stderr and not dst.exists()
