"""Colocated vs disaggregated serving on a mixed workload: `python benchmarks/disagg.py`.

Short-prompt requests decode many tokens while long prompts arrive among them: colocated,
each long prefill shares the steps of the decoding requests and stretches their
inter-token latency; disaggregated (a prefill server, a decode server and
`python -m api.router` in front), the decode server only takes the prompts' KV. The same
requests go to each setup in turn (alone on the machine), streamed through
benchmarks/serving.py's client; the table gives TTFT, TPOT and p99 ITL of each group,
goodput under the SLOs, and the KV bytes the prefill server handed over.

    python benchmarks/disagg.py                                   # the default model, here
    python benchmarks/disagg.py --model ./Llama-3-8B --colocated-gpus 0,1 --prefill-gpus 0 --decode-gpus 1

A `--*-gpus` list becomes the server's CUDA_VISIBLE_DEVICES and its --data-parallel-size, so
on a machine with several GPUs the two setups get the same devices. On a CPU machine every
server shares the same cores, so the figures show what the mechanism costs, not its win.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving import calculate_metrics, format_table, random_requests, run  # noqa: E402
from benchmarks.vllm_baseline import free_port, running_server  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/disagg.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="default: the embedded model")
    p.add_argument("--num-decode", type=int, default=8, help="short-prompt requests that decode long (8)")
    p.add_argument("--decode-input-len", type=int, default=32)
    p.add_argument("--decode-output-len", type=int, default=64)
    p.add_argument("--num-prefill", type=int, default=4, help="long-prompt requests arriving among them (4)")
    p.add_argument("--prefill-input-len", type=int, default=384)
    p.add_argument("--prefill-output-len", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=2.0, help="Poisson arrivals per second (2)")
    p.add_argument("--slo-ttft", type=float, default=2000, help="goodput SLO on TTFT, ms (2000)")
    p.add_argument("--slo-tpot", type=float, default=200, help="goodput SLO on TPOT, ms (200)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--colocated-gpus", help="CUDA devices of the colocated server, e.g. 0,1")
    p.add_argument("--prefill-gpus", help="CUDA devices of the prefill server")
    p.add_argument("--decode-gpus", help="CUDA devices of the decode server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def workload(args) -> list:
    """The decode-heavy and prefill-heavy requests, shuffled together (fixed seed); each
    knows its group."""
    decode = random_requests(args.num_decode, args.decode_input_len, args.decode_output_len, args.seed)
    prefill = random_requests(args.num_prefill, args.prefill_input_len, args.prefill_output_len, args.seed + 1)
    mixed = [("decode", r) for r in decode] + [("prefill", r) for r in prefill]
    random.Random(args.seed).shuffle(mixed)
    return mixed


def server_command(args, port: int, gpus: str | None, *extra: str) -> tuple[list[str], dict]:
    cmd = [
        sys.executable,
        "-m",
        "api",
        "--port",
        str(port),
        "--no-access-log",
        "--log-level",
        "warning",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--max-model-len",
        str(args.max_model_len),
        "--kv-cache-memory",
        args.kv_cache_memory,
        *(["--model", args.model] if args.model else []),
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus
        cmd += ["--data-parallel-size", str(len(gpus.split(",")))]
    return cmd, env


@contextlib.contextmanager
def colocated(args):
    port = free_port()
    cmd, env = server_command(args, port, args.colocated_gpus)
    with running_server(cmd, port, "colocated", env=env) as (url, _, _):
        yield url, None


@contextlib.contextmanager
def disaggregated(args):
    ports = [free_port() for _ in range(3)]
    secret = os.urandom(16).hex()
    prefill_cmd, env = server_command(
        args, ports[0], args.prefill_gpus, "--role", "prefill", "--kv-transfer-secret", secret
    )
    decode_cmd, decode_env = server_command(
        args, ports[1], args.decode_gpus, "--role", "decode", "--kv-transfer-secret", secret
    )
    with (
        running_server(prefill_cmd, ports[0], "prefill", env=env) as (prefill_url, _, _),
        running_server(decode_cmd, ports[1], "decode", env=decode_env) as (decode_url, _, _),
    ):
        router = [
            sys.executable,
            "-m",
            "api.router",
            "--port",
            str(ports[2]),
            "--prefill",
            prefill_url,
            "--decode",
            decode_url,
        ]
        with running_server(router, ports[2], "router", env=env) as (url, _, _):
            yield url, prefill_url


def kv_bytes_offered(prefill_url: str | None) -> float | None:
    if prefill_url is None:
        return None
    for line in httpx.get(f"{prefill_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("jaxserve:kv_transfer_offered_bytes_total"):
            return float(line.split()[-1])
    return None


def measure(args, setup, mixed) -> dict:
    with setup(args) as (url, prefill_url):
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        requests = [r for _, r in mixed]
        warm, _ = asyncio.run(
            run(
                url,
                model,
                requests[:1],
                request_rate=float("inf"),
                max_concurrency=1,
                api_key=None,
                seed=args.seed,
                timeout=600,
            )
        )
        if not warm[0].success:
            raise SystemExit(f"warm-up request failed: {warm[0].error}")
        moved_before = kv_bytes_offered(prefill_url)
        results, duration = asyncio.run(
            run(
                url,
                model,
                requests,
                request_rate=args.request_rate,
                max_concurrency=None,
                api_key=None,
                seed=args.seed,
                timeout=600,
            )
        )
        moved = kv_bytes_offered(prefill_url)
    out = {"all": calculate_metrics(results, duration, args.slo_ttft, args.slo_tpot)}
    for group in ("decode", "prefill"):
        out[group] = calculate_metrics(
            [res for (g, _), res in zip(mixed, results) if g == group], duration, args.slo_ttft, args.slo_tpot
        )
    out["kv_mib_per_request"] = None if moved is None else (moved - moved_before) / len(requests) / 2**20
    return out


def report(rows: dict[str, dict]) -> str:
    header = [
        "setup",
        "TTFT mean (ms)",
        "TTFT p99",
        "decode group TPOT mean",
        "decode group ITL p99",
        "long group TTFT mean",
        "goodput (req/s)",
        "output tok/s",
        "failed",
        "KV MiB/request",
    ]
    table = []
    for name, m in rows.items():
        a, d, p = m["all"], m["decode"], m["prefill"]
        kv = "-" if m["kv_mib_per_request"] is None else f"{m['kv_mib_per_request']:.2f}"
        table.append(
            [
                name,
                f"{a['mean_ttft_ms']:.0f}",
                f"{a['p99_ttft_ms']:.0f}",
                f"{d['mean_tpot_ms']:.1f}",
                f"{d['p99_itl_ms']:.1f}",
                f"{p['mean_ttft_ms']:.0f}",
                f"{a['request_goodput']:.2f}",
                f"{a['output_throughput']:.1f}",
                str(a["failed"]),
                kv,
            ]
        )
    base, disagg = rows["colocated"]["decode"], rows["disaggregated"]["decode"]
    ratio = base["p99_itl_ms"] / disagg["p99_itl_ms"] if disagg["p99_itl_ms"] else float("nan")
    return format_table(header, table) + f"\ndecode group p99 ITL, colocated / disaggregated: {ratio:.2f}x"


def main(argv=None) -> int:
    args = parse_args(argv)
    mixed = workload(args)
    rows = {}
    for name, setup in (("colocated", colocated), ("disaggregated", disaggregated)):
        print(f"measuring {name}", file=sys.stderr)
        rows[name] = measure(args, setup, mixed)
    print(report(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
