"""The vLLM baseline's plumbing, without vLLM: its failures, the workload mixes, the tables.

A real vLLM run needs the venv of benchmarks/install_vllm_cpu.sh, which CI does not make.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import vllm_runner
from benchmarks.serving import SWEEP_COLUMNS, format_comparison, speed_up
from benchmarks.workload import MIXES, mix_workload

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [
    "benchmarks/throughput.py",
    "benchmarks/single_stream.py",
    "benchmarks/serving.py",
    "benchmarks/spec_decode.py",
]


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", SCRIPTS)
def test_missing_vllm_python_fails_with_the_install_hint(script, tmp_path):
    out = run_script(script, "--baseline", "vllm", "--vllm-python", str(tmp_path / "no-such-python"))
    assert out.returncode != 0
    assert "does not exist" in out.stderr and "benchmarks/install_vllm_cpu.sh" in out.stderr


def test_a_python_without_vllm_fails_with_the_install_hint():
    # This venv's own Python exists but has no vLLM.
    out = run_script("benchmarks/throughput.py", "--baseline", "vllm", "--vllm-python", sys.executable)
    assert out.returncode != 0
    assert "vLLM does not import" in out.stderr and "benchmarks/install_vllm_cpu.sh" in out.stderr


def test_serving_needs_a_url_or_the_baseline():
    out = run_script("benchmarks/serving.py")
    assert out.returncode == 2 and "--base-url is required" in out.stderr
    out = run_script("benchmarks/serving.py", "--baseline", "vllm", "--base-url", "http://127.0.0.1:1")
    assert out.returncode == 2 and "drop --base-url" in out.stderr


@pytest.mark.parametrize("mix", list(MIXES))
def test_mixes_have_their_shapes(mix):
    (p_lo, p_hi), (o_lo, o_hi) = MIXES[mix]
    work = mix_workload(mix, 200, seed=3)
    assert len(work.prompts) == len(work.output_lens) == 200
    assert all(p_lo <= len(p) <= p_hi for p in work.prompts)
    assert all(o_lo <= n <= o_hi for n in work.output_lens)
    assert all(len(p) + n <= 1024 for p, n in zip(work.prompts, work.output_lens))  # the benchmarks' max_model_len
    assert work == mix_workload(mix, 200, seed=3)  # seeded


def test_short_long_and_long_short_mixes_are_what_they_say():
    short_long, long_short = mix_workload("short-long", 64), mix_workload("long-short", 64)
    assert short_long.num_output_tokens > 4 * short_long.num_prompt_tokens
    assert long_short.num_prompt_tokens > 10 * long_short.num_output_tokens
    assert mix_workload("default", 16) == mix_workload("default", 16)


def test_default_mix_is_the_original_workload():
    from benchmarks.workload import synthetic_workload

    assert mix_workload("default", 32, seed=1) == synthetic_workload(32, seed=1)


def level(concurrency, out_tok_s, ttft_ms, cpu_ms=1.0):
    m = {key: 1.0 for _, key, _ in SWEEP_COLUMNS}
    return {
        **m,
        "max_concurrency": concurrency,
        "output_throughput": out_tok_s,
        "mean_ttft_ms": ttft_ms,
        "server_cpu_ms_per_token": cpu_ms,
        "request_goodput": None,
        "failed": 0,
    }


def test_speed_up_is_above_one_when_jaxserve_is_better_either_way():
    ours, theirs = level(4, 200, 50, cpu_ms=4.0), level(4, 100, 100, cpu_ms=5.0)
    cells = dict(zip([key for _, key, _ in SWEEP_COLUMNS], speed_up(ours, theirs)))
    assert cells["max_concurrency"] == "4"
    assert cells["output_throughput"] == "2.00x"  # twice the tokens/s
    assert cells["mean_ttft_ms"] == "2.00x"  # half the latency
    assert cells["server_cpu_ms_per_token"] == "1.25x"  # less CPU per token
    assert cells["request_goodput"] == "-" and cells["failed"] == "-" and cells["server_cores_busy"] == "-"
    del ours["server_cpu_ms_per_token"]  # a server this script did not start: no CPU figures
    assert dict(zip([key for _, key, _ in SWEEP_COLUMNS], speed_up(ours, theirs)))["server_cpu_ms_per_token"] == "-"


def test_comparison_table_has_both_engines_and_the_speed_up_per_level():
    table = format_comparison(
        {"jaxserve": [level(1, 30, 100), level(8, 200, 150)], "vllm": [level(1, 20, 120), level(8, 100, 300)]}
    )
    rows = [line.split()[0] for line in table.splitlines()]
    assert rows == ["engine", "jaxserve", "vllm", "speed-up", "jaxserve", "vllm", "speed-up"]


def test_runner_takes_the_engine_settings_as_vllm_names_them():
    args = vllm_runner.parse_args(
        ["throughput", "--model", "m", "--max-num-seqs", "8", "--kv-cache-bytes", str(64 << 20)]
    )
    assert vllm_runner.engine_settings(args) == {
        "model": "m",
        "dtype": "float32",
        "max_model_len": 1024,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "kv_cache_memory_bytes": 64 << 20,
        "seed": 0,
    }
    with pytest.raises(SystemExit):
        vllm_runner.parse_args(["single"])  # no --model


def test_spec_decode_compares_each_engine_with_its_own_plain_run(capsys):
    """vLLM's n-gram rows are against vLLM's plain run, ours against ours; a line sets the two
    speed-ups side by side; mismatches count against the same engine's plain tokens."""
    from benchmarks import spec_decode as sd

    def measured(seconds: float, tokens: list[list[int]], accepted: int = 0) -> dict:
        runs = [sd.RunResult(100, seconds, tokens)]
        return {("chat", 1): sd.Measured(runs, sd.SpecCounts(10, 40, accepted, ()), 0)}

    rows = sd.make_rows(
        {
            "none": measured(2.0, [[1, 2]]),
            "ngram": measured(1.0, [[1, 2]], accepted=20),
            "vllm none": measured(3.0, [[1, 3]]),
            "vllm ngram": measured(2.0, [[1, 4]], accepted=10),
        }
    )
    by_method = {r.method: r for r in rows}
    assert by_method["ngram"].speedup == 2.0 and by_method["vllm ngram"].speedup == 1.5
    assert by_method["ngram"].mismatches == 0 and by_method["vllm ngram"].mismatches == 1
    assert by_method["vllm ngram"].mean_acceptance_length == 2.0 and by_method["vllm none"].speedup == 1.0
    sd.print_table(rows, sd.parse_args([]))
    assert "n-gram speed-up, chat batch 1: jaxserve 2.00x, vLLM 1.50x (1.33)" in capsys.readouterr().out
