"""Prometheus metrics, written in the text exposition format by hand (no client library).

Names follow vLLM's with the `jaxserve:` prefix (`vllm:num_requests_running` becomes
`jaxserve:num_requests_running`), plus `jaxserve:kv_cache_free_blocks` /
`jaxserve:kv_cache_total_blocks`, which let a test see that an aborted request gave back
its blocks, and `jaxserve:num_requests_rejected_total` (503s for a full queue).
`jaxserve:cache_config_info` carries the KV cache's settings as labels, like vLLM's.

The engine thread records; the event loop renders. A lock keeps a histogram's buckets,
sum and count consistent with each other in one scrape.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading

from jaxserve.outputs import RequestOutput
from scheduler import SchedulerStats

# vLLM's buckets, so dashboards built for it read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value


@dataclasses.dataclass
class _Progress:
    """What has been recorded of one running request."""

    first_token_seen: bool = False
    token_times_seen: int = 0


class Metrics:
    def __init__(self, model_name: str, cache_config: dict[str, str] | None = None):
        self.model_name = model_name
        self.cache_config = cache_config or {}
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.rejected = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self._progress: dict[str, _Progress] = {}  # engine thread only

    # -- recording (engine thread) ------------------------------------------------------

    def request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens
        self._progress[request_id] = _Progress()

    def request_rejected(self) -> None:
        with self._lock:
            self.rejected += 1

    def request_aborted(self, request_id: str) -> None:
        if self._progress.pop(request_id, None) is not None:
            with self._lock:
                self.finished["abort"] += 1

    def record(self, output: RequestOutput) -> None:
        """Count one step's output of a request: tokens, TTFT, inter-token gaps, and the end."""
        progress = self._progress.get(output.request_id)
        if progress is None:
            return
        m = output.metrics
        with self._lock:
            self.generation_tokens += sum(len(c.new_token_ids) for c in output.outputs)
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
                self.finished[reason] = self.finished.get(reason, 0) + 1
                if m.finished_time is not None:
                    self.e2e.observe(m.finished_time - m.arrival_time)

    # -- rendering (event loop) ---------------------------------------------------------

    def render(self, stats: SchedulerStats) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        label = f'model_name="{_escape(self.model_name)}"'
        out: list[str] = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP jaxserve:{name} {help_}")
            out.append(f"# TYPE jaxserve:{name} {kind}")
            for suffix, labels, value in samples:
                out.append(f"jaxserve:{name}{suffix}{{{','.join([label, *labels])}}} {_number(value)}")

        def gauge(name, help_, value):
            metric(name, "gauge", help_, [("", [], value)])

        def counter(name, help_, value):
            metric(f"{name}_total", "counter", help_, [("", [], value)])

        def histogram(name, help_, h: Histogram):
            samples, cumulative = [], 0
            for bound, n in zip((*h.buckets, float("inf")), h.counts):
                cumulative += n
                samples.append(("_bucket", [f'le="{_number(bound)}"'], cumulative))
            samples += [("_sum", [], h.sum), ("_count", [], cumulative)]
            metric(name, "histogram", help_, samples)

        with self._lock:
            if self.cache_config:
                metric("cache_config_info", "gauge", "Information of the KV cache's configuration.",
                       [("", [f'{k}="{_escape(str(v))}"' for k, v in self.cache_config.items()], 1)])
            gauge("num_requests_running", "Number of requests in model execution batches.", stats.num_running)
            gauge("num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting)
            gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage)
            gauge("kv_cache_free_blocks", "KV-cache blocks held by no request.", stats.num_free_blocks)
            gauge("kv_cache_total_blocks", "Usable KV-cache blocks (the null block excluded).",
                  stats.num_total_blocks)
            gauge("prefix_cache_hit_rate", "Fraction of prompt tokens found in the prefix cache.",
                  stats.prefix_cache_hit_rate)
            counter("prefix_cache_queries", "Prefix-cache queries, in tokens.", stats.prefix_cache_queries)
            counter("prefix_cache_hits", "Prefix-cache hits, in tokens.", stats.prefix_cache_hits)
            counter("num_preemptions", "Cumulative number of preemptions from the engine.", stats.num_preemptions)
            counter("prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens)
            counter("generation_tokens", "Number of generation tokens processed.", self.generation_tokens)
            metric("request_success_total", "counter", "Count of finished requests, by finish reason.",
                   [("", [f'finished_reason="{r}"'], n) for r, n in self.finished.items()])
            counter("num_requests_rejected", "Requests answered 503 because the waiting queue was full.",
                    self.rejected)
            spec = stats.spec_decoding
            if spec is not None:  # vLLM's spec_decode metrics
                counter("spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts)
                counter("spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens)
                counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens)
                metric("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                       "Accepted tokens per draft position.",
                       [("", [f'position="{i}"'], n) for i, n in enumerate(spec.accepted_per_position)])
                gauge("spec_decode_acceptance_rate", "Accepted over drafted tokens since start-up.",
                      spec.acceptance_rate)
                gauge("spec_decode_mean_acceptance_length",
                      "Tokens per verification step since start-up: accepted drafts plus one.",
                      spec.mean_acceptance_length)
            histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft)
            histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl)
            histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                      self.e2e)
        return "\n".join(out) + "\n"


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
