"""Qwen3 (and Qwen3.5): `<think>...</think>` then the answer, as vLLM's current parser reads it.

Newer templates open `<think>` in the prompt, older ones leave it to the model; either way
the output starts in the thinking, and without `</think>` it is all thinking (cut off),
unless the request turned thinking off (`enable_thinking: false`): then it is all content.
Qwen3.5 may open a tool call inside the thinking without closing it: `<tool_call>` followed
by `<function=` ends the thinking too, and the call stays in the content.
"""

from __future__ import annotations

import re
from typing import Any

from api.reasoning.base import ReasoningEnd, ReasoningParser

TOOL_CALL = "<tool_call>"
FUNCTION_OPEN = "<function"
# `<tool_call>` is an implicit end only when a function tag follows (reasoning may mention the tag).
TOOL_CALL_END = re.compile(re.escape(TOOL_CALL) + r"\s*" + re.escape(FUNCTION_OPEN) + r"[\s=]")
_WHITESPACE = re.compile(r"\s*")


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def __init__(self, tokenizer: Any, *, enable_thinking: bool = True) -> None:
        super().__init__(tokenizer)
        self.enable_thinking = enable_thinking

    def for_request(self, chat_template_kwargs: dict[str, Any] | None) -> ReasoningParser:
        enable = (chat_template_kwargs or {}).get("enable_thinking", True)
        if bool(enable) == self.enable_thinking:
            return self
        return type(self)(self.tokenizer, enable_thinking=bool(enable))

    def starts_in_reasoning(self) -> bool:
        # Thinking off: the template closed an empty thinking in the prompt.
        return self.enable_thinking

    def find_reasoning_end(self, text: str) -> ReasoningEnd | None:
        ends = [super().find_reasoning_end(text)]
        call = TOOL_CALL_END.search(text)
        if call is not None:
            ends.append(ReasoningEnd(call.start(), call.start()))  # the call is content
        return min((e for e in ends if e is not None), default=None)

    def end_may_start_at(self, text: str) -> int:
        return min(super().end_may_start_at(text), _tool_call_may_start_at(text))


def _tool_call_may_start_at(text: str) -> int:
    """The first index from which `text` may still grow into `<tool_call>` + whitespace +
    `<function=` (text without a complete one), else len(text)."""
    for i in (m.start() for m in re.finditer("<", text)):
        tail = text[i:]
        if TOOL_CALL.startswith(tail):
            return i
        if tail.startswith(TOOL_CALL):
            rest = tail[len(TOOL_CALL) :]
            rest = rest[_WHITESPACE.match(rest).end() :]
            if FUNCTION_OPEN.startswith(rest):  # whitespace so far, or part of the tag
                return i
    return len(text)
