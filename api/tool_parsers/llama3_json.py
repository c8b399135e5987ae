"""`llama3_json`: Llama 3.1 and 3.2 write calls as bare JSON objects.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

An output is calls when it begins with one (after whitespace and an optional
`<|python_tag|>`); the objects are separated by `;` and take "parameters" or "arguments".
Text after the last call is dropped. An output that begins otherwise is all content.
"""

from __future__ import annotations

import re

from api.tool_parsers.base import NO_CALLS_YET, PartialCall, Scan, ToolParser
from api.tool_parsers.json_calls import json_value_end, partial_call, whole_call
from api.tool_parsers.registry import register_tool_parser

PYTHON_TAG = "<|python_tag|>"
_SEPARATOR = re.compile(r"\s*;\s*")


def calls_start(text: str) -> int | None:
    """Where the first call's `{` is, -1 while the opening may still become one (whitespace,
    part of the tag), or None when the output does not begin with a call."""
    rest = text.lstrip()
    if PYTHON_TAG.startswith(rest):
        return -1
    if rest.startswith(PYTHON_TAG):
        rest = rest[len(PYTHON_TAG) :].lstrip()
        if not rest:
            return -1
    return len(text) - len(rest) if rest.startswith("{") else None


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        start = calls_start(text)
        if start is None or (start < 0 and final):
            return Scan(len(text), [])
        if start < 0:
            return NO_CALLS_YET
        calls: list[PartialCall] = []
        while True:
            end = json_value_end(text, start)
            if end is None:
                if final:
                    return Scan(0, calls, failed=True)
                calls.append(partial_call(text[start:]))
                return Scan(0, calls)
            call = whole_call(text[start:end])
            if call is None:
                return Scan(0, calls, failed=True)
            calls.append(call)
            separator = _SEPARATOR.match(text, end)
            if separator is None or not text.startswith("{", separator.end()):
                return Scan(0, calls)
            start = separator.end()
