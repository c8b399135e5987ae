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

from benchmarks.decode_buckets import add_decode_arguments, decode_setup, parse_batches, time_decode_steps  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decode_arguments(p, batches="1,2,4,8,16,32", rounds=3)
    p.add_argument("--schemes", default="gguf,int4", help="comma-separated --quantization methods beside float32")
    args = p.parse_args(argv)
    batches = parse_batches(p, args)
    schemes = ["float32", *args.schemes.split(",")]

    import jax
    import numpy as np

    from jaxserve.engine import LLMEngine
    from jaxserve.weights.load import load_model

    config, params = decode_setup(args)
    engines = {}
    for scheme in schemes:
        loaded = load_model(args.model, dtype="float32", quantization=None if scheme == "float32" else scheme)
        engines[scheme] = LLMEngine(loaded, config)
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
