"""A chat choice's generated text as OpenAI's reply: thinking, content and tool calls.

The text goes first through the server's reasoning parser (the thinking becomes
`reasoning_content`, and vLLM's newer name `reasoning`), then what follows the thinking
through the request's tool mode:

    none       the text is the content
    auto       the server's tool-call parser finds the calls (--enable-auto-tool-choice)
    required   the output was held by a grammar to a JSON array of {name, parameters}
    named      the output was held by a grammar to the named function's arguments

Whole replies (`ReplyParser.message`) and streamed ones (`ReplyParser.stream`, one state
per choice) come from the same parsers, so a stream adds up to the whole reply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from api.reasoning import ReasoningParser
from api.tool_parsers import ToolCall, ToolCallDelta, ToolParser


@dataclass(frozen=True)
class ReplyParser:
    """How one request's choices are read (the parsers are the server's, shared)."""

    tool_mode: str  # none | auto | required | named
    tool_parser: ToolParser | None = None  # with tool_mode "auto"
    named_tool: str | None = None  # with tool_mode "named"
    reasoning_parser: ReasoningParser | None = None
    include_reasoning: bool = True  # false: the thinking is parsed out and dropped
    parallel_tool_calls: bool = True  # false: the first call only

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished choice, and its finish_reason."""
        reasoning, content = self._split_reasoning(text)
        calls: list[ToolCall] = []
        if self.tool_mode == "auto" and content:
            found = self.tool_parser.extract(content)
            content, calls = found.content, found.tool_calls
        elif self.tool_mode == "required":
            calls = required_calls(content or "")
            content = None if calls else content  # cut short (length): the text as it stands
        elif self.tool_mode == "named":
            calls, content = [ToolCall(self.named_tool, content or "")], None
        calls = calls if self.parallel_tool_calls else calls[:1]
        message = {"role": "assistant", "content": content}
        message.update(self._reasoning_fields(reasoning))
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, _finish_reason(finish_reason, self.tool_mode, bool(calls))

    def stream(self) -> ReplyStream:
        return ReplyStream(self)

    def _split_reasoning(self, text: str) -> tuple[str | None, str | None]:
        if self.reasoning_parser is None:
            return None, text
        return self.reasoning_parser.extract(text)

    def _reasoning_fields(self, reasoning: str | None) -> dict:
        if self.reasoning_parser is None or not self.include_reasoning or not reasoning:
            return {}
        return {"reasoning_content": reasoning, "reasoning": reasoning}


class ReplyStream:
    """One streamed choice: each piece of text becomes a delta (or nothing yet)."""

    def __init__(self, reply: ReplyParser):
        self.reply = reply
        self.reasoning = reply.reasoning_parser.stream() if reply.reasoning_parser else None
        self.tools = reply.tool_parser.stream() if reply.tool_mode == "auto" else None
        self.held = ""  # required: the JSON array, read whole at the end
        self.named_opened = False
        self.calls_sent = 0

    def opening(self) -> dict:
        """The first chunk's delta: the role, and empty content (OpenAI's), or the named call opened."""
        if self.reply.tool_mode != "named":
            return {"role": "assistant", "content": ""}
        self.named_opened = True
        call = ToolCall(self.reply.named_tool, "")
        self.calls_sent = 1
        return {"role": "assistant", "content": None, "tool_calls": [ToolCallDelta(0, call.id, call.name).to_openai()]}

    def feed(self, text: str) -> dict:
        """The delta fields for `text` (empty when everything is held back for now)."""
        if self.reasoning is not None:
            thinking, content = self.reasoning.feed(text)
        else:
            thinking, content = "", text
        return self._delta(thinking, content, final=False)

    def finish(self, finish_reason: str | None) -> tuple[dict, str | None]:
        """The last delta fields (what the parsers held back) and the choice's finish_reason."""
        thinking, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        delta = self._delta(thinking, content, final=True)
        return delta, _finish_reason(finish_reason, self.reply.tool_mode, self.calls_sent > 0)

    def _delta(self, thinking: str, content: str, *, final: bool) -> dict:
        delta: dict = {}
        if thinking:
            delta.update(self.reply._reasoning_fields(thinking))
        mode = self.reply.tool_mode
        calls: list[ToolCallDelta] = []
        if mode == "none":
            if content:
                delta["content"] = content
        elif mode == "auto":
            piece = self.tools.feed(content) if content else None
            pieces = [piece] if piece is not None else []
            if final:
                pieces.append(self.tools.finish())
            for piece in pieces:
                if piece.content:
                    delta["content"] = delta.get("content", "") + piece.content
                calls += piece.tool_calls
        elif mode == "named":
            if not self.named_opened and (content or final):
                self.named_opened = True
                call = ToolCall(self.reply.named_tool, "")
                calls.append(ToolCallDelta(0, id=call.id, name=call.name))
            if content:
                calls.append(ToolCallDelta(0, arguments=content))
        else:  # required: the array is read whole once it is complete
            self.held += content
            if final:
                found = required_calls(self.held)
                for index, call in enumerate(found):
                    calls += [
                        ToolCallDelta(index, id=call.id, name=call.name),
                        ToolCallDelta(index, arguments=call.arguments),
                    ]
                if not found and self.held:  # cut short (length): the text as it stands
                    delta["content"] = self.held
        if not self.reply.parallel_tool_calls:
            calls = [c for c in calls if c.index == 0]
        if calls:
            self.calls_sent = max(self.calls_sent, 1 + max(c.index for c in calls))
            delta["tool_calls"] = _merge_call_deltas(calls)
        return delta


def merge_deltas(first: dict, second: dict) -> dict:
    """Two deltas of one choice as one chunk's: texts joined, tool-call pieces merged per call."""
    merged = dict(first)
    for key, value in second.items():
        if key == "tool_calls":
            calls = [
                ToolCallDelta(c["index"], c.get("id"), c["function"].get("name"), c["function"]["arguments"])
                for c in [*merged.get("tool_calls", ()), *value]
            ]
            merged[key] = _merge_call_deltas(calls)
        else:
            merged[key] = merged.get(key, "") + value
    return merged


def required_calls(text: str) -> list[ToolCall]:
    """The calls of a `tool_choice: "required"` output (a JSON array of {name, parameters},
    which its grammar guarantees unless the output was cut short: then no calls)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """vLLM's grammar for `tool_choice: "required"`: a non-empty array of calls, each a named
    function and arguments that follow its schema (one call when not `parallel`)."""
    schema: dict = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [tool["name"]]},
                        "parameters": tool["parameters"],
                    },
                    "required": ["name", "parameters"],
                }
                for tool in tools
            ]
        },
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _merge_call_deltas(calls: list[ToolCallDelta]) -> list[dict]:
    """One entry per call index in a chunk (OpenAI's shape): its name and its argument pieces joined."""
    merged: dict[int, ToolCallDelta] = {}
    for call in calls:
        seen = merged.get(call.index)
        if seen is None:
            merged[call.index] = ToolCallDelta(call.index, call.id, call.name, call.arguments)
        else:
            seen.id = seen.id or call.id
            seen.name = seen.name or call.name
            seen.arguments += call.arguments
    return [call.to_openai() for call in merged.values()]


def _finish_reason(finish_reason: str | None, tool_mode: str, called: bool) -> str | None:
    # As OpenAI: a reply that calls tools it chose ("auto", "required") ends with "tool_calls";
    # a named tool_choice keeps "stop". A reply cut by max_tokens keeps "length".
    if called and finish_reason == "stop" and tool_mode in ("auto", "required"):
        return "tool_calls"
    return finish_reason
