"""The scheduler is pure Python + NumPy: importing it must not import jax (or torch)."""

import subprocess
import sys


def test_importing_scheduler_loads_no_jax():
    heavy = "('jax', 'jaxlib', 'torch', 'flax')"
    code = f"import sys, scheduler; print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
