"""The import graph: arrows run down the floors only, and no module imports itself back.

Read from the source with `ast` (nothing is imported, so this needs no jax). Every import
counts, also those inside functions and under `TYPE_CHECKING`: a lazy import that runs up
a floor is still a dependency that runs up.

    api                        the HTTP server
    jaxserve                   top: the commands (generate, plan, train_draft, flags), tools/
      engine/                  LLMEngine, LLM, outputs, detokenizer, tokenization
      spec_decode/             proposers and heads (see the target through ProposerContext)
      runner/                  ModelRunner, kernel selection
      weights/ sample/ structured/ lora/
      parallel/                sharding, several hosts, KV transfer
      model/                   decoder, config, inputs, KV-cache layout, quantized layers
    scheduler, pallas_kernels  import nothing of ours
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "jaxserve", "scheduler", "pallas_kernels")

# Floors, lowest first; a module may import from its own floor's folder and from lower floors.
FLOORS = [
    {"scheduler", "pallas_kernels"},
    {"jaxserve.model"},
    {"jaxserve.parallel"},
    {"jaxserve.weights", "jaxserve.sample", "jaxserve.structured", "jaxserve.lora"},
    {"jaxserve.runner"},
    {"jaxserve.spec_decode"},
    {"jaxserve.engine"},
    {"jaxserve.tools"},
    {"jaxserve"},  # the package itself and its top-level modules: the commands
    {"api"},
]


def module_files() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports; `from pkg import sub` is an arrow to the
    submodule `pkg.sub`, not to the package's __init__."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def floor_of(module: str) -> tuple[int, str]:
    """(floor, folder): the deepest folder of FLOORS that holds `module`."""
    best = None
    for i, folders in enumerate(FLOORS):
        for folder in folders:
            if module == folder or module.startswith(folder + "."):
                if best is None or len(folder) > len(best[1]):
                    best = (i, folder)
    assert best is not None, f"{module} is on no floor: add its folder to FLOORS"
    return best


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_arrow_runs_down_or_stays_in_its_folder():
    upward = []
    for module, targets in import_graph().items():
        floor, folder = floor_of(module)
        for target in targets:
            target_floor, target_folder = floor_of(target)
            if target_floor > floor or (target_floor == floor and target_folder != folder):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run up a floor (or across one):\n" + "\n".join(sorted(upward))


def test_no_import_circles():
    graph = import_graph()
    circles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target) :] + [node, target]))
            elif target not in state:
                visit(target, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


@pytest.mark.parametrize("package", ["scheduler", "pallas_kernels"])
def test_bottom_packages_import_nothing_of_ours(package):
    outside = {
        f"{m} -> {t}"
        for m, ts in import_graph().items()
        if m.split(".")[0] == package
        for t in ts
        if t.split(".")[0] != package
    }
    assert not outside
