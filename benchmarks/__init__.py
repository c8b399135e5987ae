"""The benchmark scripts; run each as `python benchmarks/NAME.py`."""

import sys
from pathlib import Path

# A script run as `python benchmarks/NAME.py` has this folder first on sys.path, where
# kernels.py would shadow the `kernels` package that transformers imports (its model
# classes fail to import then). The scripts import each other as `benchmarks.NAME`.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != _HERE]
