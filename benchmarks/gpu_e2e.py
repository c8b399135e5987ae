"""End-to-end check of the kernel backends on the default model (for a lent GPU).

For each variant (the float model; int4, fp8 and gguf quantized projections; an fp8 KV
cache), greedy generation through the whole engine with the Pallas kernels (attention
and quantized matmuls) should give the tokens the pure-JAX references give; then both
serve the same batch and their output tokens/s are compared. On a machine without a
Hopper GPU only the references run.

    python benchmarks/gpu_e2e.py [--dtype bfloat16] [--variants none,int4,fp8,gguf,kv-fp8] [--json PATH] [--smoke]
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


def run_backend(loaded, backend: str, kv_cache_dtype: str, args) -> dict:
    from jaxserve.engine import EngineConfig, LLMEngine
    from scheduler import SamplingParams

    engine = LLMEngine(
        loaded,
        EngineConfig(
            attention_backend=backend,
            matmul_backend=backend,
            kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=args.batch,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=1024,
        ),
    )
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"g{i}", p, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    greedy = {o.request_id: o.outputs[0].token_ids for o in engine.generate_all()}

    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"t{i}", PROMPTS[i % len(PROMPTS)] * 4, params)
    start = time.perf_counter()
    engine.generate_all()
    elapsed = time.perf_counter() - start
    return {
        "backend": engine.attention_backend,
        "matmul_backend": engine.matmul_backend,
        "greedy": [greedy[f"g{i}"] for i in range(len(PROMPTS))],
        "output_tok_s": args.batch * args.decode_tokens / elapsed,
        "seconds": elapsed,
    }


def compare(variant: str, results: list[dict]) -> bool:
    """Print the greedy agreement of the two backends; True if every continuation matches."""
    ref, ker = results[0]["greedy"], results[1]["greedy"]
    same = sum(a == b for a, b in zip(ref, ker))
    print(
        f"{variant}: greedy continuations identical {same}/{len(ref)}; pallas / reference speed "
        f"{results[1]['output_tok_s'] / results[0]['output_tok_s']:.2f}x"
    )
    for i, (a, b) in enumerate(zip(ref, ker)):
        if a != b:
            first = next(j for j, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y)
            want, got = a[first : first + 4], b[first : first + 4]
            print(f"  prompt {i} diverges at token {first}: reference {want} kernel {got}")
    return same == len(ref)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated: none (float weights), a --quantization scheme, or kv-fp8 / kv-int8 (an "
        "8-bit KV cache); default none,int4,fp8,gguf,kv-fp8 (--smoke: kv-fp8)",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (for a CPU)")
    args = p.parse_args(argv)
    args.max_num_batched_tokens = max(512, args.batch)
    if args.smoke:  # few and small compiled programs too
        args.max_tokens, args.batch, args.decode_tokens, args.max_num_batched_tokens = 4, 8, 4, 64
    args.variants = args.variants or ("kv-fp8" if args.smoke else "none,int4,fp8,gguf,kv-fp8")

    import jax

    from jaxserve.engine import EngineConfig
    from jaxserve.engine.builder import enable_compilation_cache
    from jaxserve.model.kv_cache import resolve_kv_cache_dtype
    from jaxserve.runner.kernels import pallas_unsupported_reason
    from jaxserve.weights import load_model

    enable_compilation_cache()  # $JAXSERVE_CACHE's, as the engine scripts use
    device = jax.devices()[0]
    results, status = {}, 0
    for variant in args.variants.split(","):
        quantization = None if variant == "none" or variant.startswith("kv-") else variant
        kv_cache_dtype = variant[3:] if variant.startswith("kv-") else "auto"
        loaded = load_model(None, dtype=args.dtype, progress=False, quantization=quantization)
        reason = pallas_unsupported_reason(
            loaded.config,
            args.dtype,
            EngineConfig.block_size,
            device,
            resolve_kv_cache_dtype(kv_cache_dtype, args.dtype),
        )
        # NOTE: the reference first: the Pallas matmul backend converts the model's layers in place.
        backends = ["reference"] + ([] if reason else ["pallas"])
        results[variant] = [run_backend(loaded, b, kv_cache_dtype, args) for b in backends]
        del loaded

    print(f"default model, {args.dtype}, {device.device_kind}")
    print(f"| {'variant':<8} | {'backend':<10} | {f'output tok/s (batch {args.batch})':>24} |")
    print(f"|{'-' * 10}|{'-' * 12}|{'-' * 26}|")
    for variant, rows in results.items():
        for r in rows:
            print(f"| {variant:<8} | {r['backend']:<10} | {r['output_tok_s']:>24.1f} |")
    for variant, rows in results.items():
        if len(rows) == 2 and not compare(variant, rows):
            status = 1
    if any(len(rows) == 1 for rows in results.values()):
        print(f"Pallas backends not run: {reason}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
