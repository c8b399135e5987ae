"""The cost of --batch-invariant on the CPU: the same workload with and without it.

Two engines on one model (the default SmolLM2-135M-Instruct in float32, or --model), each
warmed up, take turns round by round on one workload: a batch of prompts of mixed lengths
(prefill) that then decode together, and a single stream. Reported per mode: the median
over rounds of the process CPU time and the wall time per token (prompt and generated
tokens both counted), and the ratio of batch-invariant to default.

    python benchmarks/batch_invariance.py [--rounds 3] [--batch 8] [--max-tokens 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def workload(vocab: int, batch: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1, *rng.integers(3, vocab, int(rng.integers(16, 200))).tolist()] for _ in range(batch)]


def run_once(engine, prompts, params) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, tokens) for one pass over `prompts` as one batch."""
    cpu, wall = time.process_time(), time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", prompt, params)
    outs = engine.generate_all()
    tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
    return time.process_time() - cpu, time.perf_counter() - wall, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder or hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="prompts in the batched workload")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from jaxserve.engine import EngineConfig, LLMEngine
    from jaxserve.weights import load_model
    from scheduler import SamplingParams

    loaded = load_model(args.model, progress=False, dtype="float32")
    config = dict(max_num_seqs=16, max_num_batched_tokens=512, enable_prefix_caching=False)
    engines = {
        mode: LLMEngine(loaded, EngineConfig(**config, batch_invariant=mode == "invariant"))
        for mode in ("default", "invariant")
    }
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    loads = {"batch": workload(loaded.config.vocab_size, args.batch), "single": workload(loaded.config.vocab_size, 1)}
    times = {(w, m): [] for w in loads for m in engines}
    for r in range(args.rounds + 1):  # round 0 warms each engine's caches
        for w, prompts in loads.items():
            for m in ("default", "invariant") if r % 2 else ("invariant", "default"):  # alternated
                cpu, wall, tokens = run_once(engines[m], prompts, params)
                if r:
                    times[(w, m)].append((cpu / tokens, wall / tokens))
    rows = {}
    for w in loads:
        med = {m: [statistics.median(t[i] for t in times[(w, m)]) for i in (0, 1)] for m in engines}
        rows[w] = {
            **{f"{m}_{k}_ms_per_token": 1e3 * med[m][i] for m in engines for i, k in enumerate(("cpu", "wall"))},
            "cpu_ratio": med["invariant"][0] / med["default"][0],
            "wall_ratio": med["invariant"][1] / med["default"][1],
        }
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| workload | default CPU ms/token | invariant CPU ms/token | CPU ratio | wall ratio |")
    print("|---|---|---|---|---|")
    for w, row in rows.items():
        print(
            f"| {w} | {row['default_cpu_ms_per_token']:.3f} | {row['invariant_cpu_ms_per_token']:.3f} | "
            f"{row['cpu_ratio']:.2f} | {row['wall_ratio']:.2f} |"
        )


if __name__ == "__main__":
    main()
