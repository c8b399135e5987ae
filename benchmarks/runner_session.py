"""A baseline engine's runner script, run by its own venv's Python and kept running: the
benchmarks send it one JSON line per request and read one back (vllm_runner.py,
llama_cpp_runner.py)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.cpu_time import on_every_core


class RunnerSession:
    """A baseline's runner script kept running in its own venv: `ready` is its first JSON
    line (once its engine is built), `send(line)` writes a line to its stdin and returns its
    next JSON line. `pid` is the process, `spawned_at` the time.time() it was started. Its
    log (stderr) goes to a file whose tail is shown on failure, and is removed on success."""

    def __init__(self, cmd: list[str], env: dict, name: str):
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix="runner-", suffix=".log", delete=False)
        self.spawned_at = time.time()
        with on_every_core():
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
            )
        self.pid = self.proc.pid
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = Path(self.log.name).read_text()[-3000:]
            code = self.proc.returncode
            raise SystemExit(f"error: {self.name} failed (exit {code}); log {self.log.name}:\n{tail}")
        return json.loads(line)

    def send(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self.proc.returncode == 0:
            os.unlink(self.log.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
