"""single_stream.alternate: the engines take turns prompt by prompt, the warm-up round is
not counted, and each engine is charged its own CPU only.

Oracle: two stand-in engines in this process, one that burns a known amount of CPU time
per request (its `process_time`) and one that sleeps."""

import argparse
import time

from benchmarks import single_stream
from benchmarks.single_stream import PROMPTS, Engine, alternate

BURN = 0.05  # CPU seconds the busy engine spends per request
MAX_TOKENS = 10


def test_engines_alternate_and_each_is_charged_its_own_cpu():
    calls = []

    def busy(prompt):
        calls.append(("busy", prompt))
        start = time.process_time()
        while time.process_time() - start < BURN:
            pass
        return 0.01, 100.0

    def idle(prompt):
        calls.append(("idle", prompt))
        time.sleep(BURN)
        return 0.02, 50.0

    measured = []
    args = argparse.Namespace(rounds=2, contend=0, max_tokens=MAX_TOKENS)
    results = alternate(
        {"busy": Engine(busy, None), "idle": Engine(idle, None)}, args, on_measure=lambda: measured.append(len(calls))
    )

    # Three rounds (a warm-up and two measured) of every prompt through both engines, the
    # order flipping at each prompt, so each prompt meets both orders.
    turns = [(calls[i][1], calls[i][0], calls[i + 1][0]) for i in range(0, len(calls), 2)]
    assert [prompt for prompt, _, _ in turns] == PROMPTS * 3
    assert [first for _, first, _ in turns] == ["busy", "idle"] * (len(turns) // 2) + ["busy"] * (len(turns) % 2)
    assert all({a, b} == {"busy", "idle"} for _, a, b in turns)
    assert measured == [2 * len(PROMPTS)]  # called once, after the warm-up round

    busy_cpu_ms = 1e3 * BURN / MAX_TOKENS
    assert busy_cpu_ms <= results["busy"]["cpu_ms_per_token"] < 1.5 * busy_cpu_ms
    assert results["idle"]["cpu_ms_per_token"] < 0.2 * busy_cpu_ms
    assert results["busy"]["ttft_ms"] == 10 and results["idle"]["decode_tok_s"] == 50
    assert results["busy"]["other_cpu_s"] is None  # one process: the other's CPU is not separable


def test_contended_mode_is_an_option():
    args = single_stream.parse_args(["--contend", "1", "--baseline", "vllm"])
    assert args.contend == 1 and args.baseline == "vllm"
