"""`python -m jaxserve.generate` on the tiny Llama with its stderr a terminal (a pty): the
loading line, then progress bars while the weights convert and the buckets compile. (With
stderr not a terminal there are none: tests/api/test_logs.py reads a server's log file.)"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def stderr_on_a_terminal(cmd: list[str]) -> tuple[int, str]:
    """Run `cmd` with its stderr a pty; its exit status and what it wrote there."""
    terminal, child_end = pty.openpty()
    fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # else 0 columns: tqdm draws nothing
    process = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=child_end)
    os.close(child_end)
    chunks = []
    while True:
        try:
            data = os.read(terminal, 1 << 16)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(terminal)
    return process.wait(timeout=600), b"".join(chunks).decode(errors="replace")


def test_a_terminal_gets_the_loading_line_and_bars_for_conversion_and_compilation(tiny_llama_tok_dir, tmp_path):
    cmd = [sys.executable, "-m", "jaxserve.generate", "the cat sat", "--max-tokens", "3"]
    cmd += ["--model", str(tiny_llama_tok_dir), "--cache-dir", str(tmp_path / "cache")]  # empty: it converts
    status, err = stderr_on_a_terminal(cmd)
    assert status == 0, err
    assert err.startswith(f"jaxserve: loading {tiny_llama_tok_dir} (a first start converts the weights and compiles")
    assert re.search(rf"loading {tiny_llama_tok_dir.name}: +\d+%", err)  # the conversion's bar
    assert re.search(r"compiling: +\d+%", err)  # the warm-up's bar, a step per bucket
    assert "generated tokens: 3" in err
