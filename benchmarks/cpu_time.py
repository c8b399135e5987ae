"""CPU time as the benchmarks count it, and the contended mode.

On a shared machine a wall-clock ratio mostly measures each engine's share of the cores;
CPU time per generated token does not. `cpu_seconds(pid)` is the user + system time of a
process and of every process below it (vLLM's engine core is a child of its front end; a
server runs its engine in its own process), read from /proc, so the engine in this
process and one in a subprocess are counted the same way.

`contention(n)` runs n CPU-bound processes (a Python busy loop each, one core apiece)
for as long as the block lasts: the "busy machine" mode, the same for every engine timed
inside it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone, or not ours to read
        return None
    return text[text.rindex(")") + 2 :].split()  # the fields after "(comm)", from field 3 (state) on


def cpu_seconds(pid: int | None = None) -> float:
    """User + system seconds, all threads included, of this process alone (`pid` None) or
    of process `pid` and its living descendants (one that already exited is not counted).
    This process's own children (the engine under comparison, contenders) are not its."""
    if pid is None:
        return time.process_time()  # nanosecond clocks; /proc and os.times count 10 ms ticks
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            ppid, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
            children.setdefault(ppid, []).append(int(entry))
            times[int(entry)] = (utime + stime) / _TICKS
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo += children.get(p, [])
    return total


def add_contend_argument(parser) -> None:
    """--contend N, the busy-machine mode every comparison takes."""
    parser.add_argument(
        "--contend",
        type=int,
        default=0,
        metavar="N",
        help="run N CPU-bound processes beside every timed run (a busy machine, the same for every engine)",
    )


@contextlib.contextmanager
def on_every_core():
    """Processes started in the block run on every core of this process, not only on those of the
    thread that starts them (jaxserve's --cpu-compute-cores leaves its host thread the cores jax's
    threads do not use). Affinity is a thread's own, so other threads are not touched."""
    from jaxserve.parallel.devices import process_cores

    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, process_cores())
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


@contextlib.contextmanager
def contention(n: int):
    """`n` busy processes (one core each) while the block runs; none for n = 0."""
    with on_every_core():
        busy = [sys.executable, "-c", "while True: pass"]
        procs = [subprocess.Popen(busy, stdin=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


class Timed:
    """Wall seconds and CPU seconds (of this process, or of `pid`'s tree) over a `with` block."""

    def __init__(self, pid: int | None = None):
        self.pid = pid

    def __enter__(self):
        self._wall, self._cpu = time.perf_counter(), cpu_seconds(self.pid)
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._wall
        self.cpu_seconds = cpu_seconds(self.pid) - self._cpu
        return False

    def figures(self, tokens: int) -> dict:
        """seconds, output tok/s, CPU ms per token and cores busy, for `tokens` generated."""
        return {
            "seconds": self.seconds,
            "output_tok_s": tokens / self.seconds,
            "cpu_ms_per_token": 1e3 * self.cpu_seconds / tokens,
            "cores_busy": self.cpu_seconds / self.seconds,
        }


def best_alternated(calls: dict, rounds: int, repeats: int) -> dict[str, tuple[float, float]]:
    """The best (wall, CPU) seconds of each of `calls` (name -> a function that runs one timed
    pass and waits for it), run A B B A, then B A A B, and so on (each round every call twice,
    the next round starting at the other end), `repeats` passes each time. CPU time is this
    process's, all threads."""
    names = list(calls)
    best = {name: (float("inf"), float("inf")) for name in names}
    for r in range(rounds):
        first = names if r % 2 == 0 else names[::-1]
        for name in first + first[::-1]:
            for _ in range(repeats):
                wall, cpu = time.perf_counter(), time.process_time()
                calls[name]()
                best[name] = min(best[name], (time.perf_counter() - wall, time.process_time() - cpu))
    return best
