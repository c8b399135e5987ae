"""Calls written as JSON objects, `{"name": "f", "arguments": {...}}`, read as they arrive.

Shared by hermes, llama3_json and mistral's older format. While an object is arriving its
name is known once `{"name": "f", "arguments": ` has come whole (in that order), and from
then on the arguments' JSON text is streamed as it comes. An object in another shape (the
arguments first, scalar arguments) is read whole once it is closed.
"""

from __future__ import annotations

import json
import re

from api.tool_parsers.base import PartialCall

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
# A string (or the unfinished one at the end) or a bracket: what a bracket count must see.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[{}\[\]]')
ARGUMENT_KEYS = ("arguments", "parameters")  # llama writes "parameters"


def json_value_end(text: str, start: int = 0) -> int | None:
    """The index just past the object or array that opens at text[start], or None while
    it is not closed. Brackets inside strings do not count."""
    depth = 0
    for token in _JSON_TOKEN.finditer(text, start):
        bracket = token.group()
        if bracket in "{[":
            depth += 1
        elif bracket in "}]":
            depth -= 1
            if depth == 0:
                return token.end()
    return None


def partial_call(text: str) -> PartialCall:
    """An object still arriving: its name and the arguments' text so far when the object
    begins in the usual order, else nothing yet."""
    header = _HEADER.match(text)
    if header is None:
        return PartialCall(None)
    name = json.loads(f'"{header.group(1)}"')
    value = text[header.end() :]
    if not value.startswith(("{", "[")):
        return PartialCall(name)  # a scalar (or not yet begun): read once the object is whole
    end = json_value_end(value)
    return PartialCall(name, value if end is None else value[:end])


def whole_call(
    text: str, argument_keys: tuple[str, ...] = ARGUMENT_KEYS, default: str | None = None
) -> PartialCall | None:
    """A closed object as a finished call, or None when it is not one (not JSON, no name,
    no arguments and no `default`). The arguments keep their text when the object began in
    the usual order, so they extend what was streamed."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in obj), None)
    if key is None and default is None:
        return None
    streamed = partial_call(text)
    if streamed.name is not None and streamed.arguments:
        return PartialCall(obj["name"], streamed.arguments, done=True)
    arguments = json.dumps(obj[key], ensure_ascii=False) if key is not None else default
    return PartialCall(obj["name"], arguments, done=True)
