"""The benchmarks' CPU accounting: a subprocess's whole tree counted, this process alone
without its children, so an engine in a subprocess and one in this process compare alike.

Oracle: a grandchild that burns a known amount of its own CPU time (its `process_time`)."""

import os
import subprocess
import sys
import time

from benchmarks.cpu_time import Timed, contention, cpu_seconds

BURN = 0.4  # CPU seconds the grandchild spends, once told to, before it reports and sleeps
GRANDCHILD = f"""
import sys, time
sys.stdin.readline()  # "go": the caller's clock is running
start = time.process_time()
while time.process_time() - start < {BURN}:
    pass
print("burnt", flush=True)
time.sleep(60)
"""
CHILD = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {GRANDCHILD!r}])"
TICK = 1 / os.sysconf("SC_CLK_TCK")  # /proc counts CPU time in these


def test_a_process_tree_counts_its_grandchildren():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with Timed(child.pid) as tree, Timed() as me:
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "burnt"
        # Each of the two readings may fall short by a tick; the start-ups may land inside.
        assert BURN - 2 * TICK <= tree.cpu_seconds < BURN + 0.5
        assert me.cpu_seconds < BURN  # this process waited; its child's CPU is not its own
        figures = tree.figures(tokens=100)
        assert figures["cpu_ms_per_token"] == 1e3 * tree.cpu_seconds / 100
        assert figures["cores_busy"] == tree.cpu_seconds / tree.seconds
    finally:
        subprocess.run(["pkill", "-P", str(child.pid)])
        child.wait()


def test_contenders_run_only_inside_the_block():
    with contention(1) as procs:
        time.sleep(0.3)
        assert procs[0].poll() is None and cpu_seconds(procs[0].pid) > 0
    assert procs[0].poll() is not None


def test_best_alternated_runs_a_b_b_a_and_keeps_each_best():
    from benchmarks.cpu_time import best_alternated

    ran = []
    calls = {"a": lambda: ran.append("a"), "b": lambda: ran.append("b")}
    best = best_alternated(calls, rounds=2, repeats=2)
    assert ran == ["a", "a", "b", "b", "b", "b", "a", "a"] + ["b", "b", "a", "a", "a", "a", "b", "b"]
    assert set(best) == {"a", "b"} and all(0 <= wall < 1 and 0 <= cpu < 1 for wall, cpu in best.values())
