"""`hermes`: Hermes 2 Pro, Qwen2.5 and Qwen3 write each call as JSON between tags.

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The text before the first `<tool_call>` is the content; text between or after the calls is
dropped (as vLLM). A last `<tool_call>` left open (the output was cut) still counts when
its JSON is whole. Any call that is not valid JSON makes the whole output content.
"""

from __future__ import annotations

from api.tool_parsers.base import PartialCall, Scan, ToolParser, held_marker_start, plain_text
from api.tool_parsers.json_calls import partial_call, whole_call
from api.tool_parsers.registry import register_tool_parser

START, END = "<tool_call>", "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            return plain_text(text, final, START)
        calls: list[PartialCall] = []
        start = first
        while start >= 0:
            body_start = start + len(START)
            end = text.find(END, body_start)
            if end < 0:  # the last call is still open
                body = text[body_start:]
                body = body if final else body[: held_marker_start(body, END)]
                call = whole_call(body, ("arguments",))
                if call is None and final:
                    return Scan(first, calls, failed=True)
                calls.append(call or partial_call(body))
                break
            call = whole_call(text[body_start:end], ("arguments",))
            if call is None:
                return Scan(first, calls, failed=True)
            calls.append(call)
            start = text.find(START, end + len(END))
        return Scan(first, calls)
