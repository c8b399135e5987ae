"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Types and value ranges are checked here (a wrong one is a 400 naming the parameter); the
ranges are `SamplingParams`' own, written as Field constraints so that the OpenAPI schema
states them and a request that fits the schema is accepted (`SamplingParams` still checks
them, and whatever a schema cannot state: min_tokens <= max_tokens, ...). Only `n` has an
API cap of its own. Fields the server does not know are ignored, as vLLM does, and logged;
fields it knows but cannot honour (tools, suffix, ...) are refused with a 400
rather than silently dropped, and the schema says which values they may take.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from api.errors import bad_request, from_value_error
from api.openapi import CONTEXT_TOKENS, OUTPUT_TOKENS, REQUEST_CHAT_TEMPLATE, TOKEN_ID, TOKEN_ID_KEYS
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
# logit_bias: {"token id": bias}, the ids as decimal strings (OpenAI's); the served schema
# bounds them by the vocabulary (`TOKEN_ID_KEYS`).
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")]
Bias = Annotated[float, Field(ge=-SamplingParams.MAX_LOGIT_BIAS, le=SamplingParams.MAX_LOGIT_BIAS)]
LogitBias = Annotated[dict[TokenIdKey, Bias], Field(json_schema_extra={"additionalProperties": False,
                                                                       TOKEN_ID_KEYS: True})]
BadWord = Annotated[str, Field(pattern=r"\S")]  # not blank


def refused_unless(**schema) -> dict:
    """Schema keywords for a field the server takes but cannot honour: the values it accepts
    (the handler refuses the others with a 400 and a message that says why)."""
    return {"json_schema_extra": schema}


# vLLM fields that would change the output, which this server cannot honour yet: a value
# other than the harmless one (None: any value) is a 400 naming the field; dropping it
# silently would return different text than vLLM does.
UNSUPPORTED_VLLM_FIELDS: dict[str, Any] = {
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
                     "structured_outputs", "guided_decoding_backend", "guided_whitespace_pattern")),
    "use_beam_search": False, "length_penalty": 1.0, "logits_processors": None, "documents": None,
    "return_tokens_as_token_ids": False,
    # Declared by one endpoint, so an extra field only of the other: chat's echo (the last
    # message before the reply) and completions' response_format.
    "echo": False, "response_format": {"type": "text"},
}
_logged_unknown_fields: set[str] = set()
_MAX_LOGGED_UNKNOWN_FIELDS = 1000


class _Body(BaseModel):
    # strict: "16" is not a number and true is not 1, as in the OpenAI API.
    model_config = ConfigDict(extra="allow", strict=True)

    def warn_ignored(self) -> list[str]:
        """The unknown fields this request carried (the server answers them in the
        `x-ignored-fields` header); each name is logged once per process, as vLLM does."""
        names = sorted(self.model_extra or ())
        fresh = [name for name in names if name not in _logged_unknown_fields]
        if fresh and len(_logged_unknown_fields) < _MAX_LOGGED_UNKNOWN_FIELDS:  # a bound: clients choose the names
            _logged_unknown_fields.update(fresh)
            # repr: a client's field names must not forge log lines
            logger.warning("ignoring unknown request field(s): %s", ", ".join(repr(name)[:40] for name in fresh[:8]))
        return names


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
    logit_bias: LogitBias | None = None
    # vLLM's extra sampling fields.
    top_k: Annotated[int, Field(ge=-1), INTEGRAL] | None = None  # 0 or -1: no top-k filter
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, json_schema_extra={OUTPUT_TOKENS: True}), INTEGRAL] = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None  # only these may be sampled
    bad_words: list[BadWord] | None = None  # words whose tokens the output may never hold
    # How the text is decoded, as tokenizer.decode (special tokens such as <|im_end|> shown when false).
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: Int = 0  # lower is served first
    # None: the endpoint's default (completions add the tokenizer's special tokens, chat
    # leaves BOS to the template).
    add_special_tokens: bool | None = None
    cache_salt: str | None = Field(None, min_length=1)  # requests with different salts share no cached KV
    # vLLM's: each prompt token's logprob and this many top alternatives (-1, the whole vocabulary: a 400).
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    # Keep only the last k prompt tokens (-1: the model's context length), as vLLM.
    truncate_prompt_tokens: Annotated[int, Field(ge=1, json_schema_extra={CONTEXT_TOKENS: True}), INTEGRAL] \
        | Literal[-1] | None = None

    def check_common(self) -> None:
        self.warn_ignored()
        for name, harmless in UNSUPPORTED_VLLM_FIELDS.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and value != harmless:
                raise bad_request(f"{name} is not supported by this server", name)
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    @property
    def engine_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None, param_names: dict[str, str],
                        defaults: dict[str, Any]) -> SamplingParams:
        """The engine's parameters; fields the request leaves unset take `defaults` (the model's
        generation config). A value out of range is a 400 naming the API parameter."""
        fields: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed, logprobs=logprobs,
            prompt_logprobs=self.engine_prompt_logprobs,
            stop=self.stop or (), stop_token_ids=self.stop_token_ids or (), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or (),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
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

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """echo with logprobs covers the prompt's tokens too (as vLLM)."""
        if self.echo and self.logprobs is not None:
            return max(self.prompt_logprobs or 0, self.logprobs)
        return self.prompt_logprobs

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


# apply_chat_template's parameters and the request's own fields: chat_template_kwargs holds
# template variables only (a chat_template there would also bypass --trust-request-chat-template).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs", "template_vars",
})


class ChatTemplateFields(_Body):
    """vLLM's chat-template fields (chat completions and /tokenize). add_generation_prompt
    None: true unless continue_final_message."""

    # The schema states that the two are not both true.
    model_config = ConfigDict(json_schema_extra={"not": {
        "required": ["add_generation_prompt", "continue_final_message"],
        "properties": {"add_generation_prompt": {"const": True}, "continue_final_message": {"const": True}}}})

    add_generation_prompt: bool | None = None
    continue_final_message: bool = False  # render the last (assistant) message open, to be continued
    # Only with --trust-request-chat-template (else the schema allows null alone).
    chat_template: str | None = Field(None, json_schema_extra={REQUEST_CHAT_TEMPLATE: True})
    chat_template_kwargs: dict[str, Any] | None = Field(None, json_schema_extra={
        "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}}})  # extra variables for the template

    def template_messages(self) -> list[dict]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]

    def check_template_fields(self) -> None:
        kwargs = self.template_kwargs()
        if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              "continue_final_message")
        for name in self.chat_template_kwargs or ():
            if name in RESERVED_TEMPLATE_KWARGS:  # transformers' own arguments, not template variables
                raise bad_request(f"chat_template_kwargs may not set {name!r}", "chat_template_kwargs")

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `encode_chat`: the request's switches and template variables."""
        add = self.add_generation_prompt if self.add_generation_prompt is not None else not self.continue_final_message
        kwargs = {"add_generation_prompt": add, "continue_final_message": self.continue_final_message,
                  "template_vars": self.chat_template_kwargs or {}}
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return kwargs


class ChatCompletionRequest(_SamplingBody, ChatTemplateFields):
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
        self.check_template_fields()
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
