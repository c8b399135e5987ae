"""Per-request sampling parameters, validated when they are made."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request's continuation (OpenAI / vLLM semantics).

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 switch those filters off; see
    `jaxserve.sampler` for exactly which tokens the filters keep when logits tie.
    `seed` makes the output depend only on this request, whatever else is batched with it;
    the `n` samples of a request draw independent streams from it. Without a seed, each
    sample gets 64 random bits from `secrets`.
    Stop strings are cut from the text (kept with `include_stop_str_in_output`) and, like
    EOS and stop tokens, do not end a request before it has `min_tokens` tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top alternatives to report per generated token

    MAX_LOGPROBS = 20

    def __post_init__(self):
        # Accept lists (and a bare string for stop) from callers; store tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        checks = [
            (_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (_is_number(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0, got {self.temperature!r}"),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (_is_int(self.top_k) and self.top_k >= 0, f"top_k must be >= 0 (or -1 for off), got {self.top_k!r}"),
            (_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty!r}"),
            (self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}"),
            (_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens!r}"),
            (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}"),
            (all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"),
            (isinstance(self.ignore_eos, bool), f"ignore_eos must be a bool, got {self.ignore_eos!r}"),
            (isinstance(self.include_stop_str_in_output, bool),
             f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}"),
            (self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= self.MAX_LOGPROBS),
             f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    # Column order of `row`, as the runner's sampling arrays expect them.
    ROW_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")

    @functools.cached_property
    def row(self) -> tuple[float, ...]:
        """The per-token sampling numbers, ROW_FIELDS in order (built once, read every step)."""
        return tuple(float(getattr(self, name)) for name in self.ROW_FIELDS)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> SamplingParams:
        """Build from user input, naming any field that does not exist."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**fields)

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
