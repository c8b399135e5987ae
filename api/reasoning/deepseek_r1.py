"""DeepSeek-R1: its chat template opens `<think>` in the prompt, so the output starts in the
thinking and `</think>` ends it; no `</think>` at all means the output is all thinking."""

from __future__ import annotations

from api.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
