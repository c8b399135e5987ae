"""Tool-call parsers: read a model's function calls out of its generated text.

`base.py` holds the interface and the stream every parser shares; `json_calls.py` reads
calls written as JSON objects; each other module is one parser, under vLLM's
`--tool-call-parser` name. Pure text processing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from api.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    new_tool_call_id,
)
from api.tool_parsers.hermes import HermesToolParser
from api.tool_parsers.llama3_json import Llama3JsonToolParser
from api.tool_parsers.mistral import MistralToolParser
from api.tool_parsers.pythonic import PythonicToolParser
from api.tool_parsers.registry import TOOL_PARSERS, get_tool_parser, register_tool_parser

# What a chat template shows of the call format it teaches, and the parser that reads it.
_TEMPLATE_MARKERS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("ipython", "llama3_json"),
)


def parser_for_template(chat_template: str | None) -> str | None:
    """The parser a chat template obviously implies, or None when it shows no call format."""
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return None


def load_tool_parser_plugin(path: str) -> None:
    """Import a Python file by path (vLLM's --tool-parser-plugin); its parser classes
    register themselves with `register_tool_parser`."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"tool parser plugin {path!r} is not a file")
    module_name = f"tool_parser_plugin_{file.stem}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up here
    spec.loader.exec_module(module)


__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PythonicToolParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "get_tool_parser",
    "load_tool_parser_plugin",
    "new_tool_call_id",
    "parser_for_template",
    "register_tool_parser",
]
