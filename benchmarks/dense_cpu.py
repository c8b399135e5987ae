"""A decode batch's float projections alone, on the CPU: the C++ dense kernel
(`cpu_kernels.dense_matmuls`, what a float model's layers run for 9 to 64 rows) against XLA's
dot, on a chain of decoder layers at the default model's shapes (SmolLM2-135M: hidden 576,
q/k/v 576 + 192 + 192, intermediate 1536, 30 layers, float32; random weights, each layer its
own, so that they stream from memory as a step's do).

Each layer runs its four products (q/k/v as one call, o_proj, gate/up as one call, down) with
the residual adds and SiLU between them in XLA, so the only difference between the two paths
is who computes the products. The paths alternate (A B B A) over `--rounds`; reported per row
count: the best wall and CPU time (this process, all threads) of a pass over the layers, the
products' GFLOP/s per wall second and per CPU second, and the kernel's speed-up.

    python benchmarks/dense_cpu.py [--rows 16,32,48,64] [--rounds 2] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_time import best_alternated  # noqa: E402

HIDDEN, QKV, INTERMEDIATE = 576, (576, 192, 192), 1536


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="16,32,48,64", help="comma-separated rows per step (at most 64)")
    p.add_argument("--layers", type=int, default=30, help="decoder layers, each its own weights")
    p.add_argument("--rounds", type=int, default=2, help="A B B A rounds (each path twice a round)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per path and round (the best counts)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p.parse_args(argv)


def layer_flops(rows: int) -> int:
    """Multiply-adds x 2 of one layer's products."""
    return 2 * rows * (HIDDEN * sum(QKV) + QKV[0] * HIDDEN + HIDDEN * 2 * INTERMEDIATE + INTERMEDIATE * HIDDEN)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.weights.load import default_cache_dir
    from pallas_kernels import cpu_kernels

    if (reason := cpu_kernels.build(default_cache_dir())) is not None:
        print(f"the CPU kernels cannot run here: {reason}", file=sys.stderr)
        return 1
    rows_list = [int(r) for r in args.rows.split(",")]
    if max(rows_list) > cpu_kernels.DENSE_MAX_ROWS:
        print(f"--rows: at most {cpu_kernels.DENSE_MAX_ROWS}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)

    def weight(k, n):
        return jnp.asarray(rng.standard_normal((k, n), np.float32) / np.sqrt(k))

    layers = [
        dict(
            qkv=[weight(HIDDEN, n) for n in QKV],
            o=weight(QKV[0], HIDDEN),
            gate_up=[weight(HIDDEN, INTERMEDIATE), weight(HIDDEN, INTERMEDIATE)],
            down=weight(INTERMEDIATE, HIDDEN),
        )
        for _ in range(args.layers)
    ]

    def norm(x):  # RMSNorm without a weight, as each half of a layer starts
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)

    def chain(products):
        def run(x, layers):
            for w in layers:
                q, _, _ = products(norm(x), w["qkv"])
                x = x + products(q, [w["o"]])[0]
                gate, up = products(norm(x), w["gate_up"])
                x = x + products(jax.nn.silu(gate) * up, [w["down"]])[0]
            return x

        return jax.jit(run)

    paths = {
        "xla": chain(lambda x, ws: [x @ w for w in ws]),
        "kernel": chain(cpu_kernels.dense_matmuls),
    }
    results = []
    for rows in rows_list:
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN), np.float32))
        want = np.asarray(paths["xla"](x, layers))
        got = np.asarray(paths["kernel"](x, layers))
        err = float(np.abs(got - want).max() / np.abs(want).max())
        calls = {name: lambda path=path: path(x, layers).block_until_ready() for name, path in paths.items()}
        best = best_alternated(calls, args.rounds, args.repeats)
        flops = layer_flops(rows) * args.layers
        row = {"rows": rows, "max_rel_diff": err}
        for name, (wall, cpu) in best.items():
            row[name] = {
                "ms": wall * 1e3,
                "cpu_ms": cpu * 1e3,
                "gflops": flops / wall / 1e9,
                "gflops_per_cpu_s": flops / cpu / 1e9,
            }
        row["speed_up"] = best["xla"][0] / best["kernel"][0]
        row["cpu_ratio"] = best["xla"][1] / best["kernel"][1]
        results.append(row)
    if args.json:
        print(json.dumps({"layers": args.layers, "results": results}, indent=2))
        return 0
    print(
        f"{args.layers} layers' products (hidden {HIDDEN}, intermediate {INTERMEDIATE}, float32), "
        f"best of {args.rounds} x 2 x {args.repeats} passes each"
    )
    print("| rows | path | ms | CPU ms | GFLOP/s | GFLOP/s per CPU-s | speed-up (wall, CPU) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for row in results:
        for name in paths:
            r = row[name]
            ratio = f"{row['speed_up']:.2f}x, {row['cpu_ratio']:.2f}x" if name == "kernel" else "1.00x"
            print(
                f"| {row['rows']} | {name} | {r['ms']:.1f} | {r['cpu_ms']:.1f} | {r['gflops']:.0f} | "
                f"{r['gflops_per_cpu_s']:.0f} | {ratio} |"
            )
    print(
        "largest difference between the paths, relative to the largest value:", max(r["max_rel_diff"] for r in results)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
