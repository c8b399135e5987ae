"""The docs cannot drift: every command they show is checked here, without running a model.

Shell commands come from the ```bash, ```sh and ```console blocks of README.md,
CONTRIBUTING.md and docs/**/*.md (a `\\` joins lines; in a console block only `$ ` lines
are commands, the rest is output). Each of our commands is parsed by that command's own
argparse parser, so a renamed or removed flag or a bad choice fails its test case:

    python -m jaxserve.generate / jaxserve.plan / jaxserve.train_draft / train_lora / api / api.router
    jaxserve-generate, jaxserve-serve           the console scripts of the same modules
    jaxserve COMMAND (bench KIND)               the module jaxserve.cli's table runs for it
    --config NAME.yaml                          the pages' ```yaml block that starts `# NAME.yaml`
    python benchmarks/X.py                      that script's parser
    bash X.sh                                   the script exists (gpu_check.sh: its --only sections too)

Commands that are not ours (pip, git, curl, ...) are listed in NOT_OURS; any other kind
fails, so a new kind of command is noticed. Besides: every ```python block parses, every
repository path and `package.module.name` the pages mention exists, the module map of
docs/architecture.md lists every module, docs/testing.md lists every registered marker,
and `mkdocs build --strict` passes (when mkdocs is installed: the `docs` extra).

Imports no jax at module level; the parsers' modules are imported by the test cases
(jaxserve.generate and api.__main__ pull in jax through jaxserve.weights, train_draft
imports it itself: a second or two).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])
SHELL_LANGS = {"bash", "sh", "shell", "console"}
PACKAGES = ("jaxserve", "api", "scheduler", "pallas_kernels")

# `python -m MODULE` commands of ours, and the console scripts of pyproject's [project.scripts].
MODULE_COMMANDS = {
    "jaxserve.generate": "jaxserve.generate",
    "jaxserve.plan": "jaxserve.plan",
    "jaxserve.train_draft": "jaxserve.train_draft",
    "jaxserve.train_lora": "jaxserve.train_lora",
    "api": "api.__main__",
    "api.router": "api.router",
    "jaxserve.weights.cache_admin": "jaxserve.weights.cache_admin",
}  # python -m X: the module that parses
SCRIPTS = {"jaxserve-generate": "jaxserve.generate", "jaxserve-serve": "api.__main__"}
# Programs that are not ours: nothing to check beyond their name.
NOT_OURS = {
    *("pip", "git", "curl", "cd", "export", "echo", "mkdocs", "ruff", "mypy", "pre-commit", "python3.12 -m venv"),
    "vllm-router",  # docs/scaling.md: jaxserve behind an external router
    "docker",  # docs/docker.md: the image's build and run
}
# `python -m X` for modules that are not ours (pytest: its paths must exist).
NOT_OUR_MODULES = {"venv", "pip", "pytest", "mkdocs"}
PYTHON = re.compile(r"python(3(\.\d+)?)?")
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


class Command(NamedTuple):
    where: str  # "docs/cli.md:12"
    argv: list[str]


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, line number of the first line, lines) of each fenced block."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        match = re.match(r"^(\s*)```(\w*)", lines[i])
        if match:
            indent, lang, start = match.group(1), match.group(2), i + 1
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                i += 1
            blocks.append((lang, start + 1, [line.removeprefix(indent) for line in lines[start:i]]))
        i += 1
    return blocks


def command_lines(lang: str, lines: list[str]) -> list[tuple[int, str]]:
    """(offset, text) of each shell command of a block, continuation lines joined."""
    found, current, start = [], None, 0
    for offset, line in enumerate(lines):
        if current is None:
            if lang == "console":
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:]
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            current, start = "", offset
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        found.append((start, current + line))
        current = None
    if current is not None:
        found.append((start, current))
    return found


def simple_commands(text: str) -> list[list[str]]:
    """A shell line's simple commands (split at && || ; |), comments and VAR=value prefixes dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, current = [], []
    for token in lexer:
        if token and set(token) <= set(";&|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    result = []
    for argv in commands:
        while argv and ENV_ASSIGNMENT.fullmatch(argv[0]) and not argv[0].startswith("-"):
            argv = argv[1:]
        if argv:
            result.append(argv)
    return result


def shell_commands(path: Path) -> list[Command]:
    name = path.relative_to(ROOT).as_posix()
    commands = []
    for lang, first_line, lines in fenced_blocks(path.read_text()):
        if lang not in SHELL_LANGS:
            continue
        for offset, text in command_lines(lang, lines):
            for argv in simple_commands(text):
                commands.append(Command(f"{name}:{first_line + offset}", argv))
    return commands


ALL_COMMANDS = [c for path in DOC_FILES for c in shell_commands(path)]


# --- each command's own parser ------------------------------------------------------------


class _ParserBuilt(Exception):
    """Raised by a patched ArgumentParser.parse_args to hand back the parser a main() built."""


def parse_function(module_name: str):
    """A function argv -> Namespace that parses as the command does, nothing else: the
    module's `build_parser()` if it has one, else its `parse_args(argv)`, else the parser its
    `main(argv)` builds (caught at its first parse_args call, before anything runs)."""
    module = importlib.import_module(module_name)
    if hasattr(module, "build_parser"):
        return module.build_parser().parse_args
    if hasattr(module, "parse_args"):
        return module.parse_args

    def hand_back(self, *args, **kwargs):
        raise _ParserBuilt(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", hand_back):
        try:
            module.main([])
        except _ParserBuilt as built:
            parser = built.args[0]
        else:
            raise AssertionError(f"{module_name}.main() built no argparse parser")
    return parser.parse_args  # looked up now that the patch is gone


def yaml_examples() -> dict[str, str]:
    """The pages' ```yaml blocks that start `# NAME.yaml`: the config files their commands name."""
    found = {}
    for path in DOC_FILES:
        for lang, _, lines in fenced_blocks(path.read_text()):
            name = re.fullmatch(r"# ([\w.-]+\.yaml)", lines[0].strip()) if lang == "yaml" and lines else None
            if name:
                found[name.group(1)] = "\n".join(lines)
    return found


YAML_EXAMPLES = yaml_examples()


def check_parses(module_name: str, args: list[str]) -> None:
    """Parse `args` as the command does; a `--config NAME.yaml` reads the pages' example of
    that name, so its keys are checked too."""
    parse = parse_function(module_name)
    stderr = io.StringIO()
    with contextlib.ExitStack() as stack:
        if "--config" in args[:-1] and args[args.index("--config") + 1] in YAML_EXAMPLES:
            i = args.index("--config") + 1
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            (folder / args[i]).write_text(YAML_EXAMPLES[args[i]])
            args = [*args[:i], str(folder / args[i]), *args[i + 1 :]]
        stack.enter_context(contextlib.redirect_stderr(stderr))
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        try:
            parse(args)
        except SystemExit as e:
            if e.code not in (0, None):  # --help exits 0
                pytest.fail(f"{module_name} refuses {shlex.join(args)}:\n{stderr.getvalue()}")


def check_paths(words: list[str]) -> None:
    for word in words:
        if not word.startswith("-") and ("/" in word or word.endswith(".py")):
            assert (ROOT / word.split("::")[0]).exists(), f"{word} does not exist"


def jaxserve_command(args: list[str]) -> tuple[str, list[str]]:
    """The module that parses `jaxserve ARGS`, and the args it gets (jaxserve.cli's tables)."""
    from jaxserve.cli import BENCHMARKS, COMMANDS

    assert args and args[0] in COMMANDS, f"jaxserve {shlex.join(args)}: no such command"
    if args[0] == "bench":
        assert args[1:] and args[1] in BENCHMARKS, f"jaxserve {shlex.join(args)}: no such benchmark"
        return BENCHMARKS[args[1]].module, args[2:]
    return COMMANDS[args[0]].module, args[1:]


GPU_CHECK_SECTIONS = re.compile(r"^SECTIONS=\(([^)]*)\)", re.M)


def check_command(argv: list[str]) -> None:
    """Parse or check one simple command; fail on a kind this test does not know."""
    program = argv[0]
    base = Path(program).name
    if PYTHON.fullmatch(base):
        if argv[1:3] == ["-m", "venv"] or (len(argv) > 2 and argv[1] == "-m" and argv[2] in NOT_OUR_MODULES):
            if argv[2] == "pytest":
                check_paths(argv[3:])
            return
        if len(argv) > 2 and argv[1] == "-m":
            assert argv[2] in MODULE_COMMANDS, f"python -m {argv[2]}: not a command these docs know"
            return check_parses(MODULE_COMMANDS[argv[2]], argv[3:])
        script = argv[1]
        assert (ROOT / script).is_file(), f"{script} does not exist"
        assert script.startswith("benchmarks/") and script.endswith(".py"), f"{script}: not a command these docs know"
        return check_parses("benchmarks." + Path(script).stem, argv[2:])
    if base in SCRIPTS:
        return check_parses(SCRIPTS[base], argv[1:])
    if base == "jaxserve":
        return check_parses(*jaxserve_command(argv[1:]))
    if base == "bash":
        script = ROOT / argv[1]
        assert script.is_file(), f"{argv[1]} does not exist"
        if script.name == "gpu_check.sh":
            sections = GPU_CHECK_SECTIONS.search(script.read_text()).group(1).split()
            for flag, value in zip(argv[2:], argv[3:]):
                if flag == "--only":
                    assert value in sections, f"gpu_check.sh has no section {value!r}: {sections}"
        return None
    if base in NOT_OURS or " ".join(argv[:3]) in NOT_OURS:
        return None
    pytest.fail(f"{shlex.join(argv)}: an unknown kind of command; check it here or add it to NOT_OURS")


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=[c.where for c in ALL_COMMANDS])
def test_command(command: Command):
    check_command(command.argv)


def test_commands_found():
    """The extraction works on the real pages: each command of ours is shown somewhere."""
    shown = {" ".join(c.argv[:3]) for c in ALL_COMMANDS} | {Path(c.argv[0]).name for c in ALL_COMMANDS}
    for expected in (
        "python -m jaxserve.generate",
        "python -m api",
        "python -m jaxserve.plan",
        "python -m jaxserve.train_draft",
        "bash .ci/run",
        "jaxserve-generate",
        "jaxserve serve",
        "jaxserve chat",
    ):
        assert any(s.startswith(expected) for s in shown), f"no docs command {expected!r} found"


def test_extraction():
    text = "\n".join(
        [
            "```console",
            "$ JAX_PLATFORMS=cpu python -m jaxserve.plan --tp 2 \\",
            "    --context 8192   # a comment",
            "| batch | output |",
            "```",
            "```bash",
            "# a comment line",
            "python3.12 -m venv .venv && .venv/bin/pip install -e . ; git status | head",
            "```",
        ]
    )
    found = [
        argv
        for lang, _, lines in fenced_blocks(text)
        for _, line in command_lines(lang, lines)
        for argv in simple_commands(line)
    ]
    assert found == [
        ["python", "-m", "jaxserve.plan", "--tp", "2", "--context", "8192"],
        ["python3.12", "-m", "venv", ".venv"],
        [".venv/bin/pip", "install", "-e", "."],
        ["git", "status"],
        ["head"],
    ]


def test_a_renamed_flag_fails():
    with pytest.raises(pytest.fail.Exception, match="refuses"):
        check_command(["python", "-m", "jaxserve.plan", "--no-such-flag"])
    with pytest.raises(pytest.fail.Exception, match="refuses"):
        check_command(["python", "-m", "jaxserve.generate", "Hi", "--dtype", "float64"])
    with pytest.raises(pytest.fail.Exception, match="unknown kind"):
        check_command(["make", "docs"])
    with pytest.raises(pytest.fail.Exception, match="refuses"):
        check_command(["jaxserve", "serve", "--kv-cache-memory-bytes", "lots"])
    with pytest.raises(AssertionError, match="no such command"):
        check_command(["jaxserve", "sevre"])


# --- the rest of what the pages say -----------------------------------------------------------


def test_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "```bash\nbash .ci/run\n```" in readme, "CI runs the README's test command: keep it"


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.relative_to(ROOT).as_posix() for p in DOC_FILES])
def test_python_blocks_parse(path: Path):
    """Every ```python block parses, and what it imports from our packages exists."""
    for lang, line, lines in fenced_blocks(path.read_text()):
        if lang != "python":
            continue
        try:
            tree = ast.parse("\n".join(lines))
        except SyntaxError as e:
            pytest.fail(f"{path.name}:{line + (e.lineno or 1) - 1}: {e.msg}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                file = module_file(node.module)
                assert file is not None, f"{path.name}:{line}: no module {node.module}"
                for alias in node.names:
                    assert alias.name in top_level_names(file) or module_file(f"{node.module}.{alias.name}"), (
                        f"{path.name}:{line}: {node.module} has no {alias.name}"
                    )


REPO_PATH = re.compile(
    r"(?<![\w./~:-])((?:jaxserve|api|scheduler|pallas_kernels|tests|benchmarks|docs|\.ci)/[\w./-]*\w/?)"
)
DOTTED = re.compile(r"`(?:python -m )?((?:jaxserve|api|scheduler|pallas_kernels)(?:\.\w+)+)")


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.relative_to(ROOT).as_posix() for p in DOC_FILES])
def test_named_paths_exist(path: Path):
    """Every repository path a page names (`jaxserve/sample/sampler.py`, `tests/api/`)."""
    text = re.sub(r"https?://\S+", "", path.read_text())
    missing = sorted({p for p in REPO_PATH.findall(text) if not (ROOT / p).exists()})
    assert not missing, f"{path.name} names paths that do not exist: {missing}"


def top_level_names(file: Path) -> set[str]:
    """Names a module defines or imports at its top level (and lazy `__getattr__` names in __all__)."""
    names = set()
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                names.update(ast.literal_eval(node.value))
    return names


def module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@pytest.mark.parametrize("path", DOC_FILES, ids=[p.relative_to(ROOT).as_posix() for p in DOC_FILES])
def test_named_modules_exist(path: Path):
    """Every `package.module.Name` a page names: the longest module prefix exists, and the
    next name is defined or imported there (read with ast: nothing is imported)."""
    wrong = []
    for dotted in sorted(set(DOTTED.findall(path.read_text()))):
        parts = dotted.split(".")
        prefix = max((i for i in range(1, len(parts) + 1) if module_file(".".join(parts[:i]))), default=0)
        if prefix == 0:
            wrong.append(dotted)
        elif prefix < len(parts) and parts[prefix] not in top_level_names(module_file(".".join(parts[:prefix]))):
            wrong.append(dotted)
    assert not wrong, f"{path.name} names modules or names that do not exist: {wrong}"


def test_module_map_lists_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Module map") :]
    listed = set(re.findall(r"^- `([\w/]+\.py)`", section, re.M))
    modules = {
        p.relative_to(ROOT).as_posix()
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    missing, gone = sorted(modules - listed), sorted(listed - modules)
    assert not missing, f"add a line for each to docs/architecture.md's module map: {missing}"
    assert not gone, f"docs/architecture.md's module map lists modules that are gone: {gone}"


def test_markers_are_documented():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    registered = {m.split(":")[0].strip() for m in pyproject["tool"]["pytest"]["ini_options"].get("markers", [])}
    text = (ROOT / "docs" / "testing.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", text[text.index("## Markers") :], re.M))
    assert documented == registered, f"docs/testing.md lists {sorted(documented)}, pyproject {sorted(registered)}"


def test_docs_extra_is_declared():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("mkdocs-material") for d in extras.get("docs", []))


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')",
)
def test_mkdocs_build_strict(tmp_path):
    """Broken links and anchors fail the build (strict: true, validation in mkdocs.yml)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-q",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()
