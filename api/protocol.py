"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Types are checked here (a wrong type is a 400); value ranges are checked by
`SamplingParams`, whose error names the parameter (only `n` has an API cap of its own). Fields the server does not know are
ignored, as vLLM does, and logged; fields it knows but cannot honour (tools, logit_bias,
suffix, ...) are refused with a 400 rather than silently dropped.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.errors import bad_request, from_value_error
from scheduler import SamplingParams

logger = logging.getLogger(__name__)


class _Body(BaseModel):
    # strict: "16" is not a number and true is not 1, as in the OpenAI API.
    model_config = ConfigDict(extra="allow", strict=True)

    def warn_ignored(self) -> None:
        if self.model_extra:
            logger.warning("ignoring unknown request field(s): %s", ", ".join(sorted(self.model_extra)))


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    """The fields both endpoints share."""

    model: str | None = None  # None: the served model
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    priority: int = 0  # lower is served first
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

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

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
    content: str | list[dict[str, Any]] | None = None
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
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

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
