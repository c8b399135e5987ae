"""Expert parallelism's two dispatches, one MoE layer on forced CPU devices: all-reduce against all-to-all.

The layer is the MoE of benchmarks/moe_decode.py (Mixtral's layout at the default model's
width: hidden 576, E = 8 experts of intermediate 768, top 2), random float32 weights, its
experts split whole over tp devices as --enable-expert-parallel places them and the
activations replicated as attention leaves them (jaxserve.parallel.experts):

- all-reduce: every device runs its experts on the rows of all T tokens routed to them; a psum
  combines (the default);
- all-to-all: each device sends its T/tp tokens' rows to their experts' devices and back
  (each slot sized for the worst case, T/tp * k rows), then the token slices are gathered.

Each round times `--calls` calls of the jitted layer (router and experts) per variant, the
variants alternating (their order reversed every other round). Reported per tp and token
count: ms per layer call (the median over rounds of each round's median; the round medians'
spread in brackets), CPU time per token (process time, all threads), and all-to-all's time
over all-reduce's.

NOTE: forced CPU devices (jax_num_cpu_devices) are threads of one process on the same cores
(two on the machine these figures come from), so this measures the dispatches' own overhead
(sorting, scattering, buffer copies, the collectives as memory copies) and redundant work,
not an interconnect.

    python benchmarks/expert_dispatch.py [--tps 2,4] [--tokens 1,16,64,256] [--rounds 3] [--calls 5]
    python benchmarks/expert_dispatch.py --smoke --json dispatch.json   # a tiny layer, for a test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.moe_decode import hf_configs  # noqa: E402 (after the path)

DISPATCHES = ("all-reduce", "all-to-all")


def moe_layer(shape: str, experts: int, top_k: int):
    """A SparseMoE of random float32 weights in moe_decode's layout."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.model.config import ModelConfig
    from jaxserve.model.moe import SparseMoE

    cfg = ModelConfig.from_hf_dict(hf_configs(shape, experts, top_k)["moe"])
    return SparseMoE(cfg, jnp.float32, nnx.Rngs(0))


def layer_call(layer, mesh, dispatch: str):
    """The jitted layer with its experts split whole over `mesh` and tokens sent by `dispatch`:
    (call(x), the placed state)."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.parallel.experts import use_expert_parallel

    layer = nnx.merge(*nnx.split(layer))  # a copy of the modules: each variant sets its own runner
    use_expert_parallel(layer, mesh, dispatch)
    graphdef, state = nnx.split(layer)

    def placed(path, a):  # the experts split on E, the router replicated
        spec = P("model") if "experts" in map(str, path) else P()
        return jax.device_put(a, NamedSharding(mesh, spec))

    state = jax.tree.map_with_path(placed, state)
    step = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    return lambda x: step(state, x)


def time_calls(call, x, calls: int) -> dict:
    """Median seconds per call over `calls` calls, and process (CPU) seconds per token."""
    times, cpu = [], time.process_time()
    for _ in range(calls):
        start = time.perf_counter()
        call(x).block_until_ready()
        times.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    return {"call_s": statistics.median(times), "cpu_s_per_token": cpu / (calls * x.shape[0])}


def measure(args) -> list[dict]:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.parallel.sharding import make_mesh

    layer = moe_layer(args.shape, args.experts, args.top_k)
    d = layer.cfg.hidden_size
    rng = np.random.default_rng(0)
    rows = []
    for tp in args.tps:
        mesh = make_mesh(tp)
        calls = {name: layer_call(layer, mesh, name) for name in DISPATCHES}
        for tokens in args.tokens:
            x = jax.device_put(rng.standard_normal((tokens, d), np.float32), NamedSharding(mesh, P()))
            np.testing.assert_allclose(  # the same layer either way (and a warm-up: both compile here)
                np.asarray(calls["all-to-all"](x)), np.asarray(calls["all-reduce"](x)), atol=1e-4, rtol=0
            )
            runs: dict[str, list[dict]] = {name: [] for name in DISPATCHES}
            for r in range(args.rounds):
                for name in DISPATCHES if r % 2 == 0 else DISPATCHES[::-1]:
                    runs[name].append(time_calls(calls[name], x, args.calls))
            row = {"tp": tp, "tokens": tokens}
            for name, results in runs.items():
                steps = [res["call_s"] for res in results]
                row[name] = {
                    "call_ms": 1e3 * statistics.median(steps),
                    "spread_ms": 1e3 * (max(steps) - min(steps)),
                    "cpu_ms_per_token": 1e3 * statistics.median(res["cpu_s_per_token"] for res in results),
                }
            row["a2a_over_allreduce"] = row["all-to-all"]["call_ms"] / row["all-reduce"]["call_ms"]
            rows.append(row)
            print(f"tp {tp}, {tokens} tokens: done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| tp | tokens | dispatch   | ms / layer call [spread] | CPU ms / token | all-to-all / all-reduce |",
        "|---:|-------:|------------|-------------------------:|---------------:|------------------------:|",
    ]
    for row in rows:
        for name in DISPATCHES:
            m = row[name]
            ratio = f"{row['a2a_over_allreduce']:.2f}" if name == "all-to-all" else ""
            call = f"{m['call_ms']:.3f} [{m['spread_ms']:.3f}]"
            lines.append(
                f"| {row['tp']:>2} | {row['tokens']:>6} | {name:<10} | {call:>24} | "
                f"{m['cpu_ms_per_token']:>14.3f} | {ratio:>23} |"
            )
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tps", default="2,4", help="devices to split the experts over (comma-separated)")
    p.add_argument("--tokens", default="1,16,64,256", help="tokens per layer call (comma-separated)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=5, help="timed calls per variant and round")
    p.add_argument("--smoke", action="store_true", help="a tiny layer (moe_decode's smoke shape)")
    p.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = p.parse_args(argv)
    args.tps = [int(t) for t in args.tps.split(",")]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.shape = "smoke" if args.smoke else "default"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from jaxserve.parallel.devices import ensure_host_devices

    ensure_host_devices(max(args.tps))
    import jax

    if jax.devices()[0].platform != "cpu" or len(jax.devices()) < max(args.tps):
        raise SystemExit(f"needs {max(args.tps)} CPU devices, have {jax.devices()}")
    rows = measure(args)
    print(f"MoE layer: {args.shape} shape, {args.experts} experts, top {args.top_k}, float32, forced CPU devices")
    print(table(rows))
    if args.json:
        setup = {k: getattr(args, k) for k in ("shape", "experts", "top_k", "rounds", "calls")}
        Path(args.json).write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
