"""What the commands tell the user while they work: log levels, and the line before a long start.

`configure_logging(level)` puts jaxserve's own loggers (`jaxserve`, `api`, `scheduler`,
`pallas_kernels`) at `level` and everything else at WARNING or above: jax logs at INFO
that it could not start the backends it tried ("Unable to initialize backend 'tpu'",
which reads like an error on every machine without one), and orbax logs some fifteen INFO
lines per weight save. uvicorn's loggers are uvicorn's: it sets them from its own
`log_level` (the server's --uvicorn-log-level).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

OWN_LOGGERS = ("jaxserve", "api", "scheduler", "pallas_kernels")
SERVER_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | int = "info", fmt: str = SERVER_FORMAT) -> None:
    """Log jaxserve's loggers at `level` ("debug", "info", ... or a logging constant) to
    stderr, and other libraries' at WARNING (or `level`, if that is higher)."""
    level = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not logging.getLogger().handlers:  # else the program that calls this has set logging up: left as it is
        logging.basicConfig(format=fmt, level=max(level, logging.WARNING))
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(level)


def loading_line(model: str | None, cache_dir: str | Path | None = None) -> str:
    """The line a command prints before it loads a model: a first start is long, a later one is not."""
    from jaxserve.weights.cache import default_cache_dir
    from jaxserve.weights.default_model import GGUF_NAME

    name = model or f"the default model ({GGUF_NAME})"
    cache = Path(cache_dir or default_cache_dir())
    return (
        f"jaxserve: loading {name} (a first start converts the weights and compiles, a minute or two for a "
        f"small model; later starts read both from {cache})"
    )


def say_loading(model: str | None, cache_dir: str | Path | None = None) -> None:
    print(loading_line(model, cache_dir), file=sys.stderr, flush=True)
