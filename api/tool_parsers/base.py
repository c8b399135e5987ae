"""The tool-call parser interface, and the stream every parser shares.

A parser reads an output as a `Scan`: where the content ends and which calls have begun
(each with its name once the name is whole, and its arguments' JSON text so far). The
unstreamed `extract` is the scan of the whole text; the stream scans the text fed so far
and sends what grew since the last scan. Both come from the same `scan`, so a stream adds
up to what `extract` gives, however the text is split:

    text:     Let me look.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>
    scan:     content_end ^    calls[0]: name "f", arguments '{"a": 1}', done
    stream:   "Let me look." | call 0 opened: id, "f" | '{"a"' | ': 1}' ...

NOTE: a scan must only grow as text is appended (the content end, a call's name, its
arguments' text), except that it may turn `failed`: then the output is plain text. When a
call was already sent before that, the stream cannot take it back; it stops there (the
cases marked `stream_differs` in tests/api/tool_parser_cases.json).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One finished call, as OpenAI's `message.tool_calls[i]`."""

    name: str
    arguments: str  # JSON text of an object ("{}" when none)
    id: str = field(default_factory=new_tool_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: str | None  # the text outside the calls; None when it is empty/whitespace only
    tool_calls: list[ToolCall]  # [] when the text holds no call (then content is the whole text)


@dataclass
class ToolCallDelta:
    """One entry of a streamed delta's `tool_calls`."""

    index: int  # the call's position among this choice's calls
    id: str | None = None  # set on the call's first delta only
    name: str | None = None  # set on the call's first delta only (before any arguments)
    arguments: str = ""  # a fragment of the arguments' JSON text

    def to_openai(self) -> dict:
        entry: dict = {"index": self.index}
        if self.id is not None:
            entry.update(id=self.id, type="function")
        function: dict = {"name": self.name} if self.name is not None else {}
        function["arguments"] = self.arguments
        entry["function"] = function
        return entry


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class PartialCall(NamedTuple):
    name: str | None  # None until the whole name has arrived
    arguments: str = ""  # the arguments' JSON text so far (only ever grows)
    done: bool = False  # the call is complete


class Scan(NamedTuple):
    content_end: int  # text[:content_end] is content (the rest is calls, or held back)
    calls: list[PartialCall]
    failed: bool = False  # the calls turned out malformed: the whole text is content


NO_CALLS_YET = Scan(0, [])


def plain_text(text: str, final: bool, marker: str) -> Scan:
    """The scan of text without a call: all content, less a tail that may start `marker`."""
    return Scan(len(text) if final else held_marker_start(text, marker), [])


def held_marker_start(text: str, marker: str) -> int:
    """The first index whose tail of `text` is a proper prefix of `marker`, else len(text)."""
    for i in range(max(0, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[i:]):
            return i
    return len(text)


def content_or_none(text: str) -> str | None:
    return text if text.strip() else None


def normalized_arguments(arguments: str) -> str:
    """The arguments as compact-ish JSON (vLLM's `json.dumps(..., ensure_ascii=False)`); text
    that is not JSON stays as it is (mistral keeps a call whose arguments are malformed)."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:
        return arguments.strip()


class ToolParser:
    """Reads one model family's tool calls out of its output; one per server, no state."""

    name: ClassVar[str]  # the --tool-call-parser name
    # False when the call markers are special tokens (mistral's [TOOL_CALLS]) that must
    # survive detokenizing.
    skip_special_tokens: ClassVar[bool] = True

    def __init__(self, tokenizer: Any) -> None:
        """`tokenizer`: a Hugging Face tokenizer or None (no parser here needs one)."""
        self.tokenizer = tokenizer

    def scan(self, text: str, final: bool) -> Scan:
        """What `text` holds so far; `final`: the output ends here (nothing is held back,
        an unfinished call fails). A plugin may override `extract` instead: its streams then
        send everything at the end."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return new_tool_call_id()

    def extract(self, text: str) -> ExtractedToolCalls:
        """The content and calls of a whole output, unstreamed."""
        scan = self.scan(text, final=True)
        if scan.failed or not scan.calls or not all(call.done and call.name for call in scan.calls):
            return ExtractedToolCalls(content_or_none(text), [])
        calls = [ToolCall(c.name, normalized_arguments(c.arguments), id=self.new_call_id()) for c in scan.calls]
        return ExtractedToolCalls(content_or_none(text[: scan.content_end]), calls)

    def stream(self) -> ToolCallStream:
        """A fresh state for one streamed choice."""
        return ToolCallStream(self)


class ToolCallStream:
    """One streamed output: `feed` each piece of detokenized text, then `finish`."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.calls_seen = 0  # calls opened so far (finish_reason "tool_calls" when > 0)
        self._text = ""
        self._content_sent = 0
        self._arguments_sent: list[str] = []
        self._plain = False  # the output turned out to hold no calls: all of it is content
        self._stopped = False  # a sent call turned out malformed: nothing more is sent

    def feed(self, text: str) -> StreamDelta:
        """The delta for the next piece of text (empty while it is held back)."""
        self._text += text
        return self._step(final=False)

    def finish(self) -> StreamDelta:
        """The output ended: flush whatever was held back."""
        return self._step(final=True)

    def _step(self, final: bool) -> StreamDelta:
        if self._stopped:
            return StreamDelta()
        if type(self.parser).scan is ToolParser.scan:  # a plugin that wrote `extract` alone
            return self._whole(final)
        scan = Scan(len(self._text), []) if self._plain else self.parser.scan(self._text, final)
        if scan.failed or (final and not all(call.done and call.name for call in scan.calls)):
            if self.calls_seen:
                self._stopped = True
                return StreamDelta()
            self._plain = True
            scan = Scan(len(self._text), [])
        delta = StreamDelta()
        if scan.content_end > self._content_sent:
            delta.content = self._text[self._content_sent : scan.content_end]
            self._content_sent = scan.content_end
        for index, call in enumerate(scan.calls):
            if index == self.calls_seen:
                if call.name is None:
                    break
                delta.tool_calls.append(ToolCallDelta(index, id=self.parser.new_call_id(), name=call.name))
                self._arguments_sent.append("")
                self.calls_seen += 1
            sent = self._arguments_sent[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                delta.tool_calls.append(ToolCallDelta(index, arguments=call.arguments[len(sent) :]))
                self._arguments_sent[index] = call.arguments
        return delta

    def _whole(self, final: bool) -> StreamDelta:
        """A parser without `scan`: hold the text back and send what `extract` finds at the end."""
        if not final:
            return StreamDelta()
        found = self.parser.extract(self._text)
        self.calls_seen = len(found.tool_calls)
        calls = []
        for index, call in enumerate(found.tool_calls):
            calls += [ToolCallDelta(index, id=call.id, name=call.name), ToolCallDelta(index, arguments=call.arguments)]
        return StreamDelta(found.content or "", calls)
