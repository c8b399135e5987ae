"""A decode batch's attention alone, on the CPU: the C++ kernel (`cpu_kernels.ragged_paged_attention`,
what the engine's layers run) against the pure-JAX reference, at the default model's shapes
(SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, float32 K/V in pages of 16).

`--rows` sequences decode one token each, their contexts drawn uniformly from `--contexts`
(seeded); each of `--layers` layers has its own pages, so that the K/V stream from memory as
a step's do (a 64-row step at contexts 40-400 reads about 20 MB a layer). The paths alternate
(A B B A) over `--rounds`; reported per row count: the best wall and CPU time (this process,
all threads) of a pass over the layers, and the K/V bytes the sequences' contexts occupy per
wall second, per CPU second (per core busy) and the kernel's speed-up.

    python benchmarks/attention_cpu.py [--rows 8,32,64] [--contexts 40,400] [--rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_time import best_alternated  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="8,32,64", help="comma-separated decode rows (sequences) per step")
    p.add_argument("--contexts", default="40,400", help="the contexts' range, lo,hi (tokens, the new one included)")
    p.add_argument("--layers", type=int, default=30, help="layers, each its own K/V pages")
    p.add_argument("--rounds", type=int, default=2, help="A B B A rounds (each path twice a round)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per path and round (the best counts)")
    p.add_argument("--paths", default="reference,kernel", help="which of reference,kernel to run")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.weights.load import default_cache_dir
    from pallas_kernels import cpu_kernels
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

    if (reason := cpu_kernels.build(default_cache_dir())) is not None:
        print(f"the CPU kernels cannot run here: {reason}", file=sys.stderr)
        return 1
    lo, hi = (int(c) for c in args.contexts.split(","))
    fns = {"reference": ragged_paged_attention_reference, "kernel": cpu_kernels.ragged_paged_attention}
    names = args.paths.split(",")
    if not set(names) <= set(fns):
        print(f"--paths: a comma-separated subset of {','.join(fns)}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        kv_lens = rng.integers(lo, hi + 1, rows).astype(np.int32)
        pages = -(-kv_lens // PAGE)
        max_pages = int(pages.max())
        tables = np.zeros((rows, max_pages), np.int32)
        # Pages in a shuffled order, as a cache that has served a while hands them out.
        order = rng.permutation(int(pages.sum()))
        tables_at = np.concatenate([[0], np.cumsum(pages)])
        for s in range(rows):
            tables[s, : pages[s]] = order[tables_at[s] : tables_at[s + 1]]
        shape = (int(pages.sum()), PAGE, NUM_KV_HEADS, HEAD_DIM)
        kv = [
            (jnp.asarray(rng.standard_normal(shape, np.float32)), jnp.asarray(rng.standard_normal(shape, np.float32)))
            for _ in range(args.layers)
        ]
        q = jnp.asarray(rng.standard_normal((rows, NUM_HEADS, HEAD_DIM), np.float32))
        ints = jnp.asarray(kv_lens), jnp.asarray(tables), jnp.arange(rows + 1, dtype=jnp.int32)

        def chain(fn):
            def run(q, kv):  # each layer's output is the next one's query, as in a model
                for k, v in kv:
                    q = fn(q, k, v, *ints, sm_scale=HEAD_DIM**-0.5)
                return q

            return jax.jit(run)

        paths = {name: chain(fns[name]) for name in names}
        outs = {name: np.asarray(path(q, kv)) for name, path in paths.items()}
        err = max(float(np.abs(o - outs[names[0]]).max()) for o in outs.values())
        calls = {name: lambda path=path: path(q, kv).block_until_ready() for name, path in paths.items()}
        best = best_alternated(calls, args.rounds, args.repeats)
        kv_bytes = int(kv_lens.sum()) * NUM_KV_HEADS * HEAD_DIM * 2 * 4 * args.layers
        row = {"rows": rows, "mean_context": float(kv_lens.mean()), "kv_mb": kv_bytes / 1e6, "max_abs_diff": err}
        for name, (wall, cpu) in best.items():
            row[name] = {
                "ms": wall * 1e3,
                "cpu_ms": cpu * 1e3,
                "gb_s": kv_bytes / wall / 1e9,
                "gb_per_cpu_s": kv_bytes / cpu / 1e9,
            }
        if "reference" in best and "kernel" in best:
            row["speed_up"] = best["reference"][0] / best["kernel"][0]
            row["cpu_ratio"] = best["reference"][1] / best["kernel"][1]
        results.append(row)
    if args.json:
        print(json.dumps({"layers": args.layers, "results": results}, indent=2))
        return 0
    print(
        f"{args.layers} layers' decode attention ({NUM_HEADS} heads, {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, "
        f"float32, pages of {PAGE}, contexts {lo}-{hi}), best of {args.rounds} x 2 x {args.repeats} passes each"
    )
    print("| rows | mean context | K/V MB | path | ms | CPU ms | GB/s | GB/s per CPU-s | speed-up (wall, CPU) |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for row in results:
        for name in names:
            r = row[name]
            compared = name == "kernel" and "speed_up" in row
            ratio = f"{row['speed_up']:.2f}x, {row['cpu_ratio']:.2f}x" if compared else "1.00x"
            print(
                f"| {row['rows']} | {row['mean_context']:.0f} | {row['kv_mb']:.0f} | {name} | {r['ms']:.1f} | "
                f"{r['cpu_ms']:.1f} | {r['gb_s']:.1f} | {r['gb_per_cpu_s']:.1f} | {ratio} |"
            )
    print("largest difference between the paths:", max(r["max_abs_diff"] for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
