"""Reasoning parsers: split a model's thinking (`<think>...</think>`) from its answer.

`base.py` holds the interface and the streaming splitter every parser shares; each other
module is one parser, under vLLM's `--reasoning-parser` name. Pure text processing.
"""

from api.reasoning.base import ReasoningEnd, ReasoningParser, ReasoningStream
from api.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from api.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class called `name`; a ValueError listing the known names otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningEnd",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
]
