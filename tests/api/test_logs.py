"""What `python -m api` logs, read from a real start on the tiny Llama: jaxserve's own lines
and not jax's backend probing or orbax's per-checkpoint chatter, the loading line before
anything else, and vLLM's periodic stats line once requests ran (a short --stats-interval),
agreeing with /metrics; and `stats_line` on hand-made samples."""

from __future__ import annotations

import re
import time

from api.stats_log import StatsSample, stats_line
from scheduler import SchedulerStats
from tests.api.conftest import run_server

FLAGS = [
    *("--served-model-name", "tiny", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"),
    *("--max-model-len", "64", "--num-blocks", "64", "--block-size", "4", "--stats-interval", "0.5"),
]
STATS = re.compile(
    r"INFO api\.stats_log: Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
    r"Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: ([\d.]+)%, Prefix cache hit rate: ([\d.]+)%$",
    re.M,
)


def wait_for(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return result


def test_a_start_logs_jaxserve_lines_only_and_stats_lines_while_busy(tiny_folder, tmp_path):
    with run_server(tmp_path, "--model", str(tiny_folder), *FLAGS) as server:
        time.sleep(1.5)  # three intervals of an idle server
        idle = server.log.read_text()
        client = server.client()
        prompt = "the cat sat on the mat and the dog sat on the log"
        for _ in range(2):  # the second finds the first's prompt blocks in the prefix cache
            client.completions.create(model="tiny", prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True})

        def settled():  # the interval the last request ended in has a line; the idle ones after it have none
            found = STATS.findall(server.log.read_text())
            return found if found and found[-1][2:4] == ("0", "0") else None

        lines = wait_for(settled)
        time.sleep(1.5)
        log = server.log.read_text()
        hit_rate = server.wait_idle()["jaxserve:prefix_cache_hit_rate"]

    assert "Unable to initialize backend" not in log  # jax's INFO lines about the backends it tried
    assert not re.search(r"absl|orbax", log)  # orbax logs through absl: ~16 INFO lines per save or restore
    assert not re.search(r"(loading \S+|compiling): +\d+%", log)  # no progress bars: the log is no terminal
    assert log.index("jaxserve: loading") < log.index("INFO jaxserve.engine.builder: KV cache:") < log.index("serving")
    assert "api.stats_log" not in idle  # an idle server stays quiet
    assert STATS.findall(log) == lines  # ... also after its requests
    assert any(float(prompt_rate) > 0 for prompt_rate, *_ in lines)
    assert any(float(generation_rate) > 0 for _, generation_rate, *_ in lines)
    assert lines[-1][4] == "0.0"  # KV cache usage: the finished requests hold no block
    assert 0 < float(lines[-1][5]) == round(100 * hit_rate, 1)  # the prefix cache's hit rate, as /metrics has it


def stats(running=0, waiting=0, usage=0.0, queries=0, hits=0) -> SchedulerStats:
    return SchedulerStats(running, waiting, 10, 10, usage, queries, hits, 0)


def test_the_stats_line_reports_the_intervals_throughput_and_nothing_when_idle():
    idle = StatsSample(100.0, 40, 8, stats())
    assert stats_line(idle, idle._replace(time=110.0)) is None
    busy = StatsSample(110.0, 60, 58, stats(running=2, waiting=1, usage=0.25, queries=40, hits=10))
    assert stats_line(idle, busy) == (
        "Avg prompt throughput: 2.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 2 reqs, "
        "Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    stuck = busy._replace(time=120.0)  # no token moved, but requests wait: still reported
    assert stats_line(busy, stuck).startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0")
