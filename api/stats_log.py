"""A stats line every few seconds while serving, as vLLM logs one (`--stats-interval`):

    INFO api.stats_log: Avg prompt throughput: 41.6 tokens/s, Avg generation throughput: 12.8 tokens/s,
    Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 3.2%, Prefix cache hit rate: 25.0%

Only when something happened since the last line (tokens came in or out, or requests run
or wait): an idle server stays quiet. Everything is read where /metrics reads it, nothing
is counted again: the throughputs are the interval's growth of the prompt and generation
token counters (api.metrics.Metrics; prompt tokens count when a request is added), the
rest is the scheduler's last snapshot (EngineLoop.stats): running and waiting requests,
the share of KV-cache blocks in use, and the prefix cache's hit rate since start-up
(prompt tokens found in the cache over those looked up, as jaxserve:prefix_cache_hit_rate).
With speculative decoding the drafts' acceptance rate since start-up follows.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import NamedTuple

from api.engine_loop import EngineLoop
from api.replica_processes import REPLICA_ENV
from scheduler import SchedulerStats

logger = logging.getLogger(__name__)


class StatsSample(NamedTuple):
    """The counters at one moment."""

    time: float  # time.monotonic()
    prompt_tokens: float
    generation_tokens: float
    stats: SchedulerStats | None


def sample(engine_loop: EngineLoop) -> StatsSample:
    metrics = engine_loop.metrics
    prompt, generated = metrics.prompt_tokens_total, metrics.generation_tokens_total
    return StatsSample(time.monotonic(), prompt, generated, engine_loop.stats)


def stats_line(last: StatsSample, now: StatsSample) -> str | None:
    """The line for the interval from `last` to `now`; None when nothing happened in it."""
    stats = now.stats
    prompt, generated = now.prompt_tokens - last.prompt_tokens, now.generation_tokens - last.generation_tokens
    busy = stats is not None and (stats.num_running or stats.num_waiting)
    if not (prompt or generated or busy):
        return None
    seconds = max(now.time - last.time, 1e-9)
    line = (
        f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
        f"Avg generation throughput: {generated / seconds:.1f} tokens/s"
    )
    if stats is not None:
        line += (
            f", Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.kv_cache_usage:.1%}, Prefix cache hit rate: {stats.prefix_cache_hit_rate:.1%}"
        )
        if stats.spec_decoding is not None:
            line += f", Draft acceptance rate: {stats.spec_decoding.acceptance_rate:.1%}"
    return line


async def log_stats(engine_loop: EngineLoop, interval: float) -> None:
    """Log `stats_line` every `interval` seconds, until cancelled (the app's lifespan runs this).
    A data-parallel replica (api.replica_processes) says which it is, as vLLM's "Engine 000:"."""
    replica = os.environ.get(REPLICA_ENV)
    prefix = f"Replica {replica}: " if replica else ""
    last = sample(engine_loop)
    while True:
        await asyncio.sleep(interval)
        now = sample(engine_loop)
        line = stats_line(last, now)
        if line is not None:
            logger.info("%s%s", prefix, line)
        last = now
