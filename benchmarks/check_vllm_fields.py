"""Compare api/vllm_fields.py with the request models of an installed vLLM.

    pip install vllm            # in a separate venv: this project's tests never import vLLM
    python benchmarks/check_vllm_fields.py

Prints one row per difference (a field vLLM has that the table lacks, or a field the table
says vLLM has that it no longer has) and exits 1 on any: then decide in api/vllm_fields.py
whether the server honours, refuses or ignores the new field.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

# benchmarks/ holds modules whose names vLLM's own imports would meet first (kernels.py).
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
# The table by its path: importing the `api` package would start the server's imports (jax),
# which vLLM's venv lacks. The table itself imports nothing of ours.
_TABLE = Path(__file__).resolve().parents[1] / "api" / "vllm_fields.py"
_spec = importlib.util.spec_from_file_location("vllm_fields", _TABLE)
vllm_fields = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vllm_fields)

# Where each model lives, newest layout first (vLLM moved them out of one protocol module).
MODELS = {
    "completions": [
        ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
        ("vllm.entrypoints.openai.protocol", "CompletionRequest"),
    ],
    "chat": [
        ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
        ("vllm.entrypoints.openai.protocol", "ChatCompletionRequest"),
    ],
    "stream_options": [
        ("vllm.entrypoints.generate.base.protocol", "StreamOptions"),
        ("vllm.entrypoints.openai.engine.protocol", "StreamOptions"),
        ("vllm.entrypoints.openai.protocol", "StreamOptions"),
    ],
}
TABLES = {**vllm_fields.ENDPOINTS, "stream_options": vllm_fields.STREAM_OPTIONS}


def find_model(candidates: list[tuple[str, str]]):
    for module, name in candidates:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise SystemExit(f"none of {candidates} found in this vLLM")


def field_names(model) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


def differences() -> list[tuple[str, str, str]]:
    """(model, field, what is wrong) for each drift."""
    rows = []
    for what, table in TABLES.items():
        theirs = field_names(find_model(MODELS[what]))
        ours = {name for name, use in table.items() if use.in_vllm}
        rows += [(what, name, "in vLLM, not in the table: decide its handling") for name in sorted(theirs - set(table))]
        rows += [
            (what, name, "in the table as vLLM's, gone from vLLM: set in_vllm=False") for name in sorted(ours - theirs)
        ]
        rows += [(what, name, "in vLLM again: drop in_vllm=False") for name in sorted((set(table) - ours) & theirs)]
    return rows


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    try:
        import vllm
    except ImportError:
        print("vLLM is not installed here: pip install vllm (in a venv of its own)", file=sys.stderr)
        return 2
    rows = differences()
    print(f"vLLM {vllm.__version__}: {len(rows)} difference(s) with api/vllm_fields.py")
    if rows:
        width = max(len(f"{m}.{f}") for m, f, _ in rows)
        for model, name, problem in rows:
            print(f"  {f'{model}.{name}':<{width}}  {problem}")
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(main())
