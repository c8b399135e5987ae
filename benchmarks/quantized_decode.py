"""Decode on 4-bit weights against float32, batch by batch: where 4 bits pay on this machine.

One engine per scheme on the same model (the default SmolLM2-135M-Instruct unless --model):
float32, and each of `--schemes` (gguf: the file's own Q4_1 blocks; int4: round-to-nearest
groups of 128 or less). For each batch B of `--batches`, B requests with random prompts of
`--context` tokens are prefilled, then `--steps` decode steps are timed (wall and CPU time
of this process, all threads). The batches are interleaved over `--rounds` rounds and the
engines take turns inside each (their order reversed every other round), so that the
machine's drift falls on all of them. Reported per batch and scheme: the median step,
decode tokens/s, CPU ms per token, and the speed-up over float32 (the lesson's curve: 4
bits read about 3x fewer bytes a step, which wins while a step is bound by its weight
reads, at small batches, and the win shrinks as the batch grows).

With `--llama-cpp-python` (the venv of benchmarks/install_llama_cpp.sh), llama.cpp joins
the rotation on the same GGUF, its blocks as stored (the default model's Q4_1 projections
and Q8_0 table), in its own process (benchmarks/llama_cpp_runner.py): the same batches of
random prompts, each step one `llama_decode` of a token per sequence and a greedy pick, its
CPU its own process's. Its row is "llama.cpp".

    python benchmarks/quantized_decode.py [--batches 1,2,4,8,16,32] [--schemes gguf,int4] [--rounds 3]
    python benchmarks/quantized_decode.py --llama-cpp-python .venv-llama-cpp/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.decode_buckets import add_decode_arguments, decode_setup, parse_batches, time_decode_steps  # noqa: E402
from benchmarks.runner_session import RunnerSession  # noqa: E402

LLAMA_CPP = "llama.cpp"
LLAMA_RUNNER = Path(__file__).with_name("llama_cpp_runner.py")


def llama_cpp_session(python: str, gguf: Path, args, batches: list[int]) -> RunnerSession:
    """llama_cpp_runner.py on `gguf`, with room for the largest batch's sequences."""
    if not Path(python).is_file():
        raise SystemExit(f"error: {python} does not exist; make it with:  bash benchmarks/install_llama_cpp.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    room = args.context + args.steps + 8
    cmd = [python, str(LLAMA_RUNNER), str(gguf), "--max-batch", str(max(batches)), "--max-context", str(room)]
    return RunnerSession(cmd, env, name="llama.cpp runner")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decode_arguments(p, batches="1,2,4,8,16,32", rounds=3)
    p.add_argument("--schemes", default="gguf,int4", help="comma-separated --quantization methods beside float32")
    p.add_argument(
        "--llama-cpp-python",
        help="Python of the venv made by benchmarks/install_llama_cpp.sh: llama.cpp on the same GGUF joins in",
    )
    args = p.parse_args(argv)
    batches = parse_batches(p, args)
    schemes = ["float32", *args.schemes.split(",")]
    if args.llama_cpp_python and args.model and not args.model.endswith(".gguf"):
        p.error("llama.cpp reads a GGUF file: --model must be one (or left out: the default model's)")

    import jax
    import numpy as np

    from jaxserve.engine import LLMEngine
    from jaxserve.weights.default_model import default_model_path
    from jaxserve.weights.load import load_model

    config, params = decode_setup(args)
    engines = {}
    for scheme in schemes:
        loaded = load_model(args.model, dtype="float32", quantization=None if scheme == "float32" else scheme)
        engines[scheme] = LLMEngine(loaded, config)
    rng = np.random.default_rng(0)
    with contextlib.ExitStack() as stack:
        if args.llama_cpp_python:
            gguf = Path(args.model or default_model_path())
            llama = stack.enter_context(llama_cpp_session(args.llama_cpp_python, gguf, args, batches))
            schemes.append(LLAMA_CPP)
        samples: dict[tuple[int, str], list[tuple[float, float]]] = {(b, s): [] for b in batches for s in schemes}
        for r in range(args.rounds):
            for b in batches if r % 2 == 0 else batches[::-1]:
                for scheme in schemes if r % 2 == 0 else schemes[::-1]:
                    if scheme == LLAMA_CPP:
                        request = {"batch": b, "context": args.context, "steps": args.steps, "seed": r}
                        out = llama.send(json.dumps(request))
                        samples[b, scheme].append((out["step_s"], out["cpu_s"]))
                        continue
                    engine = engines[scheme]
                    samples[b, scheme].append(time_decode_steps(engine, b, args.context, args.steps, params, rng))
            print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)

    name = Path(engines["float32"].loaded.source).name
    backends = [f"{s} {engines[s].matmul_backend}" for s in schemes if s != LLAMA_CPP]
    print(
        f"decode steps of {name} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), prompts of "
        f"{args.context} tokens; median over {args.rounds} rounds (batches and engines interleaved) of the median "
        f"of {args.steps} steps; matmul backend: " + ", ".join(backends)
    )
    if args.llama_cpp_python:
        print(f"llama.cpp: llama-cpp-python {llama.ready['version']}, {llama.ready['threads']} threads, {gguf.name}")
    print("| batch | scheme | step ms | decode tok/s | CPU ms/token | speed-up over float32 |")
    print("|---:|---|---:|---:|---:|---:|")
    for b in batches:
        base = statistics.median(w for w, _ in samples[b, "float32"])
        for scheme in schemes:
            wall = statistics.median(w for w, _ in samples[b, scheme])
            cpu = statistics.median(c for _, c in samples[b, scheme])
            print(f"| {b} | {scheme} | {1e3 * wall:.1f} | {b / wall:.1f} | {1e3 * cpu / b:.2f} | {base / wall:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
