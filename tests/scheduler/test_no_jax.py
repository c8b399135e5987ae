"""The scheduler is pure Python + NumPy: importing it must not import jax (or torch)."""

import subprocess
import sys


def test_importing_scheduler_loads_no_jax():
    code = "import sys, scheduler; print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'torch', 'flax')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
