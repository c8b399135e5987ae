"""A command whose extra is missing says so in one line naming the extra, before it loads anything.

The test venv has every extra installed, so a module is hidden the way Python itself reports
a missing one: `sys.modules[name] = None` makes both `import name` and `find_spec(name)` fail.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.extras import MissingExtra, require_extra

ROOT = Path(__file__).resolve().parents[2]


def test_an_installed_module_passes():
    require_extra("numpy", "plot", "--plot")


def test_train_draft_names_its_extra_in_one_line():
    """The real command line, in a process of its own, with matplotlib hidden (optax cannot be:
    flax.nnx imports it, so flax brings it to every install)."""
    hide_and_run = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "
        "sys.argv = ['train_draft', '--method', 'medusa']; "
        "runpy.run_module('jaxserve.train_draft', run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", hide_and_run], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines == [
        "error: No module named matplotlib: python -m jaxserve.train_draft (loss.png) needs it; "
        "install the train extra: "
        "pip install 'jaxserve[train]' (in a clone: pip install -e '.[train]')"
    ], out.stderr
    assert out.stdout == ""  # nothing loaded, nothing printed


def test_plan_plot_without_matplotlib(monkeypatch, tmp_path):
    from jaxserve import plan

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match=r"No module named matplotlib: --plot needs it; install the plot extra"):
        plan.main(["--plot", str(tmp_path / "roofline.png")])
    assert not (tmp_path / "roofline.png").exists()
