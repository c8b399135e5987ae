"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Types and value ranges are checked here (a wrong one is a 400 naming the parameter); the
ranges are `SamplingParams`' own, written as Field constraints so that the OpenAPI schema
states them and a request that fits the schema is accepted (`SamplingParams` still checks
them, and whatever a schema cannot state: min_tokens <= max_tokens, ...). Only `n` has an
API cap of its own. Fields the server does not know are ignored, as vLLM does, and logged;
fields it knows but cannot honour (tools, logit_bias, suffix, ...) are refused with a 400
rather than silently dropped, and the schema says which values they may take.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from api.errors import bad_request, from_value_error
from api.openapi import OUTPUT_TOKENS, TOKEN_ID
from scheduler import SamplingParams

logger = logging.getLogger(__name__)

MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS


def _integral(value):
    # JSON Schema's "integer" includes 16.0, so this server takes it too (strict mode alone
    # would not); "16" and true stay refused.
    return int(value) if isinstance(value, float) and value.is_integer() else value


# NOTE: bounds go before INTEGRAL in an Annotated: after a BeforeValidator, pydantic writes
# them into the JSON schema as "ge"/"le", which no JSON Schema validator knows.
INTEGRAL = BeforeValidator(_integral)
Int = Annotated[int, INTEGRAL]
# Their upper bounds (the model's vocabulary, its context) are written into the served schema.
TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID: True}), INTEGRAL]
OutputTokens = Annotated[int, Field(ge=1, json_schema_extra={OUTPUT_TOKENS: True}), INTEGRAL]
StopString = Annotated[str, Field(min_length=1)]


def refused_unless(**schema) -> dict:
    """Schema keywords for a field the server takes but cannot honour: the values it accepts
    (the handler refuses the others with a 400 and a message that says why)."""
    return {"json_schema_extra": schema}



class _Body(BaseModel):
    # strict: "16" is not a number and true is not 1, as in the OpenAI API.
    model_config = ConfigDict(extra="allow", strict=True)

    def warn_ignored(self) -> None:
        if self.model_extra:  # repr: a client's field names must not forge log lines
            names = sorted(self.model_extra)
            logger.warning("ignoring %d unknown request field(s): %s", len(names),
                           ", ".join(repr(name)[:40] for name in names[:8]))


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    """The fields both endpoints share (ranges: SamplingParams')."""

    model: str | None = None  # None: the served model
    n: Annotated[int, Field(ge=1, le=128), INTEGRAL] = 1
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: Int | None = None
    stop: str | list[StopString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, **refused_unless(maxProperties=0))
    # vLLM's extra sampling fields.
    top_k: Annotated[int, Field(ge=-1), INTEGRAL] | None = None  # 0 or -1: no top-k filter
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, json_schema_extra={OUTPUT_TOKENS: True}), INTEGRAL] = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    priority: Int = 0  # lower is served first
    # None: the endpoint's default (completions add the tokenizer's special tokens, chat
    # leaves BOS to the template).
    add_special_tokens: bool | None = None
    cache_salt: str | None = Field(None, min_length=1)  # requests with different salts share no cached KV

    def check_common(self) -> None:
        self.warn_ignored()
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None, param_names: dict[str, str],
                        defaults: dict[str, Any]) -> SamplingParams:
        """The engine's parameters; fields the request leaves unset take `defaults` (the model's
        generation config). A value out of range is a 400 naming the API parameter."""
        fields: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed, logprobs=logprobs,
            stop=self.stop or (), stop_token_ids=self.stop_token_ids or (), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                        repetition_penalty=self.repetition_penalty)
        fields.update({k: v for k, v in defaults.items() if k in optional})
        fields.update({k: v for k, v in optional.items() if v is not None})
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            raise from_value_error(e, param_names) from None


class CompletionRequest(_SamplingBody):
    """POST /v1/completions."""


    prompt: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)] \
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    max_tokens: OutputTokens | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    echo: bool = False
    suffix: str | None = Field(None, **refused_unless(maxLength=0))
    best_of: Annotated[int, Field(ge=1), INTEGRAL] | None = None  # must equal n

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must equal n (this server returns every sample)", "best_of")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (no prompt logprobs)", "echo")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class ChatMessage(_Body):
    """One message; extra fields (tool_calls, tool_call_id, ...) go to the chat template as they are."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = Field(None, **refused_unless(items={
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}))
    name: str | None = None

    def for_template(self, index: int) -> dict:
        message = self.model_dump(exclude_none=True)
        if self.role == "developer":  # OpenAI's newer name for the system role
            message["role"] = "system"
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"only text content parts are supported, got type {part.get('type')!r}",
                                      f"messages[{index}].content")
                texts.append(part["text"])
            message["content"] = "\n".join(texts)
        return message


class ChatCompletionRequest(_SamplingBody):
    """POST /v1/chat/completions."""


    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's older name; max_completion_tokens wins when both are set, so this one states
    # no context bound (a request may carry a max_tokens that is never used).
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    max_completion_tokens: OutputTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None  # needs logprobs
    tools: list[dict[str, Any]] | None = Field(None, **refused_unless(maxItems=0))
    tool_choice: str | dict[str, Any] | None = Field(None, **refused_unless(enum=["none", "auto", None]))
    functions: list[dict[str, Any]] | None = Field(None, **refused_unless(maxItems=0))
    response_format: dict[str, Any] | None = Field(None, **refused_unless(properties={"type": {"const": "text"}}))

    def check(self) -> None:
        self.check_common()
        if self.tools or self.functions:
            raise bad_request("tools and functions are not supported by this server",
                              "tools" if self.tools else "functions")
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice is not supported by this server", "tool_choice")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("only response_format {\"type\": \"text\"} is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output limit asked for, and the name of the field it came from."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def template_messages(self) -> list[dict]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]
