"""`pythonic`: Llama 3.2 and Llama 4 write calls as a Python list of function calls.

    [get_weather(city='San Francisco', metric='celsius'), get_time()]

An output is calls when it is exactly such a list (whitespace around it aside): keyword
arguments only, each a literal (strings, numbers, booleans, None, lists, dicts). Anything
else is content, read with Python's `ast`, never evaluated. A call is sent whole, with
its arguments as one JSON object, once its closing parenthesis has come.
"""

from __future__ import annotations

import ast
import json
import re

from api.tool_parsers.base import NO_CALLS_YET, PartialCall, Scan, ToolParser
from api.tool_parsers.registry import register_tool_parser

# The output may still become a call list: `[`, then the first name being written ...
_MAY_BEGIN = re.compile(r"\[\s*([A-Za-z_]\w*\s*)?\Z")
# ... and it is one (from here a malformed call makes it content) once `[name(` has come.
_BEGINS = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
# A string (or the unfinished one at the end) or a bracket: what a bracket count must see.
_PY_TOKEN = re.compile(r"""'(?:[^'\\]|\\.)*(?:'|\\?\Z)|"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[()\[\]{}]""")


def call_end(text: str, start: int) -> int | None:
    """The index just past the call that begins at text[start] (its closing parenthesis),
    or None while it is not closed."""
    depth = 0
    for token in _PY_TOKEN.finditer(text, start):
        bracket = token.group()
        if bracket in "([{":
            depth += 1
        elif bracket in ")]}":
            depth -= 1
            if depth == 0:
                return token.end() if bracket == ")" else None
            if depth < 0:
                return None
    return None


def read_call(source: str) -> PartialCall | None:
    """`name(key=literal, ...)` as a finished call, or None when it is not one."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(keyword.arg is None for keyword in node.keywords):  # **kwargs
            return None
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        return PartialCall(node.func.id, json.dumps(arguments, ensure_ascii=False), done=True)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None  # not Python, not a literal, or not JSON (a set, bytes, a complex number)


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        if not _BEGINS.match(body):
            if not final and (not body or _MAY_BEGIN.match(body)):
                return NO_CALLS_YET
            return Scan(len(text), [])
        pos = len(text) - len(body) + 1  # past `[`
        calls: list[PartialCall] = []
        while True:
            start = len(text) - len(text[pos:].lstrip())
            end = call_end(text, start)
            if end is None:
                return Scan(0, calls, failed=final)
            call = read_call(text[start:end])
            if call is None:
                return Scan(0, calls, failed=True)
            calls.append(call)
            tail = text[end:].lstrip()
            if tail.startswith(","):
                pos = len(text) - len(tail) + 1
            elif tail.startswith("]"):
                return Scan(0, calls, failed=bool(tail[1:].strip()))
            else:
                return Scan(0, calls, failed=final or bool(tail))
