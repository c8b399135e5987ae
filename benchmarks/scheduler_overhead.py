"""Host cost of scheduling, and KV memory waste of paging, with no model at all.

1. Time of one `schedule()` + `update()` with 256 running sequences in decode and a
   16k-block pool (median and p99 over many steps), next to the time of an empty Python
   loop over the same 256 requests (the floor any per-request bookkeeping pays).
2. KV waste for the throughput workload (benchmarks/workload.py) run through the
   scheduler with fake tokens: allocated minus used slots, averaged over steps, for the
   paged block manager and for a contiguous allocation that reserves max_model_len
   slots per running request (the PagedAttention paper's comparison).

    python benchmarks/scheduler_overhead.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workload import synthetic_workload  # noqa: E402
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig  # noqa: E402


def step_overhead(num_seqs: int, num_blocks: int, steps: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    s = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks, block_size=16, max_num_seqs=num_seqs, max_num_batched_tokens=8192, max_model_len=4096
        )
    )
    for i in range(num_seqs):
        prompt = rng.integers(100, 40000, int(rng.integers(32, 512))).tolist()
        s.add_request(Request(str(i), prompt, SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)))
    while any(r.num_output_tokens == 0 for r in s.requests.values()):  # get everyone past prefill
        batch = s.schedule()
        s.update(batch, np.ones(batch.num_seqs, np.int32))
    times = []
    for _ in range(steps):
        tokens = rng.integers(100, 40000, num_seqs).astype(np.int32)
        start = time.perf_counter()
        batch = s.schedule()
        s.update(batch, tokens)
        times.append(time.perf_counter() - start)
        assert batch.num_seqs == num_seqs and batch.num_tokens == num_seqs
    running = list(s.running)
    floor = []
    for _ in range(steps):
        start = time.perf_counter()
        for r in running:
            r.num_computed_tokens += 0
        floor.append(time.perf_counter() - start)
    ms = np.array(times) * 1000
    return {
        "num_seqs": num_seqs,
        "num_blocks": num_blocks,
        "steps": steps,
        "median_ms": float(np.median(ms)),
        "p99_ms": float(np.percentile(ms, 99)),
        "python_loop_floor_ms": float(np.median(floor) * 1000),
    }


def kv_waste(num_requests: int, max_num_seqs: int, max_model_len: int, block_size: int = 16, seed: int = 0) -> dict:
    work = synthetic_workload(num_requests, seed=seed)
    num_blocks = 1 + 2 * max_num_seqs * (768 // block_size)  # room for max_num_seqs of the longest request
    s = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=512,
            max_model_len=max_model_len,
        )
    )
    for i, (p, n) in enumerate(zip(work.prompts, work.output_lens)):
        s.add_request(Request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    paged_alloc = paged_used = contiguous_alloc = steps = 0
    while s.has_unfinished:
        batch = s.schedule()
        if batch is None:
            s.update(None)
            continue
        # Occupancy while this step runs: every running request's blocks and its tokens.
        scheduled = dict(zip(batch.request_ids, batch.num_scheduled_tokens.tolist()))
        for r in s.running:
            paged_alloc += len(s.kv.block_ids(r.request_id)) * block_size
            paged_used += r.num_computed_tokens + scheduled.get(r.request_id, 0)
            contiguous_alloc += max_model_len
        steps += 1
        s.update(batch, np.ones(batch.num_seqs, np.int32))
    return {
        "block_size": block_size,
        "max_model_len": max_model_len,
        "steps": steps,
        "paged_waste": 1 - paged_used / paged_alloc,
        "contiguous_waste": 1 - paged_used / contiguous_alloc,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=16384)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--max-model-len", type=int, default=2048, help="what a contiguous allocation reserves")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    overhead = step_overhead(args.num_seqs, args.num_blocks, args.steps)
    waste = kv_waste(128, 64, args.max_model_len)
    if args.json:
        print(json.dumps({"step": overhead, "kv_waste": waste}, indent=2))
        return 0
    print(
        f"schedule() + update(), {overhead['num_seqs']} running sequences, {overhead['num_blocks']} blocks, "
        f"{overhead['steps']} steps"
    )
    print(f"| {'median (ms)':>11} | {'p99 (ms)':>8} | {'bare loop over the requests (ms)':>32} |")
    print(f"|{'-' * 13}|{'-' * 10}|{'-' * 34}|")
    print(
        f"| {overhead['median_ms']:>11.3f} | {overhead['p99_ms']:>8.3f} | {overhead['python_loop_floor_ms']:>32.4f} |"
    )
    print()
    print("KV waste, throughput workload (128 requests, 64 running), allocated minus used slots over allocated")
    print(f"| {'allocation':<44} | {'waste':>6} |")
    print(f"|{'-' * 46}|{'-' * 8}|")
    print(f"| {f'paged, blocks of {waste["block_size"]} tokens':<44} | {waste['paged_waste']:>6.1%} |")
    label = f"contiguous, max_model_len={waste['max_model_len']} per request"
    print(f"| {label:<44} | {waste['contiguous_waste']:>6.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
