"""What the engine returns for a request: its samples' text, tokens, logprobs and timings."""

from __future__ import annotations

import dataclasses

from scheduler import SpecDecodingStats


@dataclasses.dataclass(frozen=True)
class Logprob:
    """A prompt token's (or an alternative's) log-probability, as vLLM's `Logprob`."""

    logprob: float
    rank: int  # 1 + how many tokens the model found strictly more likely
    decoded_token: str | None = None  # the token's own text (None without a tokenizer)


@dataclasses.dataclass
class CompletionOutput:
    """One of a request's `n` samples, as of the latest step."""

    index: int
    text: str  # everything generated so far (stop string excluded)
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless the request asked for logprobs (as vLLM)
    # Per generated token: the top alternatives and the sampled token, {token_id: logprob}.
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    new_text: str = ""  # what this step added to `text` (for streaming)
    new_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # of the first sample
    first_scheduled_time: float | None = None  # when the first sample first ran (the queue time ends)
    # Its verified drafts (its samples' together), once it has finished; None if none were.
    spec_decoding: SpecDecodingStats | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # With SamplingParams.prompt_logprobs: per prompt token, its logprob given the tokens
    # before it and the top alternatives, {token_id: Logprob}; None for the first (as vLLM).
    # Complete from the first output that has a generated token on.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # With add_request(export_kv=True), on the finished output: the prompt's KV for another
    # engine (prefill/decode disaggregation; a jaxserve.model.kv_cache.KVHandoff).
    kv_handoff: object | None = None
