"""The OpenAPI document served at /openapi.json: what each route accepts and what it answers.

Request bodies come from `api.protocol`, whose Field constraints are SamplingParams' own
ranges, so a request that fits the schema is one the server accepts, except for the rules
a schema cannot state (a prompt plus max_tokens within the context, min_tokens <=
max_tokens, stream_options only with stream, ...), which are 400s. This module adds the
answers: the success bodies, the OpenAI error body of every 4xx/5xx the routes give, the
Prometheus text of /metrics, the served model's bounds (token ids below its vocabulary
size, token counts below its context length), and the bearer security of /v1 when the
server has an API key.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Marks for integers whose maximum depends on the served model (set in `install_openapi`):
TOKEN_ID = "x-token-id"  # below the vocabulary size
OUTPUT_TOKENS = "x-output-tokens"  # a count of generated tokens: below the context length,
# since a prompt has at least one token (the server refuses more with context_length_exceeded)
CONTEXT_TOKENS = "x-context-tokens"  # a count of prompt tokens: at most the context length
# ... and for bounds a float cannot hold, restated exactly: FastAPI's document model keeps
# bounds as floats, which would serve 2**63 - 1 as 9.223372036854776e18 (2**63).
SEED = "x-seed"  # vLLM's range of seeds (a torch long)
SEED_RANGE = (-(2**63), 2**63 - 1)
REQUEST_CHAT_TEMPLATE = "x-request-chat-template"  # null only, unless the server trusts request templates
# ... and for objects keyed by token ids written as decimal strings (logit_bias): their key pattern.
TOKEN_ID_KEYS = "x-token-id-keys"


class PrometheusResponse(PlainTextResponse):
    media_type = PROMETHEUS_CONTENT_TYPE


# -- bodies -----------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error (4xx) or server_error (5xx)
    param: str | None  # the parameter at fault, as a client writes it: messages[0].role
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class SpeculativeDecodingUsage(BaseModel):
    """jaxserve's: the call's verified drafts, named as vLLM's spec_decode metrics."""

    num_drafts: int  # verification steps that checked draft tokens
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]  # accepted at draft position 0, 1, ...


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None  # only with --enable-prompt-tokens-details
    # Only where the call's requests verified drafts (--speculative-config).
    speculative_decoding: SpeculativeDecodingUsage | None = None


FinishReason = Literal["stop", "length", "abort"]
ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]  # tool_calls: the reply called tools


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    # vLLM's, with prompt_logprobs (or echo with logprobs): per prompt token null (the first) or
    # {token_id: {logprob, rank, decoded_token}}; not in streamed chunks.
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    # vLLM's, with return_token_ids: the choice's prompt (in a stream, with its first chunk) and
    # the tokens it generated (in a stream, the chunk's).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion; with stream_options.include_usage,
    `usage` is null but on the last chunk (which has no choices), or with
    continuous_usage_stats too, on every chunk its choice's usage so far."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON that follows the function's parameters schema


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # null when the reply is only tool calls
    tool_calls: list[ToolCall] | None = None
    # With --reasoning-parser: the thinking (vLLM's older and newer names, the same text).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, as in CompletionChoice
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class FunctionCallDelta(BaseModel):
    name: str | None = None  # on the call's first chunk
    arguments: str  # the next piece of the arguments' JSON


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None  # on the call's first chunk, with type and the function's name
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None  # on each choice's first chunk
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    reasoning: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the chunk's


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (`usage` as in CompletionChunk)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids: on each choice's first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None  # a LoRA adapter's folder (--lora-modules)
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


# -- responses, for the route decorators ------------------------------------------------

_ERRORS = {
    400: "Invalid parameters, or a request this model cannot serve (code `context_length_exceeded`: the "
    "prompt and max_tokens do not fit in the context).",
    401: "No API key, or a wrong one (code `invalid_api_key`).",
    404: "Unknown model (code `model_not_found`).",
    413: "The request body is over --max-request-body-bytes (code `request_too_large`).",
    503: "The queue is full (code `server_overloaded`, with Retry-After) or the engine has stopped "
    "(code `engine_dead`).",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before retrying (when overloaded)",
        "required": False,
        "schema": {"type": "string"},
    }
}


def errors(*statuses: int) -> dict[int, dict]:
    """OpenAI error responses for the route decorator's `responses`."""
    return {
        s: {"model": ErrorResponse, "description": _ERRORS[s], **({"headers": _RETRY_AFTER} if s == 503 else {})}
        for s in statuses
    }


def generation(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int, dict]:
    """The responses of a generation endpoint: `model` as JSON, or with `stream: true`
    server-sent events: `chunk`s, an ErrorResponse if the stream fails, then `[DONE]`."""
    # NOTE: `itemSchema` describes each event (OpenAPI 3.2's keyword, which FastAPI also
    # writes into 3.1 documents); the chunk schemas are added to the components below.
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [{"$ref": _ref(chunk)}, {"$ref": _ref(ErrorResponse)}]},
            },
        ]
    }
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {
        200: {
            "model": model,
            "description": f"A {model.__name__}, or with `stream: true` server-sent events: "
            f"{chunk.__name__}s, then `data: [DONE]`.",
            "content": {"text/event-stream": {"itemSchema": event}},
        },
        **errors(400, 404, 413, 503),
    }


STREAM_CHUNKS = (CompletionChunk, ChatCompletionChunk)
_REF = "#/components/schemas/{model}"


def _ref(model: type[BaseModel]) -> str:
    return _REF.format(model=model.__name__)


# -- the document -----------------------------------------------------------------------


def install_openapi(
    app: FastAPI, *, vocab_size: int, max_model_len: int, api_key: bool, trust_request_chat_template: bool = False
) -> None:
    """Serve the document above at /openapi.json (built once, on the first request)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _drop_validation_errors(schema)
            _add_stream_chunks(schema)
            _bound_per_model(
                schema,
                {
                    TOKEN_ID: {"maximum": vocab_size - 1},
                    OUTPUT_TOKENS: {"maximum": max_model_len - 1},
                    CONTEXT_TOKENS: {"maximum": max_model_len},
                    SEED: {"minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]},
                },
            )
            if api_key:
                _require_bearer_on_v1(schema)
            if not trust_request_chat_template:
                _refuse_request_chat_templates(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _operations(schema: dict):
    for path, item in schema["paths"].items():
        for operation in item.values():
            yield path, operation


def _drop_validation_errors(schema: dict) -> None:
    # FastAPI documents a 422 for every body; this server answers 400 instead (api.errors).
    for _, operation in _operations(schema):
        operation["responses"].pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)


def _add_stream_chunks(schema: dict) -> None:
    # Only referenced from event streams, so FastAPI does not know them. "validation" mode:
    # a key with a default may be absent (`usage` without include_usage).
    _, defs = models_json_schema([(m, "validation") for m in STREAM_CHUNKS], ref_template=_REF)
    schema["components"]["schemas"].update(defs["$defs"])


def _bound_per_model(node, bounds: dict[str, dict[str, int]]) -> None:
    """Give each node with a mark its bounds (mark -> {"maximum": n, ...})."""
    if isinstance(node, dict):
        for mark, keywords in bounds.items():
            if node.get(mark):
                node.update(keywords)
        if node.get(TOKEN_ID_KEYS):  # the values' schema stays; the keys get the vocabulary's bound
            (values,) = node["patternProperties"].values()
            node["patternProperties"] = {decimal_up_to(bounds[TOKEN_ID]["maximum"]): values}
        for value in node.values():
            _bound_per_model(value, bounds)
    elif isinstance(node, list):
        for value in node:
            _bound_per_model(value, bounds)


def decimal_up_to(n: int) -> str:
    """A regular expression for the decimal integers 0..n, written without leading zeros."""
    digits = str(n)
    width = len(digits)
    options = ["0"]
    if width > 1:  # 1 .. 10**(width-1) - 1
        options.append(f"[1-9][0-9]{{0,{width - 2}}}")
    for i, digit in enumerate(digits):  # width digits: n's first i, then a smaller one, then any
        low, high = (1 if i == 0 else 0), int(digit) - 1
        if high >= low:
            options.append(digits[:i] + f"[{low}-{high}]" + (f"[0-9]{{{width - i - 1}}}" if i < width - 1 else ""))
    if n > 0:
        options.append(digits)
    return "^(" + "|".join(options) + ")$"


def _refuse_request_chat_templates(schema: dict) -> None:
    """Without --trust-request-chat-template, a request's `chat_template` may only be null."""
    for body in schema["components"]["schemas"].values():
        field = body.get("properties", {}).get("chat_template")
        if field is not None and field.get(REQUEST_CHAT_TEMPLATE):
            field["anyOf"] = [{"type": "null"}]


def _require_bearer_on_v1(schema: dict) -> None:
    schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operation in _operations(schema):
        if path.startswith("/v1"):
            operation["security"] = [{"bearer": []}]
            operation["responses"]["401"] = {
                "description": _ERRORS[401],
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
            }
