"""configure_logging, as a command's fresh interpreter sees it: what reaches stderr at each level."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

LOG_FROM_EACH = """
import logging, sys
from jaxserve.logs import configure_logging
configure_logging(sys.argv[1], fmt="%(levelname)s %(name)s")
for name in ("jaxserve.engine.builder", "api.stats_log", "scheduler.x", "pallas_kernels.cpu_kernels",
             "jax._src.xla_bridge", "absl", "orbax.checkpoint", "httpx"):
    for level in (logging.DEBUG, logging.INFO, logging.WARNING):
        logging.getLogger(name).log(level, "x")
"""


def logged(level: str) -> set[str]:
    err = subprocess.run(
        [sys.executable, "-c", LOG_FROM_EACH, level], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    ).stderr
    return set(err.splitlines())


OURS = ("jaxserve.engine.builder", "api.stats_log", "scheduler.x", "pallas_kernels.cpu_kernels")
THEIRS = ("jax._src.xla_bridge", "absl", "orbax.checkpoint", "httpx")


@pytest.mark.parametrize("level", ["debug", "info", "warning"])
def test_our_loggers_log_at_the_level_asked_and_the_others_at_warning(level):
    ours = {"debug": ("DEBUG", "INFO", "WARNING"), "info": ("INFO", "WARNING"), "warning": ("WARNING",)}[level]
    assert logged(level) == {f"{lv} {name}" for name in OURS for lv in ours} | {f"WARNING {name}" for name in THEIRS}
