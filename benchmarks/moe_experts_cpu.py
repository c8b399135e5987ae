"""The experts of a MoE decode step alone, on the CPU: the C++ kernel (moe.run_touched_experts_in_cpp)
against the lax loop it replaces (moe.run_touched_experts), at benchmarks/moe_decode.py's shapes
(30 layers of 8 experts, hidden 576, expert 768, top 2, float32; random routing).

    python benchmarks/moe_experts_cpu.py [--tokens 1,2,4,16,48] [--repeats 5]

Prints the best of `repeats` jitted calls over all the layers, per path and token count.
"""

from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,2,4,16,48", help="comma-separated tokens per step")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per case (the best is reported)")
    p.add_argument("--layers", type=int, default=30, help="MoE layers, each its own weights")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxserve.model import moe
    from jaxserve.model.config import ModelConfig
    from jaxserve.weights.load import default_cache_dir
    from pallas_kernels import cpu_kernels

    if (reason := cpu_kernels.build(default_cache_dir())) is not None:
        print(f"the CPU kernels cannot run here: {reason}", file=sys.stderr)
        return 1
    cfg = ModelConfig(
        architecture="MixtralForCausalLM",
        vocab_size=97,
        hidden_size=576,
        intermediate_size=64,
        num_layers=1,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=768,
    )
    layers = [moe.Experts(cfg, jnp.float32, nnx.Rngs(i)) for i in range(args.layers)]
    print("| tokens | lax loop (ms) | C++ kernel (ms) |")
    print("|-------:|--------------:|----------------:|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        rng = np.random.default_rng(tokens)
        x = jnp.asarray(rng.standard_normal((tokens, 576)), jnp.float32)
        logits = jnp.asarray(rng.standard_normal((tokens, 8)), jnp.float32)
        weights, chosen = moe.route(logits, 2, norm_topk_prob=True, weights_in_float32=True)
        best = {}
        for name, run in (("loop", moe.run_touched_experts), ("cpp", moe.run_touched_experts_in_cpp)):
            step = jax.jit(lambda layers, x, run=run: [run(layer, x, weights, chosen, 8) for layer in layers])
            jax.block_until_ready(step(layers, x))
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                jax.block_until_ready(step(layers, x))
                times.append(time.perf_counter() - start)
            best[name] = 1e3 * min(times)
        print(f"| {tokens:6d} | {best['loop']:13.1f} | {best['cpp']:15.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
