"""Prometheus metrics through `prometheus_client`, in a registry of each app's own.

Names follow vLLM's with the `jaxserve:` prefix (`vllm:num_requests_running` becomes
`jaxserve:num_requests_running`), plus `jaxserve:kv_cache_free_blocks` /
`jaxserve:kv_cache_total_blocks`, which let a test see that an aborted request gave back
its blocks, and `jaxserve:num_requests_rejected_total` (503s for a full queue).
`jaxserve:cache_config_info` carries the KV cache's settings as labels, like vLLM's.
`jaxserve:device_weight_bytes` and `jaxserve:device_kv_cache_bytes` (label `device`, a jax
device id) say what each device holds of the weights and of the KV cache (under tensor
parallelism, its shards).

Two sources: what the engine thread records as requests progress (counters and
histograms, prometheus_client's own objects), and the scheduler's stats, read at each
scrape from the engine's last snapshot (`_SnapshotCollector`). Per finished request, as
vLLM defines them: queue time from arrival to first scheduled, prefill time from first
scheduled to first token, decode time from first token to last token, and its prompt and
generated tokens (a request with n samples counts once, with all its samples' tokens).

The engine thread records; the event loop renders. A lock keeps a histogram's buckets,
sum and count consistent with each other in one scrape.

Data-parallel replicas are processes (api.replica_processes), each with its own page.
"""

from __future__ import annotations

import dataclasses
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.engine.outputs import RequestOutput
from scheduler import SchedulerStats

# vLLM's buckets, so dashboards built for it read the same.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)  # vLLM's request latency buckets: e2e and its phases
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
    """One engine's metrics: what its engine thread records, and the page `render` makes,
    in a registry of its own, every sample labelled with `model_name`."""

    def __init__(
        self,
        model_name: str,
        cache_config: dict[str, str] | None = None,
        *,
        device_bytes: dict[str, dict[int, int]] | None = None,
    ):
        self.model_name = model_name
        self.labels = (model_name,)
        f = self._families = _Families(cache_config or {})
        self.registry = f.registry
        self._lock = f.lock
        self._progress: dict[str, _Progress] = {}  # engine thread only
        if device_bytes is not None:  # LLMEngine.device_bytes(): fixed once the engine is built
            f.snapshot.device_bytes[self.labels] = device_bytes
        self.prompt_tokens = f.prompt_tokens.labels(*self.labels)
        self.generation_tokens = f.generation_tokens.labels(*self.labels)
        self.success = {reason: f.success.labels(*self.labels, reason) for reason in FINISH_REASONS}
        self.rejected_total = f.rejected.labels(*self.labels)
        for name in _HISTOGRAMS:
            setattr(self, name, getattr(f, name).labels(*self.labels))

    # -- what tests and callers read ----------------------------------------------------

    @property
    def finished(self) -> dict[str, int]:
        """Finished requests by finish reason."""
        return {
            reason: int(self._sample("jaxserve:request_success_total", finished_reason=reason))
            for reason in list(self.success)
        }

    @property
    def rejected(self) -> int:
        return int(self._sample("jaxserve:num_requests_rejected_total"))

    @property
    def prompt_tokens_total(self) -> float:
        return self._sample("jaxserve:prompt_tokens_total")

    @property
    def generation_tokens_total(self) -> float:
        return self._sample("jaxserve:generation_tokens_total")

    def _sample(self, name: str, **labels) -> float:
        with self._lock:
            own = dict(zip(self._families.label_names, self.labels))
            return self.registry.get_sample_value(name, {**own, **labels}) or 0.0

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
                    self.success[reason] = self._families.success.labels(*self.labels, reason)
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
        return self._families.render({self.labels: stats})


# Histogram attributes of Metrics: (name, help, buckets).
_HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "itl": ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "e2e": ("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", E2E_BUCKETS),
    "queue_time": ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", E2E_BUCKETS),
    "prefill_time": (
        "request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        E2E_BUCKETS,
    ),
    "decode_time": ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", E2E_BUCKETS),
    "request_prompt_tokens": ("request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS),
    "request_generation_tokens": ("request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS),
}


class _Families:
    """A registry and its metric families (prometheus_client's parents, labelled by the
    Metrics that use them). The lock keeps a scrape consistent with the recording threads."""

    def __init__(self, cache_config: dict[str, str]):
        self.label_names = (LABEL,)
        self.registry = CollectorRegistry()  # never the global one: one process may serve several apps
        self.lock = threading.Lock()
        self.snapshot = _SnapshotCollector(self.label_names, cache_config)
        self.registry.register(self.snapshot)

        def counter(name, help_, *labels):
            return Counter(f"jaxserve:{name}", help_, [*self.label_names, *labels], registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.success = counter("request_success", "Count of finished requests, by finish reason.", "finished_reason")
        self.rejected = counter("num_requests_rejected", "Requests answered 503 because the waiting queue was full.")
        for attr, (name, help_, buckets) in _HISTOGRAMS.items():
            setattr(
                self,
                attr,
                Histogram(f"jaxserve:{name}", help_, self.label_names, buckets=buckets, registry=self.registry),
            )

    def render(self, stats: dict[tuple[str, ...], SchedulerStats | None]) -> str:
        with self.lock:
            self.snapshot.stats = stats
            return generate_latest(self.registry).decode()


class _SnapshotCollector:
    """The scheduler's stats as gauges and counters, read from the snapshots `render` gives
    it: one sample per engine (per set of label values) in each family."""

    def __init__(self, label_names: tuple[str, ...], cache_config: dict[str, str]):
        self.label_names = list(label_names)
        self.cache_config = cache_config
        self.stats: dict[tuple[str, ...], SchedulerStats | None] = {}
        self.device_bytes: dict[tuple[str, ...], dict[str, dict[int, int]]] = {}

    def collect(self):
        for kind, name, help_ in (
            ("weights", "device_weight_bytes", "Bytes of the model's weights resident on each device."),
            ("kv_cache", "device_kv_cache_bytes", "Bytes of the KV cache resident on each device."),
        ):
            if self.device_bytes:
                family = GaugeMetricFamily(f"jaxserve:{name}", help_, labels=[*self.label_names, "device"])
                for labels, held in self.device_bytes.items():
                    for device, nbytes in held[kind].items():
                        family.add_metric([*labels, str(device)], nbytes)
                yield family
        if self.cache_config:
            info = GaugeMetricFamily(
                "jaxserve:cache_config_info",
                "Information of the KV cache's configuration.",
                labels=[*self.label_names, *self.cache_config],
            )
            for labels in self.stats:
                info.add_metric([*labels, *map(str, self.cache_config.values())], 1)
            yield info
        stats = {labels: s for labels, s in self.stats.items() if s is not None}
        if not stats:
            return

        def gauge(name, help_, value):
            return self._family(GaugeMetricFamily, name, help_, {k: value(s) for k, s in stats.items()})

        def counter(name, help_, value):
            return self._family(CounterMetricFamily, name, help_, {k: value(s) for k, s in stats.items()})

        yield gauge("num_requests_running", "Number of requests in model execution batches.", lambda s: s.num_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.", lambda s: s.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda s: s.kv_cache_usage)
        yield gauge("kv_cache_free_blocks", "KV-cache blocks held by no request.", lambda s: s.num_free_blocks)
        yield gauge(
            "kv_cache_total_blocks", "Usable KV-cache blocks (the null block excluded).", lambda s: s.num_total_blocks
        )
        yield gauge(
            "prefix_cache_hit_rate",
            "Fraction of prompt tokens found in the prefix cache.",
            lambda s: s.prefix_cache_hit_rate,
        )
        yield counter("prefix_cache_queries", "Prefix-cache queries, in tokens.", lambda s: s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prefix-cache hits, in tokens.", lambda s: s.prefix_cache_hits)
        yield counter(
            "num_preemptions", "Cumulative number of preemptions from the engine.", lambda s: s.num_preemptions
        )
        spec = {k: s.spec_decoding for k, s in stats.items() if s.spec_decoding is not None}
        if spec:  # vLLM's spec_decode metrics

            def spec_family(kind, name, help_, value):
                return self._family(kind, name, help_, {k: value(d) for k, d in spec.items()})

            yield spec_family(
                CounterMetricFamily, "spec_decode_num_drafts", "Number of spec decoding drafts.", lambda d: d.num_drafts
            )
            yield spec_family(
                CounterMetricFamily,
                "spec_decode_num_draft_tokens",
                "Number of draft tokens.",
                lambda d: d.num_draft_tokens,
            )
            yield spec_family(
                CounterMetricFamily,
                "spec_decode_num_accepted_tokens",
                "Number of accepted tokens.",
                lambda d: d.num_accepted_tokens,
            )
            per_position = CounterMetricFamily(
                "jaxserve:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=[*self.label_names, "position"],
            )
            for labels, d in spec.items():
                for i, n in enumerate(d.accepted_per_position):
                    per_position.add_metric([*labels, str(i)], n)
            yield per_position
            yield spec_family(
                GaugeMetricFamily,
                "spec_decode_acceptance_rate",
                "Accepted over drafted tokens since start-up.",
                lambda d: d.acceptance_rate,
            )
            yield spec_family(
                GaugeMetricFamily,
                "spec_decode_mean_acceptance_length",
                "Tokens per verification step since start-up: accepted drafts plus one.",
                lambda d: d.mean_acceptance_length,
            )

    def _family(self, kind, name: str, help_: str, values: dict[tuple[str, ...], float]):
        family = kind(f"jaxserve:{name}", help_, labels=self.label_names)
        for labels, value in values.items():
            family.add_metric(list(labels), value)
        return family
