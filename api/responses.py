"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it) over the chat machinery.

A request becomes a chat request: `instructions` a system message, `input` items messages
(a `function_call` an assistant message's tool call, a `function_call_output` a tool
message), `text.format` a response_format, function tools chat tools. The reply's thinking,
text and calls become output items (reasoning, message, function_call), whole or streamed
as Responses events. With `store` (the default) a response and the conversation that led
to it are kept, a bounded number of them, so that `previous_response_id` can continue it;
GET /v1/responses/{id} returns one.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from api import openapi
from api.chat import ChatRun, start_chat
from api.chat_reply import ReplyStream, merge_deltas
from api.errors import APIError, bad_request
from api.ignored_fields import note_ignored_fields
from api.protocol import ChatCompletionRequest, Int, OutputTokens, Seed, StructuredOutputs, _Body, refused_unless
from api.serving import EventStream, ServerState, collect, disconnected_response, sse, sse_error, unless_disconnected

router = APIRouter()

MAX_STORED_RESPONSES = 1000  # the oldest is forgotten first; each holds its whole conversation


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None  # accepted; the reply carries the whole thinking, not a summary


class ResponsesRequest(_Body):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None  # function tools only (web_search, ...: a 400 naming them)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: OutputTokens | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: Int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: Seed | None = None
    priority: Int = 0
    cache_salt: str | None = Field(None, min_length=1)
    structured_outputs: StructuredOutputs | None = None  # vLLM's: a regex, choice, grammar or schema
    # OpenAI's that this server cannot honour: refused unless harmless.
    background: bool = Field(False, **refused_unless(const=False))
    truncation: Literal["disabled", "auto"] | None = Field(None, **refused_unless(enum=["disabled", None]))

    def check(self) -> None:
        if self.background:
            raise bad_request("background is not supported by this server", "background")
        if self.truncation == "auto":
            raise bad_request(
                'truncation "auto" is not supported by this server (the prompt is never cut)', "truncation"
            )

    def chat_tools(self) -> list[dict] | None:
        """The tools in chat's shape."""
        if self.tools is None:
            return None
        return [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in self.tools
        ]

    def response_format(self) -> dict | None:
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        schema = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """The chat messages of a request's `input` (a 400 names an item this server cannot read)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{index}]"
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _message_text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the calls that followed its text
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _message_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue  # earlier thinking: templates leave it out of the prompt
        else:
            raise bad_request(f"input items of type {kind!r} are not supported by this server", f"{where}.type")
    return messages


def _message_text(content, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of content parts", f"{where}.content")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"only text content parts are supported, got {kind!r}", f"{where}.content")
        texts.append(part.get("text"))
    return "\n".join(t for t in texts if isinstance(t, str))


def output_messages(output: list[dict]) -> list[dict]:
    """A stored response's output items as the chat messages that continue its conversation."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append({"role": "assistant", "content": "".join(part["text"] for part in item["content"])})
        elif item["type"] == "function_call":
            items.append(item)
    return input_messages(items)


class ResponseStore:
    """The responses kept for `previous_response_id`: each with the conversation before it."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        self.capacity = capacity
        self.entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        self.entries[response["id"]] = (response, conversation)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]]:
        found = self.entries.get(response_id)
        if found is None:
            raise APIError(
                404, f"Response with id '{response_id}' not found.", param="previous_response_id", code="not_found"
            )
        return found


def chat_request(body: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    """The chat request that serves `body` over `conversation` (its earlier turns and its input)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    tool_choice = body.tool_choice
    if isinstance(tool_choice, NamedFunction):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    fields = {
        "model": body.model,
        "messages": messages + conversation,
        "tools": body.chat_tools(),
        "tool_choice": tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": body.response_format(),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "seed": body.seed,
        "priority": body.priority,
        "cache_salt": body.cache_salt,
        "structured_outputs": body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        if body.structured_outputs
        else None,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
        "stream": body.stream,
    }
    try:
        chat = ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise bad_request(f"{where}: {error['msg']}", where) from None
    chat.check()
    return chat


def _param(chat_field: str | None) -> str | None:
    """The Responses field behind a chat field a 400 names."""
    if chat_field is None:
        return None
    if chat_field.startswith("messages"):
        return "input"
    tool = re.fullmatch(r"tools\[(\d+)\]\.function\.(.*)", chat_field)
    if tool:
        return f"tools[{tool[1]}].{tool[2]}"
    renamed = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}
    renamed["response_format"] = "text.format"
    head, dot, rest = chat_field.partition(".")
    return renamed[head] if head in renamed else chat_field


@router.post(
    "/v1/responses",
    responses={
        200: {
            "description": "A response object, or with `stream: true` the Responses API's server-sent events.",
            "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
        },
        **openapi.errors(400, 404, 413, 503),
    },
)
async def create_response(body: ResponsesRequest, request: Request):
    arrival = time.monotonic()
    state: ServerState = request.app.state.server
    state.check_model(body.model)
    note_ignored_fields(request, body.warn_ignored())
    body.check()
    store: ResponseStore = request.app.state.responses
    earlier: list[dict] = []
    if body.previous_response_id is not None:
        previous, before = store.get(body.previous_response_id)
        earlier = before + output_messages(previous["output"])
    conversation = earlier + input_messages(body.input)
    response_id = f"resp_{uuid.uuid4().hex}"
    try:  # a 400 about the chat request names the Responses field behind it
        run = await start_chat(state, chat_request(body, conversation), response_id, arrival)
    except APIError as e:
        e.param = _param(e.param)
        raise
    shell = _response_shell(body, state.reported_model(body.model), response_id, run.created)

    def finished(response: dict) -> dict:
        if body.store:
            store.put(response, conversation)
        return response

    if body.stream:
        events = _events(run, shell, _usage_of(state, run), finished)
        return EventStream(events, on_close=run.generation.close)
    if await unless_disconnected(request, collect(run.generation, run.tally)) is None:
        return disconnected_response()
    (choice,) = run.tally.choices
    message, _ = run.reply.message(choice.text, choice.finish_reason)
    output = _output_items(message)
    return JSONResponse(finished(_complete(shell, output, choice.finish_reason, _usage_of(state, run)())))


@router.get("/v1/responses/{response_id}", responses=openapi.errors(404))
async def retrieve_response(response_id: str, request: Request):
    response, _ = request.app.state.responses.get(response_id)
    return JSONResponse(response)


def _response_shell(body: ResponsesRequest, model: str, response_id: str, created: int) -> dict:
    """The response object before any output: what the request asked for, echoed."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "tool_choice": body.tool_choice.model_dump()
        if isinstance(body.tool_choice, NamedFunction)
        else body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "text": {
            "format": (
                body.text.format.model_dump(by_alias=True, exclude_none=True)
                if body.text and body.text.format
                else {"type": "text"}
            )
        },
        "reasoning": body.reasoning.model_dump() if body.reasoning else None,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "metadata": body.metadata or {},
        "store": body.store,
        "user": body.user,
        "usage": None,
    }


def _usage_of(state: ServerState, run: ChatRun):
    def usage() -> dict:
        chat = run.tally.usage()
        cached = (chat["prompt_tokens_details"] or {}).get("cached_tokens", 0)
        return {
            "input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": _reasoning_tokens(state, run.tally.choices[0].token_ids)},
            "total_tokens": chat["total_tokens"],
        }

    return usage


def _reasoning_tokens(state: ServerState, token_ids: list[int]) -> int:
    """The output tokens up to the end of the thinking (0 without a parser that knows its end token)."""
    parser = state.reasoning_parser
    end = parser.end_token_id if parser is not None else None
    if end is None or end not in token_ids:
        return 0
    return token_ids.index(end) + 1


def _complete(shell: dict, output: list[dict], finish_reason: str | None, usage: dict) -> dict:
    status = "incomplete" if finish_reason in ("length", "abort") else "completed"
    details = None
    if finish_reason == "length":
        details = {"reason": "max_output_tokens"}
    elif finish_reason == "abort":
        details = {"reason": "aborted"}
    return {**shell, "status": status, "output": output, "incomplete_details": details, "usage": usage}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(text: str) -> dict:
    return {
        "type": "reasoning",
        "id": _item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _message_item(text: str) -> dict:
    return {
        "type": "message",
        "id": _item_id("msg"),
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(call_id: str, name: str, arguments: str) -> dict:
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _output_items(message: dict) -> list[dict]:
    """A whole chat reply as output items: thinking, text, calls, in that order."""
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or ():
        items.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


class _EventWriter:
    """Responses events for one streamed reply: items open as their first text comes and
    close when the next kind of text starts (or the reply ends)."""

    def __init__(self):
        self.sequence = 0
        self.output: list[dict] = []  # the items, as they stand
        self.open: dict | None = None  # the item that text goes to now
        self.open_call: int | None = None  # its tool-call index, for a function_call item

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(payload)

    def reasoning(self, text: str) -> list[str]:
        events = self._open("reasoning", None)
        item = self.open
        item["content"][0]["text"] += text
        return events + [self._delta("response.reasoning_text.delta", text, content_index=0)]

    def text(self, text: str) -> list[str]:
        events = self._open("message", None)
        self.open["content"][0]["text"] += text
        return events + [self._delta("response.output_text.delta", text, content_index=0, logprobs=[])]

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[str]:
        events = []
        if self.open_call != index:
            events += self._open("function_call", index, call_id=call_id, name=name)
        if arguments:
            self.open["arguments"] += arguments
            events.append(self._delta("response.function_call_arguments.delta", arguments))
        return events

    def close(self) -> list[str]:
        item, self.open, self.open_call = self.open, None, None
        if item is None:
            return []
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        events = []
        if item["type"] == "reasoning":
            events.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=item["content"][0]["text"])
            )
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            )
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done", **where, arguments=item["arguments"], name=item["name"]
                )
            )
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return events

    def _open(self, kind: str, call_index: int | None, **call) -> list[str]:
        if self.open is not None and self.open["type"] == kind and self.open_call == call_index:
            return []
        events = self.close()
        if kind == "reasoning":
            item = {**_reasoning_item(""), "status": "in_progress"}
        elif kind == "message":
            item = {**_message_item(""), "status": "in_progress"}
        else:
            item = {**_call_item(call["call_id"], call["name"], ""), "status": "in_progress"}
        self.output.append(item)
        self.open, self.open_call = item, call_index
        index = len(self.output) - 1
        shown = {**item, "content": []} if kind == "message" else item
        events.append(self.event("response.output_item.added", output_index=index, item=shown))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self.event(
                    "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
                )
            )
        return events

    def _delta(self, kind: str, delta: str, **fields) -> str:
        return self.event(kind, item_id=self.open["id"], output_index=len(self.output) - 1, delta=delta, **fields)


async def _events(run: ChatRun, shell: dict, usage, finished) -> AsyncIterator[str]:
    writer = _EventWriter()
    stream: ReplyStream = run.reply.stream()
    try:
        yield writer.event("response.created", response=shell)
        yield writer.event("response.in_progress", response=shell)
        finish_reason = None
        async for delta in run.generation:
            for _, sample in run.tally.update(delta):
                fields = stream.feed(sample.new_text) if sample.new_text else {}
                if sample.finish_reason is not None:
                    last, finish_reason = stream.finish(sample.finish_reason)
                    fields = merge_deltas(fields, last)
                for event in _delta_events(writer, fields):
                    yield event
        for event in writer.close():
            yield event
        yield writer.event(
            "response.completed" if finish_reason not in ("length", "abort") else "response.incomplete",
            response=finished(_complete(shell, writer.output, finish_reason, usage())),
        )
    except Exception as e:
        yield sse_error(e)


def _delta_events(writer: _EventWriter, fields: dict) -> list[str]:
    events = []
    if fields.get("reasoning_content"):
        events += writer.reasoning(fields["reasoning_content"])
    if fields.get("content"):
        events += writer.text(fields["content"])
    for call in fields.get("tool_calls") or ():
        function = call["function"]
        events += writer.call(call["index"], call.get("id"), function.get("name"), function.get("arguments", ""))
    return events
