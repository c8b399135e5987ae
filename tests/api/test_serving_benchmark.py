"""benchmarks/serving.py: its metrics on hand-made timings, and short runs against the server."""

from __future__ import annotations

import json

import pytest

from benchmarks import serving
from benchmarks.serving import RequestResult, calculate_metrics


def test_metrics_on_known_timings():
    results = [
        RequestResult(True, prompt_len=10, output_len=5, ttft=0.1, itl=[0.05] * 4, latency=0.3),  # TPOT 50 ms
        RequestResult(True, prompt_len=20, output_len=3, ttft=0.4, itl=[0.1, 0.1], latency=0.6),  # TPOT 100 ms
        RequestResult(True, prompt_len=30, output_len=1, ttft=0.2, latency=0.2),  # no TPOT
        RequestResult(False, error="HTTP 503"),
    ]
    m = calculate_metrics(results, duration=2.0, slo_ttft_ms=300, slo_tpot_ms=60)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 4.5 and m["total_token_throughput"] == 34.5
    assert m["mean_ttft_ms"] == pytest.approx(700 / 3) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["mean_tpot_ms"] == pytest.approx(75) and m["median_tpot_ms"] == pytest.approx(75)
    assert m["mean_itl_ms"] == pytest.approx(400 / 6) and m["p99_itl_ms"] == pytest.approx(100)
    assert m["mean_e2el_ms"] == pytest.approx(1100 / 3)
    assert m["request_goodput"] == 1.0  # the first and third are within both SLOs
    assert m["errors"] == ["HTTP 503"]
    assert calculate_metrics(results, 2.0)["request_goodput"] is None


def run_bench(server, capsys, *args) -> tuple[int, str]:
    code = serving.main(["--base-url", server.url, "--api-key", server.api_key, "--seed", "1", *args])
    return code, capsys.readouterr().out


def test_random_run_counts_every_token(server, capsys):
    code, out = run_bench(
        server,
        capsys,
        "--num-prompts",
        "6",
        "--max-concurrency",
        "3",
        "--input-len",
        "24",
        "--output-len",
        "5",
        "--json",
    )
    m = json.loads(out)
    assert code == 0 and (m["completed"], m["failed"]) == (6, 0)
    assert m["total_input_tokens"] == 6 * 24 and m["total_output_tokens"] == 6 * 5
    assert 0 < m["mean_ttft_ms"] <= m["mean_e2el_ms"] and m["mean_tpot_ms"] > 0 and m["p99_itl_ms"] > 0
    code, out = run_bench(
        server,
        capsys,
        "--num-prompts",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--request-rate",
        "50",
        "--slo-ttft",
        "60000",
        "--slo-tpot",
        "60000",
        "--no-warmup",
    )
    for name in (
        "Successful requests:",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TPOT (ms):",
        "P99 ITL (ms):",
        "Request goodput (req/s):",
    ):
        assert name in out
    assert "Successful requests:                    2" in out


def test_sharegpt_file(server, capsys, tmp_path):
    data = [
        {
            "conversations": [
                {"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
                {"from": "gpt", "value": f"It is {2 * i}."},
            ]
        }
        for i in range(5)
    ]
    data.append({"conversations": [{"from": "human", "value": "a lone turn is skipped"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    code, out = run_bench(
        server,
        capsys,
        "--dataset-path",
        str(path),
        "--num-prompts",
        "4",
        "--output-len",
        "3",
        "--ignore-eos",
        "--max-concurrency",
        "4",
        "--json",
    )
    m = json.loads(out)
    assert code == 0 and m["completed"] == 4 and m["total_output_tokens"] == 12 and m["total_input_tokens"] > 4 * 8


def test_sweep_draws_the_plot(server, capsys, tmp_path):
    plot = tmp_path / "sweep.png"
    code, out = run_bench(
        server,
        capsys,
        "--sweep",
        "1,2",
        "--num-prompts",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--plot",
        str(plot),
        "--result-file",
        str(tmp_path / "r.json"),
    )
    assert code == 0
    assert out.splitlines()[0].split()[:3] == ["concurrency", "req/s", "out"]
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["1", "2"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    strict = json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    levels = strict["levels"]
    assert [lv["max_concurrency"] for lv in levels] == [1, 2] and all(lv["failed"] == 0 for lv in levels)


def test_failures_are_counted(server, capsys):
    code = serving.main(
        [
            "--base-url",
            server.url,
            "--api-key",
            "wrong",
            "--model",
            "x",
            "--num-prompts",
            "3",
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--no-warmup",
            "--json",
        ]
    )
    m = json.loads(capsys.readouterr().out)
    assert code == 1 and (m["completed"], m["failed"]) == (0, 3) and "HTTP 401" in m["errors"][0]
