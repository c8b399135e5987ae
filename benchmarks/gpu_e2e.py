"""End-to-end check of the attention backends on the default model (for a lent GPU).

Greedy generation through the whole engine with the Pallas kernel must give the tokens
the pure-JAX reference gives; then both serve the same batch and their output tokens/s
are compared. On a machine without a Hopper GPU only the reference runs.

    python benchmarks/gpu_e2e.py [--dtype bfloat16] [--json PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "List five fruits:",
    "Water boils at",
    "import numpy as np\n",
    "The quick brown fox",
]


def run_backend(loaded, backend: str, args) -> dict:
    from jaxserve.engine import EngineConfig, LLMEngine
    from scheduler import SamplingParams

    engine = LLMEngine(loaded, EngineConfig(attention_backend=backend, max_num_seqs=args.batch,
                                            max_num_batched_tokens=max(512, args.batch), max_model_len=1024))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"g{i}", p, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    greedy = {o.request_id: o.outputs[0].token_ids for o in engine.generate_all()}

    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"t{i}", PROMPTS[i % len(PROMPTS)] * 4, params)
    start = time.perf_counter()
    engine.generate_all()
    elapsed = time.perf_counter() - start
    return {"backend": engine.attention_backend, "greedy": [greedy[f"g{i}"] for i in range(len(PROMPTS))],
            "output_tok_s": args.batch * args.decode_tokens / elapsed, "seconds": elapsed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (for a CPU)")
    args = p.parse_args(argv)
    if args.smoke:
        args.max_tokens, args.batch, args.decode_tokens = 4, 8, 4

    from jaxserve.backend import pallas_unsupported_reason
    from jaxserve.engine import EngineConfig
    from jaxserve.weights import load_model
    import jax

    loaded = load_model(None, dtype=args.dtype, progress=False)
    reason = pallas_unsupported_reason(loaded.config, args.dtype, EngineConfig.block_size, jax.devices()[0])
    backends = ["reference"] + ([] if reason else ["pallas"])
    results = [run_backend(loaded, b, args) for b in backends]

    print(f"default model, {args.dtype}, {jax.devices()[0].device_kind}")
    print(f"| {'backend':<10} | {'output tok/s (batch %d)' % args.batch:>24} |")
    print(f"|{'-' * 12}|{'-' * 26}|")
    for r in results:
        print(f"| {r['backend']:<10} | {r['output_tok_s']:>24.1f} |")
    status = 0
    if len(results) == 2:
        ref, ker = results[0]["greedy"], results[1]["greedy"]
        same = sum(a == b for a, b in zip(ref, ker))
        print(f"greedy continuations identical: {same}/{len(ref)}")
        for i, (a, b) in enumerate(zip(ref, ker)):
            if a != b:
                first = next(j for j, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y)
                print(f"  prompt {i} diverges at token {first}: reference {a[first:first + 4]} kernel {b[first:first + 4]}")
        print(f"pallas / reference speed: {results[1]['output_tok_s'] / results[0]['output_tok_s']:.2f}x")
        status = 0 if same == len(ref) else 1
    else:
        print(f"Pallas backend not run: {reason}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
