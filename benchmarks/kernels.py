"""Kernel microbenchmark: the Mosaic GPU ragged paged attention against the XLA reference.

Decode at batch 1, 8, 64, 256 over contexts 512..32k (32 query heads, 8 KV heads,
head_dim 128, pages of 16, bf16) and three prefill cases, each checked against
`ragged_paged_attention_reference` before it is timed. Reported per case:

- the kernel's time (`plan_work` included, as a model layer calls it; and with the plan
  made once per step and reused, as every layer after the first can), the reference's;
- achieved HBM bandwidth: the K/V pages the sequences own (whole pages, every KV head)
  plus q and the output, over the kernel's time, and its share of the device-to-device
  copy bandwidth (read + write of a 1 GiB buffer) measured in the same run;
- TFLOP/s for prefill (causal: 4 * D * H flops per visible (query, key) pair).

Times are GPU times summed over the call's kernels, from CUPTI (Mosaic GPU's profiler),
median of several runs after warm-up, on fresh random data; when CUPTI is not available
(or on CPU) they are wall-clock times of back-to-back calls ended by block_until_ready.

    python benchmarks/kernels.py [--json PATH] [--plot PATH]   # on a Hopper GPU
    python benchmarks/kernels.py --smoke [--interpret]         # tiny shapes, runs on CPU

On CPU (--smoke) only the reference is timed, unless --interpret also runs the kernel
in the Mosaic GPU interpreter (correctness only: its times mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import ragged_paged_attention_mgpu as mgpu  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Model:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    max_context: int  # sizes the block table and page pool, so contexts share one program
    prefill: bool = False


def decode_cases(batches, contexts, max_tokens_in_cache):
    cases = []
    for b in batches:
        ctxs = [c for c in contexts if b * c <= max_tokens_in_cache]
        cases += [Case(f"decode b={b} ctx={c}", (1,) * b, (c,) * b, max(ctxs)) for c in ctxs]
    return cases


def full_cases():
    return decode_cases([1, 8, 64, 256], [512, 2048, 8192, 32768], 2 * 1024 * 1024) + [
        Case("prefill 4x2048", (2048,) * 4, (2048,) * 4, 2048, prefill=True),
        Case("prefill chunk 2048 on 16k", (2048,), (16384,), 16384, prefill=True),
        Case("mixed 1024 prefill + 63 decodes", (1024,) + (1,) * 63, (4096,) * 64, 4096, prefill=True),
    ]


def smoke_cases():
    return decode_cases([1, 4], [64, 256], 1024) + [Case("prefill 2x64", (64, 64), (64, 64), 64, prefill=True)]


# -- inputs ----------------------------------------------------------------------


def make_inputs(case: Case, model: Model, seed: int):
    """Random q and page pool, scrambled block tables, one table row per sequence."""
    ps, kv, d = model.page_size, model.num_kv_heads, model.head_dim
    dtype = jnp.dtype(model.dtype)
    max_pages = -(-case.max_context // ps)
    num_seqs = len(case.q_lens)
    num_pages = num_seqs * max_pages + 1
    rng = np.random.default_rng(seed)
    tables = (rng.permutation(num_pages - 1)[: num_seqs * max_pages] + 1).reshape(num_seqs, max_pages)
    qsl = np.concatenate([[0], np.cumsum(case.q_lens)]).astype(np.int32)
    kq, kk, kv_key = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (int(qsl[-1]), model.num_heads, d), dtype)
    k_pages = jax.random.normal(kk, (num_pages, ps, kv, d), dtype)
    v_pages = jax.random.normal(kv_key, (num_pages, ps, kv, d), dtype)
    return q, k_pages, v_pages, jnp.asarray(case.kv_lens, jnp.int32), jnp.asarray(tables, jnp.int32), jnp.asarray(qsl)


def hbm_bytes(case: Case, model: Model) -> int:
    """K/V pages the sequences own (every KV head) plus q and the output."""
    item = jnp.dtype(model.dtype).itemsize
    pages = sum(-(-n // model.page_size) for n in case.kv_lens)
    kv = 2 * pages * model.page_size * model.num_kv_heads * model.head_dim * item
    q_and_out = 2 * sum(case.q_lens) * model.num_heads * model.head_dim * item
    return kv + q_and_out


def attention_flops(case: Case, model: Model) -> int:
    """Causal: query at context position p sees p + 1 keys; QK and PV, 2 flops per MAC each."""
    pairs = sum(sum(range(kv - q + 1, kv + 1)) for q, kv in zip(case.q_lens, case.kv_lens))
    return 4 * model.head_dim * model.num_heads * pairs


# -- timing ----------------------------------------------------------------------


def _cupti_measure():
    try:
        from jax.experimental.mosaic.gpu import profiler
    except ImportError:
        return None
    return getattr(profiler, "measure", None)


@dataclasses.dataclass
class Timing:
    total_us: float  # median over runs of the call's GPU time (all kernels) or wall time
    largest_us: float | None  # median time of the call's longest kernel (CUPTI only)
    method: str  # "cupti", "wall" or "once" (interpreted: a time for the record only)
    kernels: list | None = None  # (name, us) of one run (CUPTI only)


def time_call(fn, args, *, runs: int, on_gpu: bool, once: bool = False) -> Timing:
    """GPU time of fn(*args) after warm-up: median of `runs` runs."""
    jax.block_until_ready(fn(*args))  # compile
    if once:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return Timing((time.perf_counter() - start) * 1e6, None, "once")
    jax.block_until_ready(fn(*args))
    measure = _cupti_measure() if on_gpu else None
    if measure is not None:
        try:
            _, per_run = measure(fn, aggregate=False, iterations=runs)(*args)
            if per_run:
                totals = [sum(ms for _, ms in run) * 1e3 for run in per_run]
                largest = [max(ms for _, ms in run) * 1e3 for run in per_run]
                kernels = [(name, round(ms * 1e3, 2)) for name, ms in per_run[-1]]
                return Timing(statistics.median(totals), statistics.median(largest), "cupti", kernels)
        except Exception as e:  # CUPTI missing or busy: fall back to wall clock
            print(f"  (CUPTI timing unavailable: {type(e).__name__}: {e}; using wall clock)", file=sys.stderr)
    samples = []
    for _ in range(max(3, runs // 2)):
        start = time.perf_counter()
        out = None
        for _ in range(5):  # back to back: dispatch overlaps the previous call
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / 5 * 1e6)
    return Timing(statistics.median(samples), None, "wall")


def copy_bandwidth(on_gpu: bool, runs: int) -> float:
    """Device-to-device copy bandwidth in GB/s: read + write of a 1 GiB (CPU: 64 MiB) buffer."""
    n = (1 << 30 if on_gpu else 1 << 26) // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * 2)  # one fused read + write pass
    us = time_call(copy, (x,), runs=runs, on_gpu=on_gpu).total_us
    return 2 * x.nbytes / (us * 1e-6) / 1e9


# -- one case --------------------------------------------------------------------


@functools.cache
def _jitted(name: str, scale: float, config=None, interpret: bool = False):
    """One jitted function per (kind, config): cases of the same shapes share its compilation."""
    interp = True if interpret else None
    if name == "reference":
        return jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=scale))
    if name == "kernel":
        return jax.jit(functools.partial(mgpu.ragged_paged_attention, sm_scale=scale, config=config, interpret=interp))
    if name == "plan":
        return jax.jit(mgpu.plan_work, static_argnames=("num_tokens", "num_kv_heads", "config", "sliding_window"))

    @jax.jit
    def with_plan(plan, *args):
        return mgpu.ragged_paged_attention(*args, sm_scale=scale, plan=plan, interpret=interp)

    return with_plan


def run_case(case: Case, model: Model, *, on_gpu: bool, run_kernel: bool, interpret: bool, runs: int, seed: int):
    args = make_inputs(case, model, seed)
    q, _, _, kv_lens, tables, qsl = args
    num_tokens, num_seqs = q.shape[0], tables.shape[0]
    scale = model.head_dim**-0.5
    reference = _jitted("reference", scale)
    want = reference(*args)
    row = dict(case=case.name, tokens=num_tokens, seqs=num_seqs, hbm_bytes=hbm_bytes(case, model),
               flops=attention_flops(case, model), prefill=case.prefill)
    ref = time_call(reference, args, runs=runs, on_gpu=on_gpu)
    row["ref_us"], row["timing"] = ref.total_us, ref.method
    if not run_kernel:
        return row

    config = mgpu.default_config(num_tokens, num_seqs, model.num_heads, model.num_kv_heads, model.head_dim,
                                 model.page_size)
    if interpret:
        config = dataclasses.replace(config, num_ctas=4)
    kernel = _jitted("kernel", scale, config, interpret)
    got = kernel(*args)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    row["max_abs_err"] = err
    if not err <= 2e-2:
        raise AssertionError(f"{case.name}: kernel differs from the reference by {err}")

    plan = _jitted("plan", scale)(kv_lens, qsl, num_tokens=num_tokens, num_kv_heads=model.num_kv_heads, config=config)
    with_plan = _jitted("with_plan", scale, None, interpret)
    row["config"] = dataclasses.asdict(config)
    full = time_call(kernel, args, runs=runs, on_gpu=on_gpu, once=interpret)
    reused = time_call(with_plan, (plan, *args), runs=runs, on_gpu=on_gpu, once=interpret)
    row["kernel_us"], row["kernel_plan_reused_us"] = full.total_us, reused.total_us
    if full.largest_us is not None:  # the Mosaic kernel is the call's longest by far
        row["main_kernel_us"] = full.largest_us
        row["kernels"] = full.kernels
    return row


def summarize(row: dict, copy_gbs: float) -> dict:
    for key in ("kernel_us", "kernel_plan_reused_us", "main_kernel_us", "ref_us"):
        if key in row:
            name = key.removesuffix("_us")
            row[f"{name}_gbs"] = row["hbm_bytes"] / (row[key] * 1e-6) / 1e9
            row[f"{name}_tflops"] = row["flops"] / (row[key] * 1e-6) / 1e12
    if "kernel_us" in row:
        row["kernel_copy_share"] = row["kernel_gbs"] / copy_gbs
        row["kernel_plan_reused_copy_share"] = row["kernel_plan_reused_gbs"] / copy_gbs
        row["speedup"] = row["ref_us"] / row["kernel_us"]
    return row


def print_table(rows: list[dict], copy_gbs: float) -> None:
    print(f"\ncopy bandwidth (read + write): {copy_gbs:,.0f} GB/s")
    # kern: the whole call (plan, query gather, kernel, combine); reuse: with the plan made
    # once per step; main: the Mosaic kernel alone (CUPTI). GB/s and %copy: of the whole call.
    head = (f"{'case':34} {'ref us':>9} {'kern us':>9} {'reuse us':>9} {'main us':>9} {'GB/s':>7} {'%copy':>6} "
            f"{'reuse%':>6} {'main%':>6} {'TFLOP/s':>8} {'x ref':>6} {'err':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "kernel_us" not in r:
            print(f"{r['case']:34} {r['ref_us']:9.1f} {'-':>9} {'-':>9} {r['ref_gbs']:7.0f}  (reference only)")
            continue
        tflops = f"{r['kernel_tflops']:8.1f}" if r["prefill"] else f"{'':8}"
        main_us = f"{r['main_kernel_us']:9.1f}" if "main_kernel_us" in r else f"{'-':>9}"
        main_share = f"{100 * r['main_kernel_gbs'] / copy_gbs:5.0f}%" if "main_kernel_us" in r else f"{'-':>6}"
        print(f"{r['case']:34} {r['ref_us']:9.1f} {r['kernel_us']:9.1f} {r['kernel_plan_reused_us']:9.1f} {main_us} "
              f"{r['kernel_gbs']:7.0f} {100 * r['kernel_copy_share']:5.0f}% "
              f"{100 * r['kernel_plan_reused_copy_share']:5.0f}% {main_share} {tflops} {r['speedup']:6.1f} "
              f"{r['max_abs_err']:8.1e}")


def plot(rows: list[dict], copy_gbs: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bw, speed) = plt.subplots(1, 2, figsize=(13, 5))
    decode = [r for r in rows if not r["prefill"]]
    for b in sorted({r["seqs"] for r in decode}):
        mine = [r for r in decode if r["seqs"] == b]
        ctx = [int(r["case"].split("ctx=")[1]) for r in mine]
        line = bw.plot(ctx, [r["ref_gbs"] for r in mine], "--", alpha=0.6)[0]
        if "kernel_us" in mine[0]:
            bw.plot(ctx, [r["kernel_plan_reused_gbs"] for r in mine], "o-", color=line.get_color(),
                    label=f"kernel b={b} (plan reused)")
            bw.plot(ctx, [r["kernel_gbs"] for r in mine], ":", color=line.get_color(), label=f"kernel b={b} (+ plan)")
        line.set_label(f"reference b={b}")
    bw.axhline(copy_gbs, color="k", lw=1, label="copy bandwidth")
    bw.axhline(0.7 * copy_gbs, color="k", lw=1, ls="--", label="70% of copy (target)")
    bw.set(xscale="log", xlabel="context (tokens)", ylabel="GB/s (K/V + q + out)", title="decode: achieved HBM bandwidth")
    bw.legend(fontsize=7)
    timed = [r for r in rows if "kernel_us" in r]
    speed.barh([r["case"] for r in timed], [r["speedup"] for r in timed])
    speed.axvline(2.0, color="r", lw=1, ls="--", label="2x target")
    speed.set(xlabel="reference time / kernel time", title="speed-up over the XLA reference")
    speed.tick_params(axis="y", labelsize=7)
    speed.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU)")
    parser.add_argument("--interpret", action="store_true", help="run the kernel in the Mosaic GPU interpreter")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per case (median)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    args = parser.parse_args(argv)

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    run_kernel = on_gpu or args.interpret
    model = Model(num_heads=4, num_kv_heads=2, head_dim=64) if args.smoke else Model()
    cases = smoke_cases() if args.smoke else full_cases()
    print(f"jax {jax.__version__} on {device.device_kind}; {model}")
    if not run_kernel:
        print("no GPU: timing the reference only (--interpret also checks the kernel, interpreted)")

    start = time.perf_counter()
    copy_gbs = copy_bandwidth(on_gpu, args.runs)
    rows = []
    for i, case in enumerate(cases):
        row = run_case(case, model, on_gpu=on_gpu, run_kernel=run_kernel, interpret=args.interpret and not on_gpu,
                       runs=args.runs, seed=i)
        rows.append(summarize(row, copy_gbs))
        print(f"  {case.name}: done ({time.perf_counter() - start:.0f}s)", flush=True)
    print_table(rows, copy_gbs)

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        result = dict(jax=jax.__version__, device=device.device_kind, model=dataclasses.asdict(model),
                      copy_gbs=copy_gbs, cases=rows)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"results written to {args.json}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(rows, copy_gbs, args.plot)


if __name__ == "__main__":
    main()
