"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), as pydantic models.

Types and value ranges are checked here (a wrong one is a 400 naming the parameter); the
ranges are `SamplingParams`' own, written as Field constraints so that the OpenAPI schema
states them and a request that fits the schema is accepted (`SamplingParams` still checks
them, and whatever a schema cannot state: min_tokens <= max_tokens, ...). Only `n` and
`seed` (vLLM's range) have API caps of their own. Every field's text must be valid Unicode
(`check_unicode`). Fields the server does not know are ignored, as vLLM does, logged, and
named in the `x-ignored-fields` header (nested ones too: stream_options.x); vLLM's fields
that it cannot honour (api.vllm_fields: beam search, suffix, ...) are refused with a 400
rather than silently dropped, and the schema says which values declared ones may take.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from api.chat_reply import required_schema
from api.errors import APIError, bad_request, from_value_error
from api.openapi import (
    CONTEXT_TOKENS,
    OUTPUT_TOKENS,
    REQUEST_CHAT_TEMPLATE,
    SEED,
    SEED_RANGE,
    TOKEN_ID,
    TOKEN_ID_KEYS,
)
from api.vllm_fields import refused_fields
from scheduler import SamplingParams
from scheduler.sampling_params import StructuredOutputsParams

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
# vLLM's range (a torch long). The engine keeps a seed mod 2**64, which maps this range one to
# one; a larger seed would silently wrap onto another (2**64 onto 0).
Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1], json_schema_extra={SEED: True}), INTEGRAL]
# logit_bias: {"token id": bias}, the ids as decimal strings (OpenAI's); the served schema
# bounds them by the vocabulary (`TOKEN_ID_KEYS`).
TokenIdKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")]
Bias = Annotated[float, Field(ge=-SamplingParams.MAX_LOGIT_BIAS, le=SamplingParams.MAX_LOGIT_BIAS)]
LogitBias = Annotated[
    dict[TokenIdKey, Bias], Field(json_schema_extra={"additionalProperties": False, TOKEN_ID_KEYS: True})
]
BadWord = Annotated[str, Field(pattern=r"\S")]  # not blank


def refused_unless(**schema) -> dict:
    """Schema keywords for a field the server takes but cannot honour: the values it accepts
    (the handler refuses the others with a 400 and a message that says why)."""
    return {"json_schema_extra": schema}


_logged_unknown_fields: set[str] = set()
_MAX_LOGGED_UNKNOWN_FIELDS = 1000


def check_unicode(value, path: str = "") -> None:
    """Refuse text that is not valid Unicode anywhere in `value` (a field's JSON value): a lone
    surrogate such as "\\ud800", which Python's JSON parser accepts but the tokenizer cannot
    encode (a TypeError, so a 500) and no response could echo back."""
    if isinstance(value, str):
        if value.isascii():
            return
        try:
            value.encode()
        except UnicodeEncodeError as e:
            where = f" (at {path})" if path else ""
            reason = (
                f"not valid Unicode text{where}: a lone surrogate U+{ord(value[e.start]):04X} at character {e.start}"
            )
            # The message goes through a context value: a template would read braces in `path`.
            raise PydanticCustomError("invalid_unicode", "{reason}", {"reason": reason}) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, path)  # before `key` may appear in a message
            check_unicode(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, (str, dict, list)):  # a long list of token ids costs no call per id
                check_unicode(item, f"{path}[{index}]")


class _Body(BaseModel):
    # strict: "16" is not a number and true is not 1, as in the OpenAI API.
    model_config = ConfigDict(extra="allow", strict=True)

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value):
        # Every field's text, nested bodies included (they check their own fields), so a 400
        # names the field: prompt, messages[0].content.
        check_unicode(value)
        return value

    # True where extra fields are passed on rather than ignored (a message's go to the template).
    takes_extra_fields: ClassVar[bool] = False

    def unknown_fields(self, path: str = "") -> list[str]:
        """The names of the fields this request carried that no model declares, nested ones
        as their path (stream_options.x, response_format.json_schema.y, tools[0].z)."""
        names = [] if self.takes_extra_fields else [f"{path}{name}" for name in self.model_extra or ()]
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for index, item in items:
                if isinstance(item, _Body):
                    where = f"{path}{name}" if index is None else f"{path}{name}[{index}]"
                    names += item.unknown_fields(f"{where}.")
        return names

    def warn_ignored(self) -> list[str]:
        """The unknown fields this request carried, nested ones too (the server answers them
        in the `x-ignored-fields` header); each name is logged once per process, as vLLM does."""
        names = sorted(self.unknown_fields())
        fresh = [name for name in names if name not in _logged_unknown_fields]
        if fresh and len(_logged_unknown_fields) < _MAX_LOGGED_UNKNOWN_FIELDS:  # a bound: clients choose the names
            _logged_unknown_fields.update(fresh)
            # repr: a client's field names must not forge log lines
            logger.warning("ignoring unknown request field(s): %s", ", ".join(repr(name)[:40] for name in fresh[:8]))
        return names


class StreamOptions(_Body):
    include_usage: bool = False
    # With include_usage, every chunk carries its choice's usage so far (vLLM's).
    continuous_usage_stats: bool = False


# -- structured output: the fields that constrain the text (vLLM's shapes) ----------------


class Constraint(NamedTuple):
    """One request field's constraint on the output."""

    field: str  # the request field that sets it (named when two are given)
    fields: dict[str, Any]  # StructuredOutputsParams' fields
    param: str  # where a 400 about its content points: response_format, tools[0].function.parameters
    what: str  # how a message names it: "response_format 'person'", "function 'get_weather'"


# How a 400 names what could not be compiled, per StructuredOutputsParams kind.
_KIND_NOUNS = {
    "json": "JSON schema",
    "json_object": "JSON schema",
    "regex": "regular expression",
    "choice": "choices",
    "grammar": "grammar",
}


def invalid_constraint(constraint: Constraint, kind: str, detail: str) -> APIError:
    """The 400 for a constraint the grammar engine refused, saying what is wrong (`detail`)."""
    return bad_request(
        f"Cannot use the {_KIND_NOUNS[kind]} of {constraint.what} (invalid, or a feature this "
        f"server does not support): {detail.strip()}",
        constraint.param,
    )


class JsonSchemaFormat(_Body):
    """response_format's json_schema. `strict` is accepted and needs nothing: the output
    always follows the schema."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # required with type json_schema (a 400 naming response_format)

    def constraint(self) -> Constraint | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint("response_format", {"json_object": True}, "response_format", "response_format")
        if self.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema", "response_format")
        schema = self.json_schema.schema_
        fields = {"json": schema} if schema is not None else {"json_object": True}
        return Constraint("response_format", fields, "response_format", f"response_format {self.json_schema.name!r}")


NonEmptyString = Annotated[str, Field(min_length=1)]


class StructuredOutputs(_Body):
    """vLLM's structured_outputs: exactly one constraint, and its options."""

    model_config = ConfigDict(extra="forbid")  # a misspelt constraint must not leave the output free

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[NonEmptyString], Field(min_length=1)] | None = None
    grammar: str | None = None  # Lark (llguidance's) or GBNF
    json_object: bool | None = None
    # Options: those that need nothing here are accepted (there is no fallback backend, and
    # JSON never has free whitespace); those that would change the output are refused.
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    # None or true: an object schema without additionalProperties takes no other keys (vLLM's
    # xgrammar); false: JSON Schema's default, any other key too.
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = Field(None, **refused_unless(enum=[None]))
    structural_tag: str | None = Field(None, **refused_unless(enum=[None]))

    def constraint(self) -> Constraint:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name):
                raise bad_request(f"structured_outputs.{name} is not supported by this server", "structured_outputs")
        fields = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object or None,
        }
        fields = {k: v for k, v in fields.items() if v is not None}
        if len(fields) != 1:
            raise bad_request(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object "
                f"(got {', '.join(fields) or 'none'})",
                "structured_outputs",
            )
        (kind,) = fields
        if self.disable_additional_properties is not None:
            fields["disable_additional_properties"] = self.disable_additional_properties
        return Constraint("structured_outputs", fields, "structured_outputs", f"structured_outputs.{kind}")


# The legacy guided_* fields and the constraint each one sets.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_spec(constraints: list[Constraint]) -> tuple[StructuredOutputsParams, Constraint] | None:
    """The one constraint among `constraints` as the engine's parameter, and where it came
    from; None without any. More than one is a 400."""
    if not constraints:
        return None
    if len(constraints) > 1:
        names = ", ".join(c.field for c in constraints)
        raise bad_request(f"only one constraint on the output may be given, got {names}", constraints[1].field)
    (constraint,) = constraints
    fields = dict(constraint.fields)
    if "choice" in fields:
        fields["choice"] = tuple(fields["choice"])
    try:
        return StructuredOutputsParams(**fields), constraint
    except ValueError as e:
        raise bad_request(f"{constraint.param}: {e}", constraint.param) from None


class _SamplingBody(_Body):
    """The fields both endpoints share (ranges: SamplingParams')."""

    endpoint: ClassVar[str]  # its table in api.vllm_fields

    model: str | None = None  # None: the served model
    n: Annotated[int, Field(ge=1, le=128), INTEGRAL] = 1
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: Seed | None = None
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
    # Prefill/decode disaggregation (vLLM's; api.disagg): hand the prompt's KV over, or pull it.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: each prompt token's logprob and this many top alternatives (-1, the whole vocabulary: a 400).
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    # Keep only k prompt tokens (-1: the model's context length), as vLLM: the last ones, or the
    # first ones with truncation_side "right".
    truncate_prompt_tokens: (
        Annotated[int, Field(ge=1, json_schema_extra={CONTEXT_TOKENS: True}), INTEGRAL] | Literal[-1] | None
    ) = None
    truncation_side: Literal["left", "right"] | None = None  # None: "left"
    # vLLM's: the response carries the prompt's and each choice's token ids.
    return_token_ids: bool | None = None
    # Structured output: at most one of these (a schema, a regex, a choice, a grammar).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmptyString], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    def check_common(self) -> None:
        self.warn_ignored()
        self.check_refused_fields()
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")

    def check_refused_fields(self) -> None:
        """A 400 for a vLLM field this server cannot honour (api.vllm_fields), unless its value
        is a harmless one: dropping it would answer with other output than vLLM's."""
        extra = self.model_extra or {}
        for name, use in refused_fields(self.endpoint).items():
            value = getattr(self, name) if name in type(self).model_fields else extra.get(name)
            if not any(value == harmless for harmless in use.harmless):
                why = f" ({use.reason})" if use.reason else ""
                raise bad_request(f"{name} is not supported by this server{why}", name)

    def constraints(self) -> list[Constraint]:
        """Each field's constraint on the output (a 400 for more than one comes later)."""
        found = [
            self.response_format.constraint() if self.response_format else None,
            self.structured_outputs.constraint() if self.structured_outputs else None,
        ]
        found += [
            Constraint(name, {kind: getattr(self, name)}, name, name)
            for name, kind in GUIDED_FIELDS.items()
            if getattr(self, name) is not None
        ]
        return [c for c in found if c is not None]

    def structured_outputs_spec(self) -> tuple[StructuredOutputsParams, Constraint] | None:
        """The request's constraint on the output and where it came from (None: free text)."""
        return structured_spec(self.constraints())

    @property
    def engine_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk: as vLLM, only together with include_usage."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        param_names: dict[str, str],
        defaults: dict[str, Any],
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The engine's parameters; fields the request leaves unset take `defaults` (the model's
        generation config). A value out of range is a 400 naming the API parameter."""
        fields: dict[str, Any] = dict(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=self.seed,
            logprobs=logprobs,
            prompt_logprobs=self.engine_prompt_logprobs,
            stop=self.stop or (),
            stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or (),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
        if structured_outputs is not None:
            fields["structured_outputs"] = structured_outputs
        optional = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
        )
        fields.update({k: v for k, v in defaults.items() if k in optional})
        fields.update({k: v for k, v in optional.items() if v is not None})
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            raise from_value_error(e, param_names) from None


class CompletionRequest(_SamplingBody):
    """POST /v1/completions."""

    endpoint = "completions"
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: OutputTokens | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None
    echo: bool = False
    suffix: str | None = Field(None, **refused_unless(maxLength=0))
    best_of: Annotated[int, Field(ge=1), INTEGRAL] | None = None  # must equal n

    def check(self) -> None:
        self.check_common()
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

    takes_extra_fields = True
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = Field(
        None,
        **refused_unless(
            items={
                "type": "object",
                "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
            }
        ),
    )
    name: str | None = None

    def for_template(self, index: int) -> dict:
        message = self.model_dump(exclude_none=True)
        # As vLLM: no content (an assistant turn of tool calls) is empty text, which templates
        # that add or test message.content can read.
        message.setdefault("content", "")
        if self.role == "developer":  # OpenAI's newer name for the system role
            message["role"] = "system"
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"only text content parts are supported, got type {part.get('type')!r}",
                        f"messages[{index}].content",
                    )
                texts.append(part["text"])
            message["content"] = "\n".join(texts)
        for call in message.get("tool_calls") or ():
            # As vLLM: templates get a call's arguments as an object (OpenAI sends JSON text).
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass  # not JSON: the template gets the text as it came
        return message


# apply_chat_template's parameters and the request's own fields: chat_template_kwargs holds
# template variables only (a chat_template there would also bypass --trust-request-chat-template).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "kwargs",
        "template_vars",
    }
)


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")  # OpenAI's
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ChatTemplateFields(_Body):
    """vLLM's chat-template fields (chat completions and /tokenize). add_generation_prompt
    None: true unless continue_final_message."""

    # The schema states that the two are not both true.
    model_config = ConfigDict(
        json_schema_extra={
            "not": {
                "required": ["add_generation_prompt", "continue_final_message"],
                "properties": {"add_generation_prompt": {"const": True}, "continue_final_message": {"const": True}},
            }
        }
    )

    add_generation_prompt: bool | None = None
    continue_final_message: bool = False  # render the last (assistant) message open, to be continued
    # Only with --trust-request-chat-template (else the schema allows null alone).
    chat_template: str | None = Field(None, json_schema_extra={REQUEST_CHAT_TEMPLATE: True})
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, json_schema_extra={"propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}}}
    )  # extra variables for the template
    tools: list[Tool] | None = None  # described to the model by the template

    def template_messages(self) -> list[dict]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]

    def check_template_fields(self) -> None:
        kwargs = self.template_kwargs()
        if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
            raise bad_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        for name in self.chat_template_kwargs or ():
            if name in RESERVED_TEMPLATE_KWARGS:  # transformers' own arguments, not template variables
                raise bad_request(f"chat_template_kwargs may not set {name!r}", "chat_template_kwargs")

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `encode_chat`: the request's switches and template variables."""
        add = self.add_generation_prompt if self.add_generation_prompt is not None else not self.continue_final_message
        kwargs = {
            "add_generation_prompt": add,
            "continue_final_message": self.continue_final_message,
            "template_vars": self.chat_template_kwargs or {},
        }
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        if self.tools:  # as vLLM: the template may describe them to the model
            kwargs["tools"] = [tool.model_dump(by_alias=True, exclude_none=True) for tool in self.tools]
        return kwargs


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingBody, ChatTemplateFields):
    """POST /v1/chat/completions."""

    endpoint = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's older name; max_completion_tokens wins when both are set, so this one states
    # no context bound (a request may carry a max_tokens that is never used).
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    max_completion_tokens: OutputTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL] | None = None  # needs logprobs
    # None: "auto" with tools, else "none" (vLLM's defaults). "auto" needs the server's tool-call
    # parser (--enable-auto-tool-choice); "required" and a named function are held to the
    # tools' schemas by a grammar.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true; false keeps the first call only
    functions: list[dict[str, Any]] | None = Field(None, **refused_unless(maxItems=0))
    # With --reasoning-parser: false leaves the thinking out of the reply.
    include_reasoning: bool = True
    # With --reasoning-parser: the thinking may run this many tokens, then its end is forced (vLLM's).
    thinking_token_budget: Annotated[int, Field(ge=0), INTEGRAL] | None = None
    # A template variable (gpt-oss's templates read it), unless chat_template_kwargs sets it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def check(self) -> None:
        self.check_common()
        self.check_template_fields()
        if self.tool_choice not in (None, "none") and not self.tools:
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        self.called_tool_index()  # a 400 unless the named function is among the tools
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named (api.chat_reply reads the output by it)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"

    def called_tool_index(self) -> int | None:
        """The index in tools of the function that tool_choice names (its arguments are the output), or None."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        name = self.tool_choice.function.name
        for index, tool in enumerate(self.tools or ()):
            if tool.function.name == name:
                return index
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")

    def called_tool(self) -> Tool | None:
        index = self.called_tool_index()
        return None if index is None else self.tools[index]

    def constraints(self) -> list[Constraint]:
        mode = self.tool_mode
        if mode == "named":
            index = self.called_tool_index()
            function = self.tools[index].function
            constraint = Constraint(
                "tool_choice",
                {"json": function.arguments_schema()},
                f"tools[{index}].function.parameters",
                f"function {function.name!r}",
            )
        elif mode == "required":
            functions = [{"name": t.function.name, "parameters": t.function.arguments_schema()} for t in self.tools]
            schema = required_schema(functions, self.parallel_tool_calls is not False)
            constraint = Constraint("tool_choice", {"json": schema}, "tools", "the tools")
        else:
            return super().constraints()
        return [*super().constraints(), constraint]

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = super().template_kwargs()
        if self.reasoning_effort is not None:
            kwargs["template_vars"] = {"reasoning_effort": self.reasoning_effort, **kwargs["template_vars"]}
        return kwargs

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output limit asked for, and the name of the field it came from."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"
