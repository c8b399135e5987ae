"""jaxserve behind vllm-router and behind its own router: one server, two replicas, and
prefill/decode, side by side.

    pip install vllm-router   # or put its venv's bin on PATH; --router names the binary
    python benchmarks/external_router.py --conversations 8 --turns 2 --max-concurrency 4

Starts two jaxserve servers (the default model unless --model), one `--role prefill` and
one `--role decode` (without kv_transfer_params each serves calls whole), then runs one
shared-prefix chat workload three times: straight to one server; through
`vllm-router --policy cache_aware` over both (two replicas); through
`vllm-router --vllm-pd-disaggregation` (prefill on one, decode on the other); and the same
two through jaxserve's own `python -m api.router` (`--replica`, then `--prefill/--decode`).
The workload:
`--system-prompts` long system prompts shared by `--conversations` conversations of
`--turns` turns, each turn sending the whole history (so a turn's prompt starts with the
previous turn's), streamed from /v1/chat/completions, at most `--max-concurrency` in
flight. Each run gets system prompts of its own, so no run finds another's prefixes cached.

Reported per run: TTFT (time to the first streamed text) and end-to-end latency, output
tokens per second, and the prefix-cache hit rate: prompt tokens found cached over prompt
tokens looked up, from the servers' /metrics (summed over the servers a run used; under
PD the prefill server's, which computes the prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORDS = "river stone light north garden paper window silver market engine winter orange bridge".split()


def conversations(args, tag: str) -> list[list[dict]]:
    """Per conversation, its user turns' messages; `tag` makes a run's system prompts its own."""
    rng = random.Random(args.seed)
    systems = [
        f"[{tag} {k}] You are assistant {k}. " + " ".join(rng.choice(WORDS) for _ in range(args.system_words))
        for k in range(args.system_prompts)
    ]
    return [
        [{"role": "system", "content": systems[c % len(systems)]}]
        + [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(8))} for _ in range(args.turns)]
        for c in range(args.conversations)
    ]


async def chat(
    http: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int
) -> tuple[float, float, int, str]:
    """(TTFT, latency, output tokens, text) of one streamed chat call."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body |= {"stream_options": {"include_usage": True}, "ignore_eos": True}
    start, ttft, tokens, text = time.perf_counter(), 0.0, 0, []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = ttft or time.perf_counter() - start
                text.append(chunk["choices"][0]["delta"]["content"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft, time.perf_counter() - start, tokens, "".join(text)


async def workload(url: str, model: str, convs: list[list[dict]], args) -> dict:
    limit = asyncio.Semaphore(args.max_concurrency)
    results = []

    async def conversation(turns: list[dict]):
        history = [turns[0]]
        for user in turns[1:]:
            history.append(user)
            async with limit:
                ttft, latency, tokens, text = await chat(http, model, history, args.output_len)
            results.append((ttft, latency, tokens))
            history.append({"role": "assistant", "content": text})

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in convs))
        duration = time.perf_counter() - start
    ttfts, latencies, tokens = (np.array(x) for x in zip(*results))
    return {
        "requests": len(results),
        "duration_s": duration,
        "output_tok_s": tokens.sum() / duration,
        "mean_ttft_ms": 1000 * ttfts.mean(),
        "p99_ttft_ms": 1000 * np.percentile(ttfts, 99),
        "mean_e2el_ms": 1000 * latencies.mean(),
    }


def cache_counters(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        page = httpx.get(f"{url}/metrics", timeout=30).text
        hits += sum(float(v) for v in re.findall(r"^jaxserve:prefix_cache_hits_total\S* (\S+)$", page, re.M))
        queries += sum(float(v) for v in re.findall(r"^jaxserve:prefix_cache_queries_total\S* (\S+)$", page, re.M))
    return hits, queries


def measure(name: str, url: str, counted: list[str], model: str, args) -> dict:
    hits, queries = cache_counters(counted)
    result = asyncio.run(workload(url, model, conversations(args, name), args))
    hits_now, queries_now = cache_counters(counted)
    result["cache_hit_rate"] = (hits_now - hits) / max(1.0, queries_now - queries)
    return {"setup": name, **result}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jaxserve(args, role: str, log_dir: Path):
    log = log_dir / f"{role}.log"
    cmd = [sys.executable, "-m", "api", "--port", "0", "--role", role, "--no-access-log", *args.server_args]
    if args.model:
        cmd += ["--model", args.model]
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while not (match := re.search(r"jaxserve: serving \S+ on (http://\S+)", log.read_text())):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{role} server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(60)


@contextlib.contextmanager
def own_router(log_dir: Path, *router_args: str):
    """jaxserve's `python -m api.router` on a free port; yields its URL once it serves."""
    log = log_dir / "api-router.log"
    with open(log, "w") as out:
        cmd = [sys.executable, "-m", "api.router", "--port", "0", *router_args]
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (match := re.search(r"jaxserve: router on (http://\S+)", log.read_text())):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"api.router did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(30)


@contextlib.contextmanager
def router(args, log_dir: Path, *router_args: str):
    port = free_port()
    cmd = [args.router, "--port", str(port), "--prometheus-port", str(free_port()), *router_args]
    with open(log_dir / f"router-{port}.log", "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/readiness", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def table(rows: list[dict]) -> str:
    header = ["setup", "requests", "time (s)", "output tok/s", "mean TTFT (ms)", "P99 TTFT (ms)", "mean E2EL (ms)"]
    header.append("prefix cache hit rate")
    cells = [
        [r["setup"], str(r["requests"]), f"{r['duration_s']:.1f}", f"{r['output_tok_s']:.1f}"]
        + [
            f"{r['mean_ttft_ms']:.0f}",
            f"{r['p99_ttft_ms']:.0f}",
            f"{r['mean_e2el_ms']:.0f}",
            f"{r['cache_hit_rate']:.1%}",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    line = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="the servers' model (default: the embedded default model)")
    beside = Path(sys.executable).parent / "vllm-router"  # installed in this venv, which may not be on PATH
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    p.add_argument("--router", default=found, help="the vllm-router binary (default: this venv's, else PATH's)")
    p.add_argument("--system-prompts", type=int, default=2)
    p.add_argument("--system-words", type=int, default=150, help="words per system prompt")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--server-args",
        default="--max-num-seqs 16 --max-num-batched-tokens 128 --kv-cache-memory 128MiB",
        help="more flags for both jaxserve servers (one string)",
    )
    args = p.parse_args(argv)
    args.server_args = args.server_args.split()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.router is None:
        sys.exit("vllm-router not found: pip install vllm-router, or pass --router PATH")
    with (
        tempfile.TemporaryDirectory() as tmp,
        jaxserve(args, "prefill", Path(tmp)) as a,
        jaxserve(args, "decode", Path(tmp)) as b,
    ):
        model = httpx.get(f"{b}/v1/models").json()["data"][0]["id"]
        rows = [measure("jaxserve, one server", b, [b], model, args)]
        with router(args, Path(tmp), "--worker-urls", a, b, "--policy", "cache_aware") as url:
            rows.append(measure("vllm-router cache_aware, 2 replicas", url, [a, b], model, args))
        pd = ["--vllm-pd-disaggregation", "--prefill", a, "--decode", b, "--policy", "cache_aware"]
        with router(args, Path(tmp), *pd) as url:
            rows.append(measure("vllm-router PD, 1 prefill + 1 decode", url, [a], model, args))
        with own_router(Path(tmp), "--replica", a, b) as url:
            rows.append(measure("api.router, 2 replicas", url, [a, b], model, args))
        with own_router(Path(tmp), "--prefill", a, "--decode", b) as url:
            rows.append(measure("api.router PD, 1 prefill + 1 decode", url, [a], model, args))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
