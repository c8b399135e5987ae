"""`mistral`: calls follow the special token `[TOOL_CALLS]`, in one of two formats.

    Older (tokenizer before v11):   [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, ...]
    Newer (v11 on):                 [TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]mul[ARGS]{"b": 2}

The text before the first `[TOOL_CALLS]` is the content. vLLM picks the format from the
tokenizer's version; here the text picks it (a `[` after the marker is the older one), so
the parser needs no tokenizer. As vLLM, a newer-format call whose arguments are not valid
JSON is still a call (its arguments' text as written), and a call id is 9 letters/digits.
"""

from __future__ import annotations

import random
import string

from api.tool_parsers.base import PartialCall, Scan, ToolParser, held_marker_start, plain_text
from api.tool_parsers.json_calls import json_value_end, partial_call, whole_call
from api.tool_parsers.registry import register_tool_parser

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    skip_special_tokens = False  # [TOOL_CALLS] is a special token

    def new_call_id(self) -> str:
        # mistral-common rejects any other id in the next request's history.
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(BOT)
        if first < 0:
            return plain_text(text, final, BOT)
        after = text[first + len(BOT) :]
        rest = after.lstrip()
        if not rest:
            return Scan(first, [], failed=final)
        if rest.startswith("["):
            return self._scan_list(text, len(text) - len(rest) + 1, first, final)
        return Scan(first, [_named_call(part, final) for part in _segments(after, final)])

    def _scan_list(self, text: str, start: int, first: int, final: bool) -> Scan:
        """The older format: a JSON array of calls (what follows it is ignored, as vLLM)."""
        calls: list[PartialCall] = []
        expect_item = True  # after `[` or `,`; else after an item
        while True:
            start = len(text) - len(text[start:].lstrip())
            if start == len(text):  # the array is not closed yet
                return Scan(first, calls, failed=final)
            if text[start] == "]":
                return Scan(first, calls, failed=not calls)
            if not expect_item:
                if text[start] != ",":
                    return Scan(first, calls, failed=True)
                start, expect_item = start + 1, True
                continue
            end = json_value_end(text, start)
            if end is None:
                if final:
                    return Scan(first, calls, failed=True)
                calls.append(partial_call(text[start:]))
                return Scan(first, calls)
            call = whole_call(text[start:end], ("arguments",), default="{}")
            if call is None:
                return Scan(first, calls, failed=True)
            calls.append(call)
            start, expect_item = end, False


def _segments(after: str, final: bool) -> list[str]:
    """The text of each newer-format call, the last one less a tail that may start a marker;
    a segment without a `{` is no call (as vLLM), unless it is the last one and may grow."""
    parts = after.split(BOT)
    if not final:
        parts[-1] = parts[-1][: held_marker_start(parts[-1], BOT)]
    return [part for i, part in enumerate(parts) if "{" in part or (i == len(parts) - 1 and not final)]


def _named_call(part: str, final: bool) -> PartialCall:
    """`name[ARGS]{...}`: the name is whole at its `{`; the arguments are the rest, as written."""
    brace = part.find("{")
    if brace < 0:
        return PartialCall(None)
    name = part[:brace].replace(ARGS, "").strip()
    return PartialCall(name or None, part[brace:], done=final)
