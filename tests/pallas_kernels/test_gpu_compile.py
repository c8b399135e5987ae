"""The Mosaic GPU kernels compiled to sm_90a machine code without a GPU (benchmarks/gpu_compile.py).

The CI subset of the cases runs through the CUDA plugin's own compiler (MLIR passes, LLVM's
NVPTX back end, ptxas) over a stand-in driver: every kernel must reach a cubin, use the
tensor cores (wgmma) and the TMA, the int4 kernels convert their nibbles without I2F, and the
cases marked must-not-spill must not spill. Two
controls show the checks can fail: a broken module does not compile, and a config known
to spill (the 8-bit cache's old 128-key blocks) is reported as spilling.

Everything runs in subprocesses: the stand-in libcuda.so.1 must not be loaded into the test
process, where torch would find it. Needs the gpu-compile extra, or its folder in
JAXSERVE_GPU_COMPILE_SITE (what .ci/run sets up); without either the tests are skipped.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu_compile

ROOT = Path(__file__).resolve().parents[2]
SITE = os.environ.get("JAXSERVE_GPU_COMPILE_SITE")


def _plugin_installed() -> bool:
    """The plugin in this venv (the gpu-compile extra); nothing is imported or loaded."""
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (13, 12))
    except ModuleNotFoundError:
        return False


if not SITE and not _plugin_installed():
    pytest.skip(
        "the CUDA plugin is not installed (pip install -e '.[gpu-compile]', or set JAXSERVE_GPU_COMPILE_SITE "
        "to a folder holding it, as .ci/run does)",
        allow_module_level=True,
    )


def run_script(*args, timeout=600):
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_compile.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_python(code, timeout=300):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_ci_subset_compiles_to_sm90a_without_spills(tmp_path):
    listed = run_script("--subset", "ci", "--list")
    assert listed.returncode == 0, listed.stderr
    listed = listed.stdout.splitlines()
    assert len(listed) >= 10

    report = tmp_path / "report.json"
    result = run_script("--subset", "ci", "--json", str(report))
    print(result.stdout[-4000:], result.stderr[-4000:])  # the table, in the test log
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads(report.read_text())
    assert [(r["kernel"], r["case"]) for r in rows] == [(line[:11].strip(), line[12:48].strip()) for line in listed]
    for row in rows:
        assert row["compiled"], row
        assert row["registers"] and row["registers"] <= 255, row
        assert row["wgmma"] > 0 and row["tma_loads"] > 0, row  # tensor cores and TMA, not a fallback
        if row["must_not_spill"]:
            assert row["spill_stores"] == row["spill_loads"] == 0, row
        if row["kernel"].startswith("int4"):  # nibbles to bf16 by bit operations, not I2F (1 per value)
            assert row["int_to_float"] == 0, row
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"attention", "int4 matmul", "fp8 matmul", "bf16 matmul", "gmm", "int4 gmm", "fp8 gmm"}
    assert "compiled to sm_90a" in result.stdout


def test_controls_a_broken_module_fails_and_a_spilling_config_is_seen():
    result = run_python(
        f"""
        import dataclasses, sys, tempfile
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from benchmarks import gpu_compile as gc
        gc.prepare_environment({SITE!r})
        from jax.experimental.mosaic.gpu import core
        from benchmarks.mosaic_lowering import KV8, lower_attention
        from pallas_kernels import ragged_paged_attention_mgpu as mgpu

        compiler = gc.Compiler(gc.build_standin_driver(Path(tempfile.mkdtemp())))
        broken, _ = compiler.compile(b"this is not a Mosaic GPU module")
        print("broken compiled:", broken.compiled)

        # An 8-bit decode with a soft cap and a window at 128-key blocks: ptxas spills.
        config = mgpu.default_config(64, 64, 32, 8, 128, 16, kv_dtype=KV8["int8"])
        assert config.block_kv == 64, config
        for block_kv in (128, 64):
            core.KNOWN_KERNELS.clear()
            lower_attention(
                64, 64, 8192, 16, 128, 4096, 30.0, kv_dtype=KV8["int8"],
                config=dataclasses.replace(config, block_kv=block_kv),
            )
            (module,) = core.KNOWN_KERNELS.values()
            report, _ = compiler.compile(module)
            print(f"block_kv {{block_kv}}: compiled {{report.compiled}} spills {{report.spills}}")
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "broken compiled: False" in lines
    assert "block_kv 128: compiled True spills True" in lines
    assert "block_kv 64: compiled True spills False" in lines
