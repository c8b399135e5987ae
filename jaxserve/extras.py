"""The optional pieces of jaxserve (pyproject's extras), and the one-line error when one is missing.

Generating, serving and the library need none of them: `plot` brings matplotlib (`python -m
jaxserve.plan --plot`), `train` brings optax and matplotlib (`python -m jaxserve.train_draft`
and its loss.png; flax brings optax to every install anyway). A command checks its extra
before it loads anything, so a missing one costs a second, not a model load.
"""

from __future__ import annotations

import importlib.util


class MissingExtra(SystemExit):
    """Exits (status 1) with one line: the missing module, what needs it, the extra that installs it."""

    def __init__(self, module: str, extra: str, needed_by: str):
        super().__init__(
            f"error: No module named {module}: {needed_by} needs it; install the {extra} extra: "
            f"pip install 'jaxserve[{extra}]' (in a clone: pip install -e '.[{extra}]')"
        )


def require_extra(module: str, extra: str, needed_by: str) -> None:
    """Raise MissingExtra unless `module` can be imported (found, not imported: no cost)."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(module, extra, needed_by)
