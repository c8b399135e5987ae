"""What a decode step costs at batch sizes either side of a bucket edge.

One engine (the default model unless --model; max_num_seqs 64, float32); for each batch
B of `--batches`, B requests with random prompts of `--context` tokens are prefilled,
then `--steps` decode steps are timed (wall and CPU time of this process, all threads)
and the requests aborted. The batches are interleaved over `--rounds` rounds, their order reversed every other round,
so that the machine's drift falls on all of them; reported per batch: the median over
rounds of each round's median step, the ratio to the first batch, and the token bucket
the step ran in.

    python benchmarks/decode_buckets.py [--batches 32,33,40,64] [--rounds 4] [--steps 8]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_time import Timed  # noqa: E402

_request_ids = itertools.count()


def time_decode_steps(engine, batch: int, context: int, steps: int, params, rng) -> tuple[float, float]:
    """`batch` requests with random prompts of `context` tokens prefilled on `engine`, then
    the median wall and CPU seconds (this process, all threads) of `steps` decode steps;
    the requests are aborted after. `params` must leave room for the steps."""
    vocab = engine.loaded.config.vocab_size
    for _ in range(batch):
        engine.add_request(f"decode-{next(_request_ids)}", rng.integers(3, vocab, context).tolist(), params)
    while any(not req.output_token_ids for req in engine.scheduler.requests.values()):
        engine.step()  # the prefills
    engine.step()  # the first all-decode step (the overlapped loop settles)
    wall, cpu = [], []
    for _ in range(steps):
        with Timed() as t:
            engine.step()
        wall.append(t.seconds)
        cpu.append(t.cpu_seconds)
    for req in list(engine.scheduler.requests.values()):
        engine.abort_request(req.request_id)
    engine.generate_all()
    return statistics.median(wall), statistics.median(cpu)


def add_decode_arguments(p, batches: str, rounds: int) -> None:
    """The options of the decode-step benchmarks (this one and quantized_decode.py)."""
    p.add_argument("--batches", default=batches, help="comma-separated batch sizes (at most --max-num-seqs)")
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per batch (and engine) and round")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--model", help="a model folder or GGUF file (default: the embedded SmolLM2-135M-Instruct)")


def parse_batches(p, args) -> list[int]:
    batches = [int(b) for b in args.batches.split(",")]
    if max(batches) > args.max_num_seqs:
        p.error(f"--batches go up to --max-num-seqs ({args.max_num_seqs})")
    return batches


def decode_setup(args):
    """The engine config and sampling params the timed requests need: room for the prompt
    and the steps, every sequence's blocks, no prefix cache."""
    from jaxserve.engine import EngineConfig
    from scheduler.sampling_params import SamplingParams

    max_len = args.context + 2 + args.steps + 8
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=512,
        max_model_len=max_len,
        num_blocks=args.max_num_seqs * -(-max_len // 16) + 1,
        enable_prefix_caching=False,
    )
    return config, SamplingParams(max_tokens=max_len - args.context, ignore_eos=True, temperature=0.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_decode_arguments(p, batches="32,33,40,64", rounds=4)
    args = p.parse_args(argv)
    batches = parse_batches(p, args)

    import jax
    import numpy as np

    from jaxserve.engine import LLMEngine
    from jaxserve.weights.load import load_model

    loaded = load_model(args.model, dtype="float32")
    config, params = decode_setup(args)
    engine = LLMEngine(loaded, config)
    runner = engine.runner
    rng = np.random.default_rng(0)
    samples: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    for r in range(args.rounds):
        for b in batches if r % 2 == 0 else batches[::-1]:
            samples[b].append(time_decode_steps(engine, b, args.context, args.steps, params, rng))
    print(
        f"decode step of {Path(loaded.source).name} float32 on {jax.devices()[0].platform}, "
        f"prompts of {args.context} tokens; median over "
        f"{args.rounds} rounds (batches interleaved) of the median of {args.steps} steps; "
        f"token buckets {runner.buckets}"
    )
    print("| batch | token bucket | head rows | step ms | CPU ms | step / first | CPU / first |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    first = None
    for b in batches:
        wall = statistics.median(w for w, _ in samples[b])
        cpu = statistics.median(c for _, c in samples[b])
        first = first or (wall, cpu)
        print(
            f"| {b} | {runner.bucket_for(b)[0]} | {runner.rows_for(b)} | {1e3 * wall:.1f} | {1e3 * cpu:.1f} | "
            f"{wall / first[0]:.2f}x | {f'{cpu / first[1]:.2f}x' if first[1] else '-'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
