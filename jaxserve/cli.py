"""`jaxserve`: one command with subcommands, as `vllm` is.

    jaxserve serve Qwen/Qwen3-0.6B --port 8000     # = python -m api --model Qwen/Qwen3-0.6B --port 8000
    jaxserve chat                                  # talk with the default model
    jaxserve bench latency                         # = python benchmarks/single_stream.py

Each subcommand is another module's `main(argv)`, imported only when it is chosen, so
`jaxserve --help` starts no jax. The table names the modules as strings, as pyproject's
[project.scripts] does: this dispatcher sits above every layer it starts, the server too.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # whose main(argv) runs
    summary: str
    usage: str = ""  # what follows the command's name in the list


COMMANDS = {
    "serve": Command("api.__main__", "serve a model over the OpenAI API (python -m api; MODEL is --model)", "[MODEL]"),
    "generate": Command("jaxserve.generate", "stream a prompt's continuation (python -m jaxserve.generate)", "PROMPT"),
    "chat": Command("jaxserve.chat", "chat with a model in the terminal; or answer a message piped to stdin"),
    "plan": Command("jaxserve.plan", "size the KV cache and roofline of a model on a device (python -m jaxserve.plan)"),
    "bench": Command("", "benchmarks from the source checkout's benchmarks/ folder", "{throughput,latency,serve}"),
    "train-draft": Command("jaxserve.train_draft", "train speculative-decoding heads (python -m jaxserve.train_draft)"),
    "train-lora": Command(
        "jaxserve.train_lora", "train a LoRA adapter, written as a PEFT folder (python -m jaxserve.train_lora)"
    ),
    "cache": Command("jaxserve.weights.cache_admin", "list and prune the converted-weight cache", "{ls,prune}"),
}
BENCHMARKS = {
    "throughput": Command("benchmarks.throughput", "offline throughput against a baseline (benchmarks/throughput.py)"),
    "latency": Command("benchmarks.single_stream", "one stream's latency, cold start (benchmarks/single_stream.py)"),
    "serve": Command("benchmarks.serving", "load a running server, vllm bench serve's metrics (benchmarks/serving.py)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage("jaxserve COMMAND [FLAGS]", "An LLM inference and serving engine in JAX.", COMMANDS))
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"jaxserve {version('jaxserve')}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        return unknown("jaxserve", name, COMMANDS)
    if name == "bench":
        return bench(rest)
    if name == "cache":
        try:
            module = importlib.import_module(COMMANDS["cache"].module)
        except ImportError as e:
            print(f"error: jaxserve cache is not available: {e}", file=sys.stderr)
            return 1
        return module.main(rest) or 0
    return importlib.import_module(COMMANDS[name].module).main(rest) or 0


def bench(argv: list[str]) -> int:
    """`jaxserve bench KIND`: the script in benchmarks/, which ships with the source checkout."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage("jaxserve bench KIND [FLAGS]", COMMANDS["bench"].summary, BENCHMARKS))
        return 0 if argv else 2
    if argv[0] not in BENCHMARKS:
        return unknown("jaxserve bench", argv[0], BENCHMARKS)
    root = Path(__file__).resolve().parents[1]  # the checkout, when installed editable (pip install -e .)
    if not (root / "benchmarks" / "throughput.py").is_file():
        print(
            "error: jaxserve bench runs the scripts of benchmarks/, which ship with the source checkout, not with "
            "the installed package: git clone the repository, pip install -e . there, and run jaxserve bench "
            "(or python benchmarks/...) in it",
            file=sys.stderr,
        )
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(BENCHMARKS[argv[0]].module).main(argv[1:]) or 0


def usage(line: str, summary: str, commands: dict[str, Command]) -> str:
    """The command list that --help prints."""
    width = max(len(f"{name} {c.usage}".strip()) for name, c in commands.items())
    rows = [f"  {f'{name} {c.usage}'.strip():<{width}}  {c.summary}" for name, c in commands.items()]
    return "\n".join(
        [f"usage: {line}", "", summary, "", "commands:", *rows, "", "each command's flags: COMMAND --help"]
    )


def unknown(prog: str, name: str, commands: dict[str, Command]) -> int:
    import difflib

    near = difflib.get_close_matches(name, commands, n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    print(f"error: {prog}: no command {name!r}{hint}; the commands: {', '.join(commands)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
