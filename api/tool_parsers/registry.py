"""The tool-call parsers by name: ours, and those a plugin file registers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from api.tool_parsers.base import ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str):
    """A class decorator: the parser becomes available as `--tool-call-parser name`."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        cls.name = name
        TOOL_PARSERS[name] = cls
        return cls

    return register


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class called `name`; a ValueError listing the known names otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
