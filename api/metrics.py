"""Prometheus metrics through `prometheus_client`, in a registry of each app's own.

Names follow vLLM's with the `jaxserve:` prefix (`vllm:num_requests_running` becomes
`jaxserve:num_requests_running`), plus `jaxserve:kv_cache_free_blocks` /
`jaxserve:kv_cache_total_blocks`, which let a test see that an aborted request gave back
its blocks, and `jaxserve:num_requests_rejected_total` (503s for a full queue).
`jaxserve:cache_config_info` carries the KV cache's settings as labels, like vLLM's.

Two sources: what the engine thread records as requests progress (counters and
histograms, prometheus_client's own objects), and the scheduler's stats, read at each
scrape from the engine's last snapshot (`_SnapshotCollector`). Per finished request, as
vLLM defines them: queue time from arrival to first scheduled, prefill time from first
scheduled to first token, decode time from first token to last token, and its prompt and
generated tokens (a request with n samples counts once, with all its samples' tokens).

The engine thread records; the event loop renders. A lock keeps a histogram's buckets,
sum and count consistent with each other in one scrape.
"""

from __future__ import annotations

import dataclasses
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.outputs import RequestOutput
from scheduler import SchedulerStats

# vLLM's buckets, so dashboards built for it read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # vLLM's request latency buckets: e2e and its phases
# vLLM's 1-2-5 series up to the context length; up to a million tokens here (the bound is not known here).
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)
FINISH_REASONS = ("stop", "length", "abort")
LABEL = "model_name"


@dataclasses.dataclass
class _Progress:
    """What has been recorded of one running request."""

    first_token_seen: bool = False
    token_times_seen: int = 0


class Metrics:
    def __init__(self, model_name: str, cache_config: dict[str, str] | None = None):
        self.model_name = model_name
        self.registry = CollectorRegistry()  # never the global one: one process may serve several apps
        self._lock = threading.Lock()
        self._progress: dict[str, _Progress] = {}  # engine thread only
        self._snapshot = _SnapshotCollector(model_name, cache_config or {})
        self.registry.register(self._snapshot)

        def counter(name, help_, *labels):
            return Counter(f"jaxserve:{name}", help_, [LABEL, *labels], registry=self.registry)

        def histogram(name, help_, buckets):
            return Histogram(f"jaxserve:{name}", help_, [LABEL], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(model_name)
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.").labels(model_name)
        success = counter("request_success", "Count of finished requests, by finish reason.", "finished_reason")
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success = success
        self.rejected_total = counter("num_requests_rejected",
                                      "Requests answered 503 because the waiting queue was full.").labels(model_name)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", E2E_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", E2E_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.", TOKEN_BUCKETS)

    # -- what tests and callers read ----------------------------------------------------

    @property
    def finished(self) -> dict[str, int]:
        """Finished requests by finish reason."""
        return {reason: int(self._sample("jaxserve:request_success_total", finished_reason=reason))
                for reason in list(self.success)}

    @property
    def rejected(self) -> int:
        return int(self._sample("jaxserve:num_requests_rejected_total"))

    def _sample(self, name: str, **labels) -> float:
        with self._lock:
            return self.registry.get_sample_value(name, {LABEL: self.model_name, **labels}) or 0.0

    # -- recording (engine thread) ------------------------------------------------------

    def request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens.inc(num_prompt_tokens)
        self._progress[request_id] = _Progress()

    def request_rejected(self) -> None:
        with self._lock:
            self.rejected_total.inc()

    def request_aborted(self, request_id: str) -> None:
        if self._progress.pop(request_id, None) is not None:
            with self._lock:
                self.success["abort"].inc()

    def record(self, output: RequestOutput) -> None:
        """Count one step's output of a request: tokens, TTFT, inter-token gaps, and the end."""
        progress = self._progress.get(output.request_id)
        if progress is None:
            return
        m = output.metrics
        with self._lock:
            self.generation_tokens.inc(sum(len(c.new_token_ids) for c in output.outputs))
            if not progress.first_token_seen and m.first_token_time is not None:
                progress.first_token_seen = True
                self.ttft.observe(m.time_to_first_token)
            # Inter-token latency follows the first sample (the engine keeps its token times).
            times = m.token_times
            for i in range(max(1, progress.token_times_seen), len(times)):
                self.itl.observe(times[i] - times[i - 1])
            progress.token_times_seen = len(times)
            if output.finished:
                del self._progress[output.request_id]
                reason = output.outputs[0].finish_reason or "stop"
                if reason not in self.success:
                    self.success[reason] = self._success.labels(self.model_name, reason)
                self.success[reason].inc()
                self._record_finished(output)

    def _record_finished(self, output: RequestOutput) -> None:
        """vLLM's per-request histograms (under the lock)."""
        m = output.metrics
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(c.token_ids) for c in output.outputs))
        scheduled = m.first_scheduled_time
        if scheduled is not None:
            self.queue_time.observe(scheduled - m.arrival_time)
            if m.first_token_time is not None:  # a request can end without a token (its context outgrew the cache)
                self.prefill_time.observe(m.first_token_time - scheduled)
                self.decode_time.observe(m.last_token_time - m.first_token_time)

    # -- rendering (event loop) ---------------------------------------------------------

    def render(self, stats: SchedulerStats | None) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        with self._lock:
            self._snapshot.stats = stats
            return generate_latest(self.registry).decode()


class _SnapshotCollector:
    """The scheduler's stats as gauges and counters, read from the snapshot `render` gives it."""

    def __init__(self, model_name: str, cache_config: dict[str, str]):
        self.model_name = model_name
        self.cache_config = cache_config
        self.stats: SchedulerStats | None = None

    def collect(self):
        if self.cache_config:
            info = GaugeMetricFamily("jaxserve:cache_config_info", "Information of the KV cache's configuration.",
                                     labels=[LABEL, *self.cache_config])
            info.add_metric([self.model_name, *map(str, self.cache_config.values())], 1)
            yield info
        stats = self.stats
        if stats is None:
            return
        yield self._gauge("num_requests_running", "Number of requests in model execution batches.", stats.num_running)
        yield self._gauge("num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage)
        yield self._gauge("kv_cache_free_blocks", "KV-cache blocks held by no request.", stats.num_free_blocks)
        yield self._gauge("kv_cache_total_blocks", "Usable KV-cache blocks (the null block excluded).",
                          stats.num_total_blocks)
        yield self._gauge("prefix_cache_hit_rate", "Fraction of prompt tokens found in the prefix cache.",
                          stats.prefix_cache_hit_rate)
        yield self._counter("prefix_cache_queries", "Prefix-cache queries, in tokens.", stats.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prefix-cache hits, in tokens.", stats.prefix_cache_hits)
        yield self._counter("num_preemptions", "Cumulative number of preemptions from the engine.",
                            stats.num_preemptions)
        spec = stats.spec_decoding
        if spec is not None:  # vLLM's spec_decode metrics
            yield self._counter("spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts)
            yield self._counter("spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens)
            yield self._counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                spec.num_accepted_tokens)
            per_position = CounterMetricFamily("jaxserve:spec_decode_num_accepted_tokens_per_pos",
                                               "Accepted tokens per draft position.", labels=[LABEL, "position"])
            for i, n in enumerate(spec.accepted_per_position):
                per_position.add_metric([self.model_name, str(i)], n)
            yield per_position
            yield self._gauge("spec_decode_acceptance_rate", "Accepted over drafted tokens since start-up.",
                              spec.acceptance_rate)
            yield self._gauge("spec_decode_mean_acceptance_length",
                              "Tokens per verification step since start-up: accepted drafts plus one.",
                              spec.mean_acceptance_length)

    def _gauge(self, name: str, help_: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"jaxserve:{name}", help_, labels=[LABEL])
        family.add_metric([self.model_name], value)
        return family

    def _counter(self, name: str, help_: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"jaxserve:{name}", help_, labels=[LABEL])
        family.add_metric([self.model_name], value)
        return family
