"""Kernel microbenchmarks: the Mosaic GPU kernels against XLA.

Attention (`--only attention`): the ragged paged attention kernel against its XLA reference.

Decode at batch 1, 8, 64, 256 over contexts 512..32k (32 query heads, 8 KV heads,
head_dim 128, pages of 16, bf16) and three prefill cases, each checked against
`ragged_paged_attention_reference` before it is timed. Reported per case:

- the kernel's time (`plan_work` included, as a model layer calls it; and with the plan
  made once per step and reused, as every layer after the first can), the reference's;
- achieved HBM bandwidth: the K/V pages the sequences own (whole pages, every KV head)
  plus q and the output, over the kernel's time, and its share of the device-to-device
  copy bandwidth (read + write of a 1 GiB buffer) measured in the same run;
- TFLOP/s for prefill (causal: 4 * D * H flops per visible (query, key) pair).

Quantized matmuls (`--only matmul`): at Llama-3-8B's projection shapes (fused QKV
4096 x 6144, gate/up 4096 x 14336, down 14336 x 4096) for 1..256 tokens, the bf16 XLA dot
against the W4A16 (int4, group 128), FP8 W8A8 and dense bf16 Mosaic GPU kernels (each with the
plain and the warp-specialized pipeline; the dense one also batch-invariant, "dense_inv"),
each checked against its reference (the dense one against XLA's dot) first: time, achieved
GB/s (weights + x + output) and its share of the copy bandwidth, TFLOP/s, and the speed-up over bf16 per token count.
The random weights are made on the device (jitted), canonical and in the kernel layout.

Grouped matmuls (`--only gmm`, MoE experts): at Qwen3-30B-A3B's expert shapes (hidden 2048,
expert intermediate 768, fused gate/up 2048 x 1536 and down 768 x 2048; 128 experts, top-8
of a random router) for 8..2048 tokens, XLA's `jax.lax.ragged_dot` (bf16) against the
Mosaic GPU grouped kernels (bf16, int4, fp8 experts), each checked against its reference:
time, GB/s (the weights of the experts with rows, x and the output), TFLOP/s, speed-up
over ragged_dot. No plot.

`--quick` (what `benchmarks/gpu_check.sh` runs) keeps one program per batch size:
decode at batch 1, 8, 64, 256 with contexts 2k and 32k (where the 2M-token pool holds
them), two prefill cases, the matmuls at 1 and 64 tokens, and the grouped gate/up at 8
and 2048 tokens.

Each case's row is printed and the JSON file rewritten as soon as the case finishes, so a
run cut short keeps every finished row. A case whose kernel differs from its reference
(or that raises) is marked in its row (`ok: false`, MISMATCH / ERROR in the table) and the
next case runs; the exit status is 1 if any case was so marked.

Times are GPU times summed over the call's kernels, from CUPTI (Mosaic GPU's profiler),
median of several runs after warm-up, on fresh random data; when CUPTI is not available
(or on CPU) they are wall-clock times of back-to-back calls ended by block_until_ready.
Every timed call runs the operation on several copies of its inputs in turn (enough
that they do not fit in L2 together) and reports the time per copy, so small cases are
not timed on L2 hits.

    python benchmarks/kernels.py [--only attention|matmul|gmm] [--quick] [--json PATH] [--plot PATH]  # on a Hopper GPU
    python benchmarks/kernels.py --smoke [--interpret]         # tiny shapes, runs on CPU

On CPU (--smoke) only the reference is timed, unless --interpret also runs the kernel
in the Mosaic GPU interpreter (correctness only: its times mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.tools import roofs  # noqa: E402
from pallas_kernels import grouped_matmul_mgpu as gmm  # noqa: E402
from pallas_kernels import quantized_matmul_mgpu as qmgpu  # noqa: E402
from pallas_kernels import ragged_paged_attention_mgpu as mgpu  # noqa: E402
from pallas_kernels.grouped_matmul import (  # noqa: E402
    fp8_grouped_matmul_reference,
    grouped_matmul_reference,
    int4_grouped_matmul_reference,
)
from pallas_kernels.quantized_matmul import fp8_matmul_reference, int4_matmul_reference  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference  # noqa: E402

L2_BYTES = 50 * 2**20  # H100 / H200 L2 cache
ATTENTION_TOL = 2e-2  # max abs error against the reference (bf16 outputs of order one)
MATMUL_TOL = 2 * 2**-7  # relative error, two bf16 rounding steps (see rel_err)


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


PREFILL_4X2048 = Case("prefill 4x2048", (2048,) * 4, (2048,) * 4, 2048, prefill=True)
PREFILL_CHUNK = Case("prefill chunk 2048 on 16k", (2048,), (16384,), 16384, prefill=True)
MIXED = Case("mixed 1024 prefill + 63 decodes", (1024,) + (1,) * 63, (4096,) * 64, 4096, prefill=True)


def full_cases():
    return decode_cases([1, 8, 64, 256], [512, 2048, 8192, 32768], 2 * 1024 * 1024) + [
        PREFILL_4X2048,
        PREFILL_CHUNK,
        MIXED,
    ]


def quick_cases():
    """Every batch size (each is one compiled program: its contexts share it) at a short and
    a long context, and two of the prefill cases: about half the full set's time."""
    return decode_cases([1, 8, 64, 256], [2048, 32768], 2 * 1024 * 1024) + [PREFILL_4X2048, MIXED]


def smoke_cases():
    return decode_cases([1, 4], [64, 256], 1024) + [Case("prefill 2x64", (64, 64), (64, 64), 64, prefill=True)]


# -- results, row by row ---------------------------------------------------------


class Results:
    """The run's results: written to `path` again after every row (to a temporary file
    renamed over the old one), so a run killed by a timeout keeps every finished row."""

    def __init__(self, path: str | None, **fields):
        self.path = Path(path) if path else None
        self.data = dict(fields)
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def update(self, **fields) -> None:
        self.data.update(fields)
        self.write()

    def add(self, group: str, row: dict) -> None:
        self.data.setdefault(group, []).append(row)
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)

    def failed(self) -> list[str]:
        """The cases marked as failed (a kernel unlike its reference, or an error)."""
        return [
            r["case"] for rows in self.data.values() if isinstance(rows, list) for r in rows if r.get("ok") is False
        ]


def run_rows(results: Results, group: str, cases: list, run_one, line, name=lambda case: case.name) -> list[dict]:
    """run_one(case) for each case; each row recorded and printed (`line(row)`) as it
    finishes. An exception is recorded in its case's row and the next case runs: one
    broken case must not cost the others their figures."""
    rows = []
    for case in cases:
        start = time.perf_counter()
        try:
            row = run_one(case)
        except Exception as e:
            row = dict(case=name(case), ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        results.add(group, row)
        print(line(row), flush=True)
    return rows


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


def copies_for(bytes_per_call: int, on_gpu: bool) -> int:
    """How many input copies a timed call rotates through: their bytes together at least
    twice the L2 (2 to 32 copies; 1 on CPU, where it does not matter)."""
    return max(2, min(32, -(-2 * L2_BYTES // max(1, bytes_per_call)))) if on_gpu else 1


@functools.cache
def rotated(fn):
    """fn applied to each argument tuple of a list, in one jitted call (every output kept)."""
    return jax.jit(lambda arg_sets: [fn(*args) for args in arg_sets])


def first_output(fn, arg_sets: list):
    """Compile the timed program (`rotated(fn)`) and run it once: its first copy's output is
    what the numerics check compares, so checking costs no compilation of its own."""
    return jax.block_until_ready(rotated(fn)(arg_sets))[0]


def time_rotated(fn, arg_sets: list, **kwargs) -> Timing:
    """`time_call` of fn over several copies of its inputs in turn, per copy."""
    timing = time_call(rotated(fn), (arg_sets,), **kwargs)
    timing.total_us /= len(arg_sets)
    return timing


def time_variant(row: dict, variant: str, fn, arg_sets, bytes_: int, copies, *, runs: int, on_gpu: bool, once: bool):
    """Time one variant of a matmul case and write its figures into `row` (needs row["flops"])."""
    timing = time_rotated(fn, arg_sets, runs=runs, on_gpu=on_gpu, once=once)
    us = timing.total_us
    row[f"{variant}_us"], row[f"{variant}_bytes"] = us, bytes_
    row[f"{variant}_gbs"] = bytes_ / (us * 1e-6) / 1e9
    row[f"{variant}_tflops"] = row["flops"] / (us * 1e-6) / 1e12
    row["timing"], row[f"{variant}_copies"] = timing.method, copies


def time_call(fn, args, *, runs: int, on_gpu: bool, once: bool = False) -> Timing:
    """GPU time of fn(*args) after warm-up: median of `runs` runs."""
    jax.block_until_ready(fn(*args))  # compile (if first_output has not)
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


# -- one attention case ----------------------------------------------------------


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
    copies = copies_for(hbm_bytes(case, model), on_gpu and not interpret)
    arg_sets = [make_inputs(case, model, seed + 1000 * i) for i in range(copies)]
    args = arg_sets[0]
    q, _, _, kv_lens, tables, qsl = args
    num_tokens, num_seqs = q.shape[0], tables.shape[0]
    scale = model.head_dim**-0.5
    reference = _jitted("reference", scale)
    row = dict(
        case=case.name,
        tokens=num_tokens,
        seqs=num_seqs,
        hbm_bytes=hbm_bytes(case, model),
        flops=attention_flops(case, model),
        prefill=case.prefill,
    )
    want = first_output(reference, arg_sets)
    ref = time_rotated(reference, arg_sets, runs=runs, on_gpu=on_gpu)
    row["ref_us"], row["timing"], row["copies"] = ref.total_us, ref.method, copies
    if not run_kernel:
        return row

    config = mgpu.default_config(
        num_tokens, num_seqs, model.num_heads, model.num_kv_heads, model.head_dim, model.page_size
    )
    if interpret:
        config = dataclasses.replace(config, num_ctas=4)
    kernel = _jitted("kernel", scale, config, interpret)
    got = first_output(kernel, arg_sets)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    row["max_abs_err"], row["ok"] = err, err <= ATTENTION_TOL  # NaN is not ok
    del got, want

    plan = _jitted("plan", scale)(kv_lens, qsl, num_tokens=num_tokens, num_kv_heads=model.num_kv_heads, config=config)
    with_plan = _jitted("with_plan", scale, None, interpret)
    row["config"] = dataclasses.asdict(config)
    full = time_rotated(kernel, arg_sets, runs=runs, on_gpu=on_gpu, once=interpret)
    reused = time_rotated(functools.partial(with_plan, plan), arg_sets, runs=runs, on_gpu=on_gpu, once=interpret)
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


def check_mark(row: dict) -> str:
    """The table's last column: what the numerics check said."""
    if "error" in row:
        return f"ERROR {row['error'].splitlines()[0][:200]}"
    return {True: "ok", False: "MISMATCH", None: "-"}[row.get("ok")]


def attention_header(copy_gbs: float) -> str:
    # kern: the whole call (plan, query gather, kernel, combine); reuse: with the plan made
    # once per step; main: the Mosaic kernel alone (CUPTI). GB/s and %copy: of the whole call.
    head = (
        f"{'case':34} {'ref us':>9} {'kern us':>9} {'reuse us':>9} {'main us':>9} {'GB/s':>7} {'%copy':>6} "
        f"{'reuse%':>6} {'main%':>6} {'TFLOP/s':>8} {'x ref':>6} {'err':>8} check"
    )
    return f"\ncopy bandwidth (read + write): {copy_gbs:,.0f} GB/s\n{head}\n{'-' * len(head)}"


def attention_line(r: dict, copy_gbs: float) -> str:
    if "ref_us" not in r:  # it raised before the reference was timed
        return f"{r['case']:34} {check_mark(r)}"
    if "kernel_us" not in r:
        ref_only = f"{r['case']:34} {r['ref_us']:9.1f} {'-':>9} {'-':>9} {'-':>9} {r['ref_gbs']:7.0f}  (reference only)"
        return ref_only if "error" not in r else f"{ref_only} {check_mark(r)}"
    tflops = f"{r['kernel_tflops']:8.1f}" if r["prefill"] else f"{'':8}"
    main_us = f"{r['main_kernel_us']:9.1f}" if "main_kernel_us" in r else f"{'-':>9}"
    main_share = f"{100 * r['main_kernel_gbs'] / copy_gbs:5.0f}%" if "main_kernel_us" in r else f"{'-':>6}"
    return (
        f"{r['case']:34} {r['ref_us']:9.1f} {r['kernel_us']:9.1f} {r['kernel_plan_reused_us']:9.1f} {main_us} "
        f"{r['kernel_gbs']:7.0f} {100 * r['kernel_copy_share']:5.0f}% "
        f"{100 * r['kernel_plan_reused_copy_share']:5.0f}% {main_share} {tflops} {r['speedup']:6.1f} "
        f"{r['max_abs_err']:8.1e} {check_mark(r)}"
    )


def plot(rows: list[dict], copy_gbs: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "ref_us" in r]  # not the cases that raised
    fig, (bw, speed) = plt.subplots(1, 2, figsize=(13, 5))
    decode = [r for r in rows if not r["prefill"]]
    for b in sorted({r["seqs"] for r in decode}):
        mine = [r for r in decode if r["seqs"] == b]
        ctx = [int(r["case"].split("ctx=")[1]) for r in mine]
        line = bw.plot(ctx, [r["ref_gbs"] for r in mine], "--", alpha=0.6)[0]
        if all("kernel_us" in r for r in mine):
            bw.plot(
                ctx,
                [r["kernel_plan_reused_gbs"] for r in mine],
                "o-",
                color=line.get_color(),
                label=f"kernel b={b} (plan reused)",
            )
            bw.plot(ctx, [r["kernel_gbs"] for r in mine], ":", color=line.get_color(), label=f"kernel b={b} (+ plan)")
        line.set_label(f"reference b={b}")
    bw.axhline(copy_gbs, color="k", lw=1, label="copy bandwidth")
    bw.axhline(0.7 * copy_gbs, color="k", lw=1, ls="--", label="70% of copy (target)")
    bw.set(
        xscale="log", xlabel="context (tokens)", ylabel="GB/s (K/V + q + out)", title="decode: achieved HBM bandwidth"
    )
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


def run_attention(args, results: Results, on_gpu: bool, run_kernel: bool, copy_gbs: float) -> list[dict]:
    model = Model(num_heads=4, num_kv_heads=2, head_dim=64) if args.smoke else Model()
    cases = smoke_cases() if args.smoke else quick_cases() if args.quick else full_cases()
    results.update(model=dataclasses.asdict(model))
    print(f"attention: {model}, {len(cases)} cases")
    print(attention_header(copy_gbs), flush=True)
    seeds = {case.name: i for i, case in enumerate(cases)}

    def one(case: Case) -> dict:
        row = run_case(
            case,
            model,
            on_gpu=on_gpu,
            run_kernel=run_kernel,
            interpret=args.interpret and not on_gpu,
            runs=args.runs,
            seed=seeds[case.name],
        )
        return summarize(row, copy_gbs)

    return run_rows(results, "cases", cases, one, lambda r: attention_line(r, copy_gbs))


# -- quantized matmuls -----------------------------------------------------------

# (name, K, N): Llama-3-8B's fused QKV, gate/up and down projections.
MATMUL_SHAPES = [("qkv", 4096, 6144), ("gate_up", 4096, 14336), ("down", 14336, 4096)]
MATMUL_TOKENS = [1, 8, 16, 32, 64, 128, 256]
QUICK_MATMUL_TOKENS = [1, 64]
SMOKE_MATMUL_SHAPES = [("small", 256, 192)]
SMOKE_MATMUL_TOKENS = [1, 8]
INT4_GROUP = 128


@functools.partial(jax.jit, static_argnames=("kind", "k", "n", "kernel_layout"))
def make_matmul_weights(key, *, kind: str, k: int, n: int, kernel_layout: bool):
    """A random [K, N] weight of `kind` made on the device: (its canonical arrays, the
    references' arguments; its kernel layout, or None)."""
    k1, k2 = jax.random.split(key)
    if kind == "bf16":  # the dense kernel takes the weight as stored: its "layout" is the weight itself
        w = jax.random.normal(k1, (k, n), jnp.bfloat16) * 0.02
        return (w,), w if kernel_layout else None
    if kind == "int4":
        packed = jax.random.randint(k1, (k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
        scales = jax.random.uniform(k2, (k // INT4_GROUP, n), jnp.float32, 1e-3, 2e-3)
        canonical = (packed, scales, -8 * scales)
        return canonical, qmgpu.prepare_int4(*canonical) if kernel_layout else None
    # NOTE: clipped to e4m3's largest finite value: a cast of anything larger gives NaN (a 59M-element
    # weight would hold hundreds), and NaN outputs never compare equal.
    fp8 = jnp.clip(jax.random.normal(k1, (k, n), jnp.float32) * 100, -448, 448).astype(jnp.float8_e4m3fn)
    canonical = (fp8, jax.random.uniform(k2, (n,), jnp.float32, 1e-4, 2e-4))
    return canonical, qmgpu.prepare_fp8(*canonical) if kernel_layout else None


def matmul_bytes(variant: str, t: int, k: int, n: int) -> int:
    """HBM bytes a call must move: the weights (with scales), x and the bf16 output."""
    weights = {"bf16": 2 * k * n, "int4": k * n // 2 + 2 * 4 * (k // INT4_GROUP) * n, "fp8": k * n + 4 * n}[variant]
    return weights + 2 * t * k + 2 * t * n


def _bf16_dot(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


REFERENCES = {"int4": int4_matmul_reference, "fp8": fp8_matmul_reference, "bf16": _bf16_dot}


def matmul_variants(run_kernel: bool, interpret: bool) -> dict[str, tuple]:
    """variant -> (weight kind, function, whether it takes the kernel layout). On a GPU (or
    interpreted) each kernel with the plain and the warp-specialized pipeline ("_ws"); on
    the CPU the references the kernels replace."""
    variants = {"bf16": ("bf16", _bf16_dot, False)}
    if not run_kernel:
        return variants | {kind: (kind, ref, False) for kind, ref in REFERENCES.items() if kind != "bf16"}
    interp = True if interpret else None
    for ws in (False, True):
        config = qmgpu.TuningConfig(warp_specialized=ws)
        suffix = "_ws" if ws else ""
        variants["int4" + suffix] = (
            "int4",
            functools.partial(qmgpu.int4_matmul, config=config, interpret=interp),
            True,
        )
        variants["fp8" + suffix] = ("fp8", functools.partial(qmgpu.fp8_matmul, config=config, interpret=interp), True)
        variants["dense" + suffix] = (
            "bf16",
            functools.partial(qmgpu.dense_matmul, config=config, interpret=interp),
            True,
        )
    invariant = functools.partial(qmgpu.dense_matmul, batch_invariant=True, interpret=interp)
    variants["dense_inv"] = ("bf16", invariant, True)
    return variants


def rel_err(got, want) -> float:
    """Max error relative to each output's magnitude, floored at 1% of the largest (sums that cancel)."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want) / (jnp.abs(want) + 1e-2 * jnp.max(jnp.abs(want)))))


def run_matmul_case(
    name: str, t: int, k: int, n: int, *, on_gpu: bool, run_kernel: bool, interpret: bool, runs: int, seed: int
) -> dict:
    row = dict(case=f"{name} {k}x{n} t={t}", shape=name, tokens=t, k=k, n=n, flops=2 * t * k * n)
    row["impl"] = "kernels" if run_kernel else "references"
    variants = matmul_variants(run_kernel, interpret)
    kinds = list(dict.fromkeys(v[0] for v in variants.values()))  # bf16, int4, fp8: one set of inputs each
    for kind in kinds:
        bytes_ = matmul_bytes(kind, t, k, n)
        copies = copies_for(bytes_, on_gpu and not interpret)
        keys = jax.random.split(jax.random.key(seed * 10 + kinds.index(kind)), 2 * copies)
        inputs = []
        for i in range(copies):
            x = jax.random.normal(keys[2 * i], (t, k), jnp.bfloat16)
            canonical, kernel_layout = make_matmul_weights(
                keys[2 * i + 1], kind=kind, k=k, n=n, kernel_layout=run_kernel
            )
            inputs.append((x, canonical, kernel_layout))
        want = None
        for variant, (vkind, fn, takes_layout) in variants.items():
            if vkind != kind:
                continue
            arg_sets = [(x, layout) if takes_layout else (x, *canonical) for x, canonical, layout in inputs]
            got = first_output(fn, arg_sets)
            if takes_layout:  # a kernel: checked against its reference before it is timed
                x, canonical, _ = inputs[0]
                want = jax.jit(REFERENCES[kind])(x, *canonical) if want is None else want
                err = row[f"{variant}_rel_err"] = rel_err(got, want)
                if not err <= MATMUL_TOL:  # NaN too
                    row.setdefault("mismatched", []).append(variant)
            del got
            time_variant(row, variant, fn, arg_sets, bytes_, copies, runs=runs, on_gpu=on_gpu, once=interpret)
        del inputs, want
    for variant in variants:
        row[f"{variant}_speedup"] = row["bf16_us"] / row[f"{variant}_us"]
    if run_kernel:
        row["ok"] = "mismatched" not in row
    return row


def matmul_header(variants: list[str], impl: str, copy_gbs: float) -> str:
    """us, share of the copy bandwidth, TFLOP/s per variant; speed-ups over the bf16 dot."""
    head = (
        f"{'case':26}"
        + "".join(f" {v + ' us':>10} {'%copy':>6} {'TF/s':>6}" for v in variants)
        + "".join(f" {v + ' x':>9}" for v in variants[1:])
        + " check"
    )
    return (
        f"\nquantized matmuls ({impl}; _ws: warp-specialized pipeline); "
        f"copy bandwidth (read + write): {copy_gbs:,.0f} GB/s\n{head}\n{'-' * len(head)}"
    )


def matmul_line(r: dict, variants: list[str], copy_gbs: float) -> str:
    if not all(f"{v}_speedup" in r for v in variants):  # it raised part way
        return f"{r['case']:26} {check_mark(r)}"
    cells = "".join(
        f" {r[v + '_us']:10.1f} {100 * r[v + '_gbs'] / copy_gbs:5.0f}% {r[v + '_tflops']:6.1f}" for v in variants
    )
    speedups = "".join(f" {r[v + '_speedup']:9.2f}" for v in variants[1:])
    mark = check_mark(r) + (f" {','.join(r['mismatched'])}" if "mismatched" in r else "")
    return f"{r['case']:26}{cells}{speedups} {mark}"


def plot_matmul(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "bf16_speedup" in r]  # not the cases that raised
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r["shape"] == shape]
        for variant in [v.removesuffix("_speedup") for v in mine[0] if v.endswith("_speedup")]:
            ax.plot([r["tokens"] for r in mine], [r[f"{variant}_speedup"] for r in mine], "o-", label=variant)
        ax.axhline(1.0, color="k", lw=1)
        ax.set(
            xscale="log", xlabel="tokens", ylabel="speed-up over bf16", title=f"{shape} {mine[0]['k']}x{mine[0]['n']}"
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def run_matmuls(args, results: Results, on_gpu: bool, run_kernel: bool, copy_gbs: float) -> list[dict]:
    shapes = SMOKE_MATMUL_SHAPES if args.smoke else MATMUL_SHAPES
    tokens = SMOKE_MATMUL_TOKENS if args.smoke else QUICK_MATMUL_TOKENS if args.quick else MATMUL_TOKENS
    interpret = args.interpret and not on_gpu
    variants = list(matmul_variants(run_kernel, interpret))
    print(matmul_header(variants, "kernels" if run_kernel else "references", copy_gbs), flush=True)
    cases = [(i, name, k, n, t) for i, (name, k, n) in enumerate(shapes) for t in tokens]

    def one(case) -> dict:
        i, name, k, n, t = case
        kw = dict(on_gpu=on_gpu, run_kernel=run_kernel, interpret=interpret, runs=args.runs, seed=100 * i + t)
        return run_matmul_case(name, t, k, n, **kw)

    def name(case) -> str:
        _, shape, k, n, t = case
        return f"{shape} {k}x{n} t={t}"

    return run_rows(results, "matmul_cases", cases, one, lambda r: matmul_line(r, variants, copy_gbs), name)


# -- grouped matmuls (MoE experts) -------------------------------------------------

# (name, K, N): Qwen3-30B-A3B's experts (hidden 2048, expert intermediate 768), fused
# gate/up and down; 128 experts, 8 per token, rows = tokens * 8 sorted by expert.
GMM_SHAPES = [("gate_up", 2048, 1536), ("down", 768, 2048)]
GMM_EXPERTS, GMM_TOP_K = 128, 8
GMM_TOKENS = [8, 64, 256, 2048]
QUICK_GMM = [("gate_up", 8), ("gate_up", 2048)]  # decode and a prefill chunk
SMOKE_GMM_SHAPES, SMOKE_GMM_EXPERTS, SMOKE_GMM_TOP_K, SMOKE_GMM_TOKENS = [("small", 128, 64)], 4, 2, [1, 8]


@functools.partial(jax.jit, static_argnames=("tokens", "experts", "top_k"))
def routed_group_sizes(key, *, tokens: int, experts: int, top_k: int):
    """Rows per expert of a random router: each token's top-k experts of random scores."""
    _, chosen = jax.lax.top_k(jax.random.normal(key, (tokens, experts)), top_k)
    return jnp.bincount(chosen.ravel(), length=experts).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("kind", "g", "k", "n", "kernel_layout"))
def make_gmm_weights(key, *, kind: str, g: int, k: int, n: int, kernel_layout: bool):
    """Random expert weights [G, K, N] of `kind`, made on the device: (canonical arrays, the
    kernel layout or None), as make_matmul_weights."""
    k1, k2 = jax.random.split(key)
    if kind == "bf16":
        return (jax.random.normal(k1, (g, k, n), jnp.bfloat16) * 0.02,), None
    if kind == "int4":
        packed = jax.random.randint(k1, (g, k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
        scales = jax.random.uniform(k2, (g, k // INT4_GROUP, n), jnp.float32, 1e-3, 2e-3)
        canonical = (packed, scales, -8 * scales)
        return canonical, gmm.prepare_int4(*canonical) if kernel_layout else None
    fp8 = jnp.clip(jax.random.normal(k1, (g, k, n), jnp.float32) * 100, -448, 448).astype(jnp.float8_e4m3fn)
    canonical = (fp8, jax.random.uniform(k2, (g, n), jnp.float32, 1e-4, 2e-4))
    return canonical, gmm.prepare_fp8(*canonical) if kernel_layout else None


GMM_REFERENCES = {
    "bf16": grouped_matmul_reference,
    "int4": int4_grouped_matmul_reference,
    "fp8": fp8_grouped_matmul_reference,
}


def gmm_variants(run_kernel: bool, interpret: bool) -> dict[str, tuple]:
    """variant -> (weight kind, function, whether it takes the kernel layout): XLA's ragged_dot
    (the bf16 reference) first; then the kernels (GPU or interpreted) or the other references."""
    variants = {"ragged_dot": ("bf16", grouped_matmul_reference, False)}
    if not run_kernel:
        return variants | {kind: (kind, GMM_REFERENCES[kind], False) for kind in ("int4", "fp8")}
    interp = True if interpret else None
    return variants | {
        "gmm": ("bf16", functools.partial(gmm.grouped_matmul, interpret=interp), False),
        "int4_gmm": ("int4", functools.partial(gmm.int4_grouped_matmul, interpret=interp), True),
        "fp8_gmm": ("fp8", functools.partial(gmm.fp8_grouped_matmul, interpret=interp), True),
    }


def gmm_bytes(kind: str, active: int, rows: int, k: int, n: int) -> int:
    """HBM bytes a call must move: the weights of the experts with rows, x and the output."""
    return active * matmul_bytes(kind, 0, k, n) + 2 * rows * (k + n)


def run_gmm_case(
    name: str, t: int, k: int, n: int, experts: int, top_k: int, *, on_gpu, run_kernel, interpret, runs, seed
) -> dict:
    rows = t * top_k
    sizes = routed_group_sizes(jax.random.key(seed), tokens=t, experts=experts, top_k=top_k)
    active = int(jnp.sum(sizes > 0))
    row = dict(case=f"{name} {k}x{n} t={t}", shape=name, tokens=t, rows=rows, k=k, n=n, experts=experts)
    row.update(active_experts=active, flops=2 * rows * k * n, impl="kernels" if run_kernel else "references")
    variants = gmm_variants(run_kernel, interpret)
    kinds = list(dict.fromkeys(v[0] for v in variants.values()))
    for kind in kinds:
        bytes_ = gmm_bytes(kind, active, rows, k, n)
        copies = copies_for(bytes_, on_gpu and not interpret)
        keys = jax.random.split(jax.random.key(seed * 10 + kinds.index(kind) + 1), 2 * copies)
        inputs = []
        for i in range(copies):
            x = jax.random.normal(keys[2 * i], (rows, k), jnp.bfloat16)
            canonical, layout = make_gmm_weights(
                keys[2 * i + 1], kind=kind, g=experts, k=k, n=n, kernel_layout=run_kernel
            )
            inputs.append((x, canonical, layout))
        want = None
        for variant, (vkind, fn, takes_layout) in variants.items():
            if vkind != kind:
                continue
            arg_sets = [
                (x, layout, sizes) if takes_layout else (x, *canonical, sizes) for x, canonical, layout in inputs
            ]
            got = first_output(fn, arg_sets)
            if run_kernel and variant != "ragged_dot":  # a kernel: checked against its reference first
                x, canonical, _ = inputs[0]
                want = jax.jit(GMM_REFERENCES[kind])(x, *canonical, sizes) if want is None else want
                err = row[f"{variant}_rel_err"] = rel_err(got, want)
                if not err <= MATMUL_TOL:
                    row.setdefault("mismatched", []).append(variant)
            del got
            time_variant(row, variant, fn, arg_sets, bytes_, copies, runs=runs, on_gpu=on_gpu, once=interpret)
        del inputs, want
    for variant in variants:
        row[f"{variant}_speedup"] = row["ragged_dot_us"] / row[f"{variant}_us"]
    if run_kernel:
        row["ok"] = "mismatched" not in row
    return row


def run_gmms(args, results: Results, on_gpu: bool, run_kernel: bool, copy_gbs: float) -> list[dict]:
    experts, top_k = (SMOKE_GMM_EXPERTS, SMOKE_GMM_TOP_K) if args.smoke else (GMM_EXPERTS, GMM_TOP_K)
    if args.smoke:
        picked = [(name, t) for name, _, _ in SMOKE_GMM_SHAPES for t in SMOKE_GMM_TOKENS]
    else:
        picked = QUICK_GMM if args.quick else [(name, t) for name, _, _ in GMM_SHAPES for t in GMM_TOKENS]
    shapes = {name: (k, n) for name, k, n in (SMOKE_GMM_SHAPES if args.smoke else GMM_SHAPES)}
    interpret = args.interpret and not on_gpu
    variants = list(gmm_variants(run_kernel, interpret))
    head = matmul_header(variants, "kernels" if run_kernel else "references", copy_gbs)
    title = f"grouped matmuls, {experts} experts top-{top_k}; x: speed-up over ragged_dot"
    print(head.replace("quantized matmuls", title).replace("; _ws: warp-specialized pipeline", ""), flush=True)
    cases = [(i, name, *shapes[name], t) for i, (name, t) in enumerate(picked)]

    def one(case) -> dict:
        i, name, k, n, t = case
        kw = dict(on_gpu=on_gpu, run_kernel=run_kernel, interpret=interpret, runs=args.runs, seed=100 * i + t)
        return run_gmm_case(name, t, k, n, experts, top_k, **kw)

    def name(case) -> str:
        _, shape, k, n, t = case
        return f"{shape} {k}x{n} t={t}"

    return run_rows(results, "gmm_cases", cases, one, lambda r: matmul_line(r, variants, copy_gbs), name)


def plot_or_say(draw, *args) -> None:
    """A plot is a nicety: without matplotlib (or if it fails) the run still succeeds."""
    try:
        draw(*args)
    except ImportError as e:
        print(f"no plot: {e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU)")
    parser.add_argument("--quick", action="store_true", help="the reduced set benchmarks/gpu_check.sh runs")
    parser.add_argument("--interpret", action="store_true", help="run the kernels in the Mosaic GPU interpreter")
    parser.add_argument(
        "--only", choices=("attention", "matmul", "gmm"), help="one group of cases (default: all three)"
    )
    parser.add_argument("--runs", type=int, default=10, help="timed runs per case (median)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON (again after every case)")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG plot (needs matplotlib); with both groups "
        "the matmul plot goes to PATH with '_matmul' before the suffix",
    )
    args = parser.parse_args(argv)

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    run_kernel = on_gpu or args.interpret
    print(f"jax {jax.__version__} on {device.device_kind}", flush=True)
    if not run_kernel:
        print("no GPU: timing the references only (--interpret also checks the kernels, interpreted)")
    copy_gbs = roofs.copy_bandwidth(None if on_gpu else 1 << 27) / 1e9  # CPU: 128 MiB
    results = Results(args.json, jax=jax.__version__, device=device.device_kind, copy_gbs=copy_gbs)
    try:
        if args.only in (None, "attention"):
            rows = run_attention(args, results, on_gpu, run_kernel, copy_gbs)
            if args.plot:
                Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
                plot_or_say(plot, rows, copy_gbs, args.plot)
        if args.only in (None, "matmul"):
            rows = run_matmuls(args, results, on_gpu, run_kernel, copy_gbs)
            if args.plot:
                path = Path(args.plot)
                path.parent.mkdir(parents=True, exist_ok=True)
                if args.only is None:  # the attention plot has PATH
                    path = path.with_name(path.stem + "_matmul" + path.suffix)
                plot_or_say(plot_matmul, rows, str(path))
        if args.only in (None, "gmm"):
            run_gmms(args, results, on_gpu, run_kernel, copy_gbs)
    except KeyboardInterrupt:  # gpu_check.sh's timeout: the finished rows are written already
        print(f"\ninterrupted; the finished rows are in {args.json or 'the table above'}", flush=True)
        return 130
    if args.json:
        print(f"results written to {args.json}")
    failed = results.failed()
    if failed:
        print(f"{len(failed)} case(s) MISMATCHED their reference or failed: {'; '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
