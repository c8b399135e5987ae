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

    python benchmarks/quantized_decode.py [--batches 1,2,4,8,16,32] [--schemes gguf,int4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.decode_buckets import time_decode_steps  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,2,4,8,16,32", help="comma-separated batch sizes (at most --max-num-seqs)")
    p.add_argument("--schemes", default="gguf,int4", help="comma-separated --quantization methods beside float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per batch, scheme and round")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--model", help="a model folder or GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    schemes = ["float32", *args.schemes.split(",")]
    if max(batches) > args.max_num_seqs:
        p.error(f"--batches go up to --max-num-seqs ({args.max_num_seqs})")

    import jax
    import numpy as np

    from jaxserve.engine import EngineConfig, LLMEngine
    from jaxserve.weights.load import load_model
    from scheduler.sampling_params import SamplingParams

    max_len = args.context + 2 + args.steps + 8
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=512,
        max_model_len=max_len,
        num_blocks=args.max_num_seqs * -(-max_len // 16) + 1,
        enable_prefix_caching=False,
    )
    engines = {}
    for scheme in schemes:
        loaded = load_model(args.model, dtype="float32", quantization=None if scheme == "float32" else scheme)
        engines[scheme] = LLMEngine(loaded, config)
    params = SamplingParams(max_tokens=max_len - args.context, ignore_eos=True, temperature=0.0)
    rng = np.random.default_rng(0)
    samples: dict[tuple[int, str], list[tuple[float, float]]] = {(b, s): [] for b in batches for s in schemes}
    for r in range(args.rounds):
        for b in batches if r % 2 == 0 else batches[::-1]:
            for scheme in schemes if r % 2 == 0 else schemes[::-1]:
                samples[b, scheme].append(time_decode_steps(engines[scheme], b, args.context, args.steps, params, rng))
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)

    name = Path(engines["float32"].loaded.source).name
    print(
        f"decode steps of {name} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), prompts of "
        f"{args.context} tokens; median over {args.rounds} rounds (batches and engines interleaved) of the median "
        f"of {args.steps} steps; matmul backend: " + ", ".join(f"{s} {engines[s].matmul_backend}" for s in schemes)
    )
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
