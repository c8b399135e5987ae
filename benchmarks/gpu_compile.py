"""Every Mosaic GPU kernel compiled to sm_90a machine code, on a machine without a GPU.

Each case is exported for CUDA (`jax.export`) and its Mosaic GPU module handed to the CUDA
plugin's own compiler entry (`MosaicGpuCompile`, what the runtime calls before a launch):
MLIR passes, LLVM's NVPTX back end, ptxas. A stand-in CUDA driver (libcuda_standin.c, built
here with `cc`) answers "compute capability 9.0" and counts the cubin it is then asked to
load, which is how a case is known to have compiled. The table shows what ptxas made of
each kernel:

    kernel      what ran (attention; int4 / fp8 / bf16 (dense) matmul; gmm: the grouped MoE matmul, bf16 /
                int4 / fp8 experts) and the case's shapes
    regs        registers per thread at launch (`ptxas -v`)
    spill       bytes of spill stores / loads per thread (0 / 0 is what we want)
    smem KiB    dynamic shared memory Mosaic GPU allocated
    wgmma tma   [HQI]GMMA and UTMALDG instructions in the SASS (the tensor cores and the TMA used)
    i2f         I2F / I2FP instructions (integer to float: an int4 weight goes through bf16 bit
                operations instead, none expected in the int4 kernels)
    maxnreg     setmaxnreg present (warp specialization rebalancing registers)
    lower s / compile s   jax.export, then the plugin's compile (ptxas included)

Cases marked must-not-spill fail the run if they spill: a reviewer then sees the regression.
Today that is every case (the 8-bit caches' attention spilled 8-136 bytes per thread at
128-key blocks; `default_config` now gives them 64). A case allowed to spill would say so
with `must_not_spill=False`; its spills are listed after the table. `--subset ci` is what
CI compiles (tests/pallas_kernels/test_gpu_compile.py); the default is every case.

    pip install -e ".[gpu-compile]"   # the CUDA plugin of our jaxlib version, ptxas, nvdisasm
    python benchmarks/gpu_compile.py                 # every case (130 kernels, 3 minutes on 2 cores)
    python benchmarks/gpu_compile.py --subset ci --json report.json
    python benchmarks/gpu_compile.py --only attention --case 'decode_b64.*' --keep-sass sass/

The plugin may also live in its own folder (`pip install --target DIR`, what .ci/run does,
so that the test venv's jax does not try to start a CUDA backend): pass `--site DIR` or set
JAXSERVE_GPU_COMPILE_SITE.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
STANDIN_SOURCE = HERE / "libcuda_standin.c"
SUBSETS = ("all", "ci")
KERNELS = ("attention", "matmul", "gmm", "sgmv")  # gmm: the grouped (MoE expert) matmul; sgmv: LoRA's


# -- the cases ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    kernel: str  # "attention", "int4 matmul", "fp8 matmul", "bf16 matmul", "gmm", "int4 gmm", "fp8 gmm"
    name: str
    lower: Callable[[], list[int]]  # exports for CUDA; returns the shared-memory bytes allocated
    must_not_spill: bool = True  # every case today: none spills since block_kv 64 for 8-bit caches
    ci: bool = False  # in the subset CI compiles

    @property
    def family(self) -> str:
        return self.kernel.split()[-1]


# The engine's default buckets: tokens 1, 2, 4 .. 512 with at most 32 sequences. These token
# counts are where its attention config (query tile) or matmul config (token tile, K splits)
# changes; the buckets in between compile the same code at other shapes.
ENGINE_ATTENTION_TOKENS = (1, 64, 128, 256, 512)
ENGINE_MAX_SEQS = 32
MATMUL_TOKENS = (1, 16, 64, 128, 512)

CI_ATTENTION = {"decode_b64_8k", "decode_b64_8k_window_cap", "mixed_512_tokens_64_seqs", "prefill_8k_tokens_4_seqs"}
CI_KV8 = {("fp8", "decode_b64_8k_window_cap"), ("int8", "prefill_8k_tokens_4_seqs")}
CI_MATMUL = {("int4", "qkv", 1), ("int4", "gate_up", 128), ("fp8", "down", 16), ("fp8", "qkv", 512)}
DENSE_TOKENS = (1, 512)  # the dense kernel's cases: a decode step and a prefill chunk
CI_DENSE = {("llama1b_up", 512)}
CI_GROUPED = {("float", "moe_gate_up", 8), ("int4", "moe_down", 256), ("fp8", "moe_gate_up", 2048)}


def attention_cases() -> list[Case]:
    import jax.numpy as jnp

    from benchmarks.mosaic_lowering import (
        ATTENTION_PRODUCTION,
        KV8,
        KV8_PRODUCTION,
        OTHER_HEAD_GROUPINGS,
        TREE_PRODUCTION,
        lower_attention,
    )

    def lower(*args, **kwargs):
        return lambda: lower_attention(*args, **kwargs)[2]

    cases = []
    for name, tokens, seqs, context, page, head_dim, window, cap in ATTENTION_PRODUCTION:
        cases.append(
            Case(
                "attention",
                name,
                lower(tokens, seqs, context, page, head_dim, window, cap),
                ci=name in CI_ATTENTION,
            )
        )
    for kv8 in KV8:
        for name, tokens, seqs, context, page, head_dim, window, cap in KV8_PRODUCTION:
            f = lower(tokens, seqs, context, page, head_dim, window, cap, kv_dtype=KV8[kv8])
            cases.append(Case("attention", f"{name}_{kv8}", f, ci=(kv8, name) in CI_KV8))
    for name, tokens, seqs, context, page, head_dim, window, cap, kv8, words in TREE_PRODUCTION:
        kv_dtype = KV8[kv8] if kv8 else None
        f = lower(tokens, seqs, context, page, head_dim, window, cap, kv_dtype=kv_dtype, tree_words=words)
        cases.append(Case("attention", name, f, ci=name in ("tree_b64_n16", "tree_b8_n64")))
    for name, tokens, seqs, heads, kv_heads, head_dim in OTHER_HEAD_GROUPINGS:
        f = lower(tokens, seqs, 8192, 16, head_dim, None, None, num_heads=heads, num_kv_heads=kv_heads)
        cases.append(Case("attention", name, f, ci=name == "smollm2_decode"))
    cases.append(Case("attention", "decode_b64_8k_f16", lower(64, 64, 8192, 16, 128, None, None, dtype=jnp.float16)))
    # --batch-invariant: 64-key blocks whatever the bucket, fixed splits, the rescale's select.
    f = lower(64, 64, 8192, 16, 64, None, None, num_heads=9, num_kv_heads=3, batch_invariant=True)
    cases.append(Case("attention", "smollm2_decode_invariant", f, ci=True))
    f = lower(8192, 4, 32768, 16, 128, None, None, batch_invariant=True)
    cases.append(Case("attention", "prefill_8k_tokens_4_seqs_invariant", f))
    for tokens in ENGINE_ATTENTION_TOKENS:  # Llama-3-8B and the default model in the engine's buckets
        seqs = min(tokens, ENGINE_MAX_SEQS)
        cases.append(Case("attention", f"engine_t{tokens}", lower(tokens, seqs, 8192, 16, 128, None, None)))
        f = lower(tokens, seqs, 8192, 16, 64, None, None, num_heads=9, num_kv_heads=3)
        cases.append(Case("attention", f"engine_t{tokens}_smollm2", f))
    return cases


def matmul_cases() -> list[Case]:
    import jax.numpy as jnp

    from benchmarks.mosaic_lowering import DENSE_PROJECTIONS, LLAMA3_8B_PROJECTIONS, lower_matmul
    from pallas_kernels import quantized_matmul_mgpu as mgpu

    def lower(*args, **kwargs):
        return lambda: lower_matmul(*args, **kwargs)[1]

    cases = []
    for kind in ("int4", "fp8"):
        for name, k, n in LLAMA3_8B_PROJECTIONS:
            for tokens in MATMUL_TOKENS:
                cases.append(
                    Case(
                        f"{kind} matmul",
                        f"{name}_t{tokens}",
                        lower(kind, tokens, k, n),
                        ci=(kind, name, tokens) in CI_MATMUL,
                    )
                )
        ws = mgpu.TuningConfig(warp_specialized=True)
        cases.append(Case(f"{kind} matmul", "qkv_t256_warp_specialized", lower(kind, 256, 4096, 6144, config=ws)))
        for k, n in ((576, 576), (576, 1536), (1536, 576)):  # the default model (SmolLM2-135M), f16
            group = 64 if k == 576 else 128
            f = lower(kind, 8, k, n, group=group, dtype=jnp.float16)
            cases.append(Case(f"{kind} matmul", f"smollm2_{k}x{n}_t8_f16", f))
    cases.append(Case("int4 matmul", "qkv_t8_group32", lower("int4", 8, 4096, 6144, group=32)))  # GGUF Q4 blocks
    for name, k, n, transposed in DENSE_PROJECTIONS:
        for tokens in DENSE_TOKENS:
            f = lower("dense", tokens, k, n, transposed=transposed)
            cases.append(Case("bf16 matmul", f"{name}_t{tokens}", f, ci=(name, tokens) in CI_DENSE))
    f = lower("dense", 64, 2048, 8192, transposed=True)
    cases.append(Case("bf16 matmul", "llama1b_up_n_k_t64", f))  # the [N, K] layout at a larger K
    return cases + invariant_matmul_cases()


def invariant_matmul_cases() -> list[Case]:
    """`batch_invariant=True` (token tile 64, no K split), one case per kind: a decode step,
    where the default would split K."""
    from benchmarks.mosaic_lowering import lower_matmul

    def lower(kind, k, n, **kwargs):
        return lambda: lower_matmul(kind, 1, k, n, batch_invariant=True, **kwargs)[1]

    return [
        Case("int4 matmul", "qkv_t1_invariant", lower("int4", 4096, 6144)),
        Case("fp8 matmul", "qkv_t1_invariant", lower("fp8", 4096, 6144)),
        Case("bf16 matmul", "smollm2_lm_head_t1_invariant", lower("dense", 576, 49152, transposed=True)),
    ]


def grouped_cases() -> list[Case]:
    """The MoE grouped matmul at Qwen3-30B-A3B's expert shapes (float, int4, fp8 weights)."""
    from benchmarks.mosaic_lowering import MOE_TOKENS, QWEN3_MOE_PROJECTIONS, QWEN3_MOE_TOP_K, lower_grouped_matmul
    from pallas_kernels import grouped_matmul_mgpu as gmm

    cases = []
    for kind in ("float", "int4", "fp8"):
        label = "gmm" if kind == "float" else f"{kind} gmm"
        for name, k, n in QWEN3_MOE_PROJECTIONS:
            for tokens in MOE_TOKENS:
                rows = tokens * QWEN3_MOE_TOP_K
                cases.append(
                    Case(
                        label,
                        f"{name}_t{tokens}",
                        lambda kind=kind, rows=rows, k=k, n=n: lower_grouped_matmul(kind, rows, k, n)[1],
                        ci=(kind, name, tokens) in CI_GROUPED,
                    )
                )
        ws = gmm.TuningConfig(warp_specialized=True)
        f = lambda kind=kind: lower_grouped_matmul(kind, 256 * QWEN3_MOE_TOP_K, 2048, 1536, config=ws)[1]  # noqa: E731
        cases.append(Case(label, "moe_gate_up_t256_warp_specialized", f))
    return cases


def sgmv_cases() -> list[Case]:
    """LoRA's SGMV (the grouped matmul's shrink and expand) at Llama-3-8B's projections."""
    from benchmarks.mosaic_lowering import LLAMA3_8B_LORA, LORA_TOKENS, lower_sgmv

    return [
        Case("sgmv", f"{name}_t{tokens}", lambda t=tokens, i=d_in, o=d_out: lower_sgmv(t, i, o)[1])
        for name, d_in, d_out in LLAMA3_8B_LORA
        for tokens in LORA_TOKENS
    ]


def all_cases(only: list[str] | None = None) -> list[Case]:
    families = only or list(KERNELS)
    makers = {"attention": attention_cases, "matmul": matmul_cases, "gmm": grouped_cases, "sgmv": sgmv_cases}
    return [case for family in KERNELS if family in families for case in makers[family]()]


# -- compiling ----------------------------------------------------------------------------


@dataclasses.dataclass
class KernelReport:
    """What ptxas made of one Mosaic GPU module (None where it did not say)."""

    compiled: bool
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_bytes: int | None = None
    wgmma: int = 0
    tma_loads: int = 0
    int_to_float: int = 0  # I2F / I2FP instructions (an int4 weight's conversion should have none)
    setmaxnreg: bool = False
    compile_s: float = 0.0
    error: str = ""

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)


_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_compiler_output(text: str, compiled: bool) -> KernelReport:
    """A report from what the plugin printed with MOSAIC_GPU_DUMP_PTXAS / _SASS set."""
    report = KernelReport(compiled=compiled)
    if m := _PTXAS_REGISTERS.search(text):
        report.registers = int(m.group(1))
    if m := _PTXAS_SPILLS.search(text):
        report.stack_bytes, report.spill_stores, report.spill_loads = map(int, m.groups())
    report.wgmma = len(re.findall(r"\b[HQI]GMMA\.", text))  # bf16 / f16, fp8, int8 operands
    report.tma_loads = len(re.findall(r"\bUTMALDG\b", text))
    report.int_to_float = len(re.findall(r"\bI2FP?\.", text))
    report.setmaxnreg = "USETMAXREG" in text
    if not compiled:
        lines = [line for line in text.splitlines() if "error" in line.lower()] or text.splitlines()[-5:]
        report.error = " | ".join(line.strip() for line in lines[:5])
    return report


def build_standin_driver(folder: Path) -> Path:
    """libcuda.so.1 from libcuda_standin.c (with soname libcuda.so.1, so that once loaded,
    the plugin's dlopen("libcuda.so.1") finds it)."""
    target = folder / "libcuda.so.1"
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(target), str(STANDIN_SOURCE)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit(f"no C compiler ({cc}) to build the stand-in CUDA driver") from None
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"building the stand-in CUDA driver failed:\n{e.stderr}") from None
    return target


def plugin_library() -> str:
    """The CUDA plugin's shared library (it holds MosaicGpuCompile)."""
    for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            module = __import__(name, fromlist=["_get_library_path"])
        except ImportError:
            continue
        return str(module._get_library_path())
    raise SystemExit(
        "the CUDA plugin is not installed: pip install -e '.[gpu-compile]' (or pass --site with a "
        "folder holding jax-cuda13-plugin, jax-cuda13-pjrt and nvidia-cuda-nvcc of our jaxlib's version)"
    )


class Compiler:
    """The plugin's MosaicGpuCompile over the stand-in driver, its output captured."""

    def __init__(self, driver: Path):
        self.driver = ctypes.CDLL(str(driver), mode=ctypes.RTLD_GLOBAL)  # before the plugin opens libcuda.so.1
        self.driver.standin_images_loaded.restype = ctypes.c_int
        plugin = ctypes.CDLL(plugin_library())
        self.compile_fn = plugin.MosaicGpuCompile
        self.compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self.compile_fn.restype = ctypes.c_void_p
        self.libc = ctypes.CDLL(None)

    def compile(self, module: bytes) -> tuple[KernelReport, str]:
        """Compile one serialized Mosaic GPU module; (report, what the compiler printed)."""
        loaded = self.driver.standin_images_loaded()
        start = time.perf_counter()
        handle, text = self._captured(lambda: self.compile_fn(module, len(module)))
        seconds = time.perf_counter() - start
        # With a real driver the load succeeds (a handle); with the stand-in, the load was asked for.
        compiled = bool(handle) or self.driver.standin_images_loaded() > loaded
        report = parse_compiler_output(text, compiled)
        report.compile_s = seconds
        return report, text

    def _captured(self, fn):
        """fn() with the process's stdout and stderr (the C++ side prints there) in a file."""
        sys.stdout.flush()
        sys.stderr.flush()
        with tempfile.TemporaryFile() as sink:
            saved = os.dup(1), os.dup(2)
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            try:
                result = fn()
            finally:
                self.libc.fflush(None)
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
            sink.seek(0)
            return result, sink.read().decode(errors="replace")


def lowered_modules(case: Case) -> tuple[list[bytes], list[int], float]:
    """The serialized Mosaic GPU modules one case exports (in lowering order), the shared
    memory each allocated, and the export's seconds."""
    from jax.experimental.mosaic.gpu import core as mosaic_core

    mosaic_core.KNOWN_KERNELS.clear()  # the lowering registers each kernel's module here
    start = time.perf_counter()
    smem = case.lower()
    return list(mosaic_core.KNOWN_KERNELS.values()), list(smem), time.perf_counter() - start


# -- the report -----------------------------------------------------------------------------

COLUMNS = (
    ("kernel", 11),
    ("case", 36),
    ("regs", 4),
    ("spill st/ld", 11),
    ("smem KiB", 8),
    ("wgmma", 5),
    ("tma", 4),
    ("i2f", 4),
    ("maxnreg", 7),
    ("lower s", 7),
    ("compile s", 9),
    ("", 0),
)


def header() -> str:
    return " ".join(f"{name:<{width}}" for name, width in COLUMNS).rstrip()


def format_row(row: dict) -> str:
    def cell(value, width, right=True):
        text = "-" if value is None else str(value)
        return f"{text:>{width}}" if right else f"{text:<{width}}"

    spill = None if row["spill_stores"] is None else f"{row['spill_stores']}/{row['spill_loads']}"
    smem = None if row["smem_bytes"] is None else f"{row['smem_bytes'] / 1024:.1f}"
    cells = [
        cell(row["kernel"], 11, False),
        cell(row["case"], 36, False),
        cell(row["registers"], 4),
        cell(spill, 11),
        cell(smem, 8),
        cell(row["wgmma"], 5),
        cell(row["tma_loads"], 4),
        cell(row["int_to_float"], 4),
        cell("yes" if row["setmaxnreg"] else "no", 7),
        cell(f"{row['lower_s']:.1f}", 7),
        cell(f"{row['compile_s']:.1f}", 9),
        row["verdict"],
    ]
    return " ".join(cells)


def verdict(case: Case, report: KernelReport) -> str:
    if not report.compiled:
        return f"FAILED: {report.error}"
    if report.spills:
        return "SPILLS (must not)" if case.must_not_spill else "spills"
    return "ok"


def run(cases: list[Case], compiler: Compiler, *, json_path: Path | None, sass_dir: Path | None) -> list[dict]:
    rows, seen = [], {}  # seen: module bytes -> the first case's row (cases may share a kernel)
    print(header(), flush=True)
    for case in cases:
        try:
            modules, smem, lower_s = lowered_modules(case)
        except Exception as e:  # a lowering error is this case's failure, not the run's end
            modules, smem, lower_s = [], [], 0.0
            failure = KernelReport(compiled=False, error=f"lowering: {type(e).__name__}: {e}"[:300])
        else:
            failure = None if modules else KernelReport(compiled=False, error="no Mosaic GPU kernel was lowered")
        for i, module in enumerate(modules or [None]):
            if failure is not None:
                report, text = failure, ""
            elif module in seen:
                report, text = seen[module], ""
            else:
                report, text = compiler.compile(module)
                seen[module] = report
                if sass_dir is not None:
                    sass_dir.mkdir(parents=True, exist_ok=True)
                    (sass_dir / f"{case.kernel.replace(' ', '_')}.{case.name}.{i}.txt").write_text(text)
            row = {
                "kernel": case.kernel,
                "case": case.name + (f"[{i}]" if len(modules) > 1 else ""),
                "smem_bytes": smem[i] if i < len(smem) else None,
                "lower_s": lower_s,
                "must_not_spill": case.must_not_spill,
                **dataclasses.asdict(report),
                "verdict": verdict(case, report),
            }
            rows.append(row)
            print(format_row(row), flush=True)
            if json_path is not None:  # rewritten after each row: a run cut short keeps what it did
                json_path.write_text(json.dumps(rows, indent=1))
    return rows


def summary(rows: list[dict], seconds: float) -> tuple[str, bool]:
    failed = [r for r in rows if not r["compiled"]]
    bad_spills = [r for r in rows if r["compiled"] and r["must_not_spill"] and (r["spill_stores"] or r["spill_loads"])]
    spills = [r for r in rows if r["compiled"] and not r["must_not_spill"] and (r["spill_stores"] or r["spill_loads"])]
    lines = [f"{len(rows)} kernels in {seconds:.0f} s: {len(rows) - len(failed)} compiled to sm_90a"]
    lines += [f"FAILED to compile: {r['kernel']} {r['case']}: {r['error']}" for r in failed]
    lines += [f"SPILLS where it must not: {r['kernel']} {r['case']}" for r in bad_spills]
    if spills:
        lines.append("spills (allowed): " + ", ".join(f"{r['kernel']} {r['case']}" for r in spills))
    return "\n".join(lines), not failed and not bad_spills


def prepare_environment(site: str | None) -> None:
    """Before jax is imported: the plugin's folder on the path, jax on the CPU (the plugin's
    CUDA backend cannot start without a GPU and is not needed to compile), the dumps on."""
    if site:
        sys.path.insert(0, str(Path(site).resolve()))
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    os.environ["MOSAIC_GPU_DUMP_SASS"] = "1"
    sys.path.insert(0, str(HERE.parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subset", choices=SUBSETS, default="all", help="ci: the cases CI compiles (default: all)")
    parser.add_argument("--only", action="append", choices=KERNELS, help="one kernel family (repeatable)")
    parser.add_argument("--case", help="only the cases whose name matches this regular expression")
    parser.add_argument("--list", action="store_true", help="list the cases and exit (compiles nothing)")
    parser.add_argument("--json", type=Path, help="write the rows here (after each one)")
    parser.add_argument("--keep-sass", type=Path, metavar="DIR", help="keep each kernel's ptxas report and SASS")
    parser.add_argument(
        "--site", default=os.environ.get("JAXSERVE_GPU_COMPILE_SITE"), help="a folder holding the CUDA plugin"
    )
    args = parser.parse_args(argv)
    prepare_environment(args.site)

    cases = [c for c in all_cases(args.only) if args.subset == "all" or c.ci]
    if args.case:
        cases = [c for c in cases if re.fullmatch(args.case, c.name)]
    if args.list:
        for c in cases:
            print(f"{c.kernel:<11} {c.name:<36} {'must-not-spill' if c.must_not_spill else ''}")
        return 0
    if not cases:
        print("no case matches", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        compiler = Compiler(build_standin_driver(Path(folder)))
        start = time.perf_counter()
        rows = run(cases, compiler, json_path=args.json, sass_dir=args.keep_sass)
    text, ok = summary(rows, time.perf_counter() - start)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
