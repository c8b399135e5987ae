"""Per-request sampling parameters, validated when they are made."""

from __future__ import annotations

import dataclasses
import functools
import json as json_module
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """A constraint on the output's text (vLLM's names); exactly one field is set.

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object; regex: a
    regular expression the whole output matches; choice: one of these strings exactly;
    grammar: a Lark grammar (llguidance's dialect; `start` is the start rule).

    disable_additional_properties (a JSON schema's option, vLLM's name): True (the default,
    as vLLM's xgrammar backend) reads an object schema that does not say
    `additionalProperties` as `additionalProperties: false`; False keeps JSON Schema's own
    default, where any other key may appear.

    after_token_id: the grammar holds only after this token (a reasoning model's `</think>`,
    as vLLM constrains the answer, never the thinking): until the token is generated every
    token is allowed and none is fed to the grammar, the token itself included. None: from
    the first output token. Not part of `key()`: the same grammar compiles once either way.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_additional_properties: bool = True
    after_token_id: int | None = None

    KINDS = ("json", "json_object", "regex", "choice", "grammar")

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_fields = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar; got {set_fields or 'none'}"
            )
        checks = [
            (
                self.json is None or isinstance(self.json, (dict, str)),
                f"structured_outputs.json must be a JSON schema (object or its text), got {self.json!r}",
            ),
            (
                isinstance(self.json_object, bool),
                f"structured_outputs.json_object must be a bool, got {self.json_object!r}",
            ),
            (
                self.regex is None or isinstance(self.regex, str),
                f"structured_outputs.regex must be a string, got {self.regex!r}",
            ),
            (
                self.choice is None
                or (
                    isinstance(self.choice, tuple)
                    and bool(self.choice)
                    and all(isinstance(c, str) and c for c in self.choice)
                ),
                f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}",
            ),
            (
                self.grammar is None or isinstance(self.grammar, str),
                f"structured_outputs.grammar must be a string, got {self.grammar!r}",
            ),
            (
                isinstance(self.disable_additional_properties, bool),
                "structured_outputs.disable_additional_properties must be a bool, "
                f"got {self.disable_additional_properties!r}",
            ),
            (
                self.after_token_id is None or (_is_int(self.after_token_id) and self.after_token_id >= 0),
                f"structured_outputs.after_token_id must be a token id, got {self.after_token_id!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, Any, bool]:
        """The compiled grammar's identity: hashable, the same for specs that compile to the
        same grammar (a schema dict by its canonical JSON; where the grammar starts aside)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json_module.dumps(value, sort_keys=True, separators=(",", ":"))
        return (self.kind, value, self.disable_additional_properties)

    def __hash__(self) -> int:
        return hash((self.key(), self.after_token_id))

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
        return cls(**fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request's continuation (OpenAI / vLLM semantics).

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 switch those filters off; see
    `jaxserve.sample.sampler` for exactly which tokens the filters keep when logits tie.
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
    # How the output text is decoded (tokenizer.decode's options, vLLM's defaults).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # How many top alternatives to report per prompt token (None: no prompt logprobs); such
    # a request computes its whole prompt, skipping the prefix cache.
    prompt_logprobs: int | None = None
    # Token-level constraints, applied to the raw logits before everything else (vLLM's):
    # biases added to the logits ({token id: bias in [-100, 100]}), the only ids that may be
    # sampled, and words whose token sequence the output may never contain.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    # A constraint on the output's text (JSON schema, regex, choice, grammar): the sampler
    # masks every token the grammar does not allow. A dict becomes StructuredOutputsParams.
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    # vLLM's thinking_token_budget: a reasoning model may think this many tokens at most, then
    # its end-of-thinking token (`thinking_end_token_id`, e.g. `</think>`) is forced.
    thinking_token_budget: int | None = None
    thinking_end_token_id: int | None = None
    # bad_words as token sequences (`with_bad_words_tokenized`; the engine fills it in).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = dataclasses.field(
        default=(), init=False, repr=False, compare=False
    )

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 100

    def __post_init__(self) -> None:
        # Accept lists (and a bare string for stop) from callers; store tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.logit_bias is not None:  # OpenAI's keys are strings ("50"); vLLM's are ints
            object.__setattr__(self, "logit_bias", _token_id_keys(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        bad_words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words or ())
        object.__setattr__(self, "bad_words", bad_words)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))
        elif not (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams)):
            raise ValueError(
                "structured_outputs must be an object with one of json, json_object, regex, choice, "
                f"grammar; got {self.structured_outputs!r}"
            )
        self._validate()

    def _validate(self) -> None:
        checks = [
            (_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (
                _is_number(self.temperature) and self.temperature >= 0,
                f"temperature must be >= 0, got {self.temperature!r}",
            ),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (_is_int(self.top_k) and self.top_k >= 0, f"top_k must be >= 0 (or -1 for off), got {self.top_k!r}"),
            (_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}"),
            (
                _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}",
            ),
            (
                _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}",
            ),
            (
                _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
            ),
            (self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}"),
            (_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens!r}"),
            (
                self.thinking_token_budget is None
                or (_is_int(self.thinking_token_budget) and self.thinking_token_budget >= 0),
                f"thinking_token_budget must be an integer >= 0, got {self.thinking_token_budget!r}",
            ),
            (
                self.thinking_token_budget is None
                or (_is_int(self.thinking_end_token_id) and int(self.thinking_end_token_id or 0) >= 0),
                "thinking_token_budget needs thinking_end_token_id, the token that ends the thinking, got "
                f"{self.thinking_end_token_id!r}",
            ),
            (
                _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}",
            ),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop!r}"),
            (
                all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}",
            ),
            (isinstance(self.ignore_eos, bool), f"ignore_eos must be a bool, got {self.ignore_eos!r}"),
            (
                isinstance(self.include_stop_str_in_output, bool),
                f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}",
            ),
            (
                isinstance(self.skip_special_tokens, bool),
                f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}",
            ),
            (
                isinstance(self.spaces_between_special_tokens, bool),
                f"spaces_between_special_tokens must be a bool, got {self.spaces_between_special_tokens!r}",
            ),
            (
                self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= self.MAX_LOGPROBS),
                f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}",
            ),
            (
                self.prompt_logprobs is None
                or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS),
                f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
            ),
            (
                self.logit_bias is None
                or all(
                    _is_int(t) and t >= 0 and _is_number(b) and -self.MAX_LOGIT_BIAS <= b <= self.MAX_LOGIT_BIAS
                    for t, b in self.logit_bias.items()
                ),
                f"logit_bias must map token ids to biases in [-{self.MAX_LOGIT_BIAS}, {self.MAX_LOGIT_BIAS}], "
                f"got {self.logit_bias!r}",
            ),
            (
                self.allowed_token_ids is None
                or (bool(self.allowed_token_ids) and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
                f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}",
            ),
            (
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                f"bad_words must be non-blank strings, got {self.bad_words!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    # Column order of `row`, as the runner's sampling arrays expect them.
    ROW_FIELDS = (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    )

    @functools.cached_property
    def row(self) -> tuple[float, ...]:
        """The per-token sampling numbers, ROW_FIELDS in order (built once, read every step)."""
        return tuple(float(getattr(self, name)) for name in self.ROW_FIELDS)

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def uses_token_bias(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words: the sampler's per-row bias over the vocabulary."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    def check_token_ids(self, vocab_size: int) -> None:
        """The token ids these parameters name must lie in the vocabulary."""
        after = (
            self.structured_outputs.after_token_id
            if isinstance(self.structured_outputs, StructuredOutputsParams)
            else None
        )
        for name, ids in (
            ("logit_bias", self.logit_bias or ()),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("structured_outputs.after_token_id", () if after is None else (after,)),
            ("thinking_end_token_id", () if self.thinking_end_token_id is None else (self.thinking_end_token_id,)),
        ):
            outside = sorted(t for t in ids if t >= vocab_size)
            if outside:
                raise ValueError(
                    f"{name} must name token ids below the vocabulary size {vocab_size}, got {outside[:8]}"
                )

    def with_bad_words_tokenized(self, encode: Callable[[str], Sequence[int]]) -> SamplingParams:
        """A copy whose `bad_words_token_ids` holds each bad word's tokens, as vLLM forms them:
        the word as it is and with a leading space (a word mid-text), the latter only when it
        is a different word of as many tokens. `encode`: text -> token ids, no special tokens."""
        sequences: list[tuple[int, ...]] = []
        for word in self.bad_words:
            plain = tuple(encode(word.lstrip()))
            spaced = tuple(encode(" " + word.lstrip()))
            sequences.append(plain)
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        params = self.replace()
        object.__setattr__(params, "bad_words_token_ids", tuple(s for s in sequences if s))
        return params

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> SamplingParams:
        """Build from user input, naming any field that does not exist."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**fields)

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _token_id_keys(bias: dict[Any, float]) -> dict[Any, float]:
    """{token id: bias} with the ids as ints ("50" -> 50); a key that is no id stays, to be refused."""
    if not isinstance(bias, dict):
        return bias
    return {int(t) if isinstance(t, str) and t.isascii() and t.isdigit() else t: b for t, b in bias.items()}
