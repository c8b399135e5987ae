"""The reasoning-parser interface and the streaming splitter all parsers share.

A parser says where the thinking ends (`find_reasoning_end`) and from where a text's tail
might still turn into such an end (`end_may_start_at`); the rest is common: an opening
`<think>` (after any whitespace) is dropped, the text before the end is reasoning, the
text after it content, and with no end at all the whole output is reasoning (it was cut
off while thinking). The stream holds back only text that may still be the opening
`<think>` or the start of an end marker, so streamed pieces add up to what `extract` gives
for the whole text, however the text is split.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple


class ReasoningEnd(NamedTuple):
    start: int  # the reasoning is text[:start]
    content_start: int  # the content is text[content_start:] (past `</think>`; a kept marker stays)


class ReasoningParser:
    """Splits one model's output into (reasoning, content); one per server, no state."""

    name: ClassVar[str]  # the --reasoning-parser name
    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"

    def __init__(self, tokenizer: Any) -> None:
        """`tokenizer`: a Hugging Face tokenizer (or a `tokenizers.Tokenizer`), or None."""
        self.tokenizer = tokenizer
        self.start_token_id = single_token_id(tokenizer, self.start_token)
        # The id the grammar waits for before an answer is constrained (None: not one token).
        self.end_token_id = single_token_id(tokenizer, self.end_token)

    def for_request(self, chat_template_kwargs: dict[str, Any] | None) -> ReasoningParser:
        """The parser for one request rendered with these chat-template options (vLLM passes
        them to its parser); most parsers ignore them."""
        return self

    def starts_in_reasoning(self) -> bool:
        """Whether the output begins inside the thinking (the template opened `<think>`)."""
        return True

    def find_reasoning_end(self, text: str) -> ReasoningEnd | None:
        """Where the thinking ends in `text` (the earliest end), or None."""
        index = text.find(self.end_token)
        return None if index < 0 else ReasoningEnd(index, index + len(self.end_token))

    def end_may_start_at(self, text: str) -> int:
        """The first index from which `text`'s tail may still grow into an end (len(text)
        when none may). Only called on text without a complete end."""
        return partial_marker_start(text, self.end_token)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output, each None when empty."""
        if not self.starts_in_reasoning():
            return None, text or None
        text = without_opening(text, self.start_token)
        end = self.find_reasoning_end(text)
        if end is None:
            return text or None, None
        return text[: end.start] or None, text[end.content_start :] or None

    def stream(self) -> ReasoningStream:
        """A fresh state for one streamed choice."""
        return ReasoningStream(self)


class ReasoningStream:
    """One streamed output, split as it arrives: `feed` each piece of text, then `finish`."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.ended = not parser.starts_in_reasoning()  # the reasoning is over: content follows
        self._at_opening = not self.ended  # an opening `<think>` may still come
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning piece, content piece) of `text`, less what is held back."""
        held = self._held + text
        if self.ended:
            self._held = ""
            return "", held
        if self._at_opening:
            opening = held.lstrip()
            if opening.startswith(self.parser.start_token):
                held = opening[len(self.parser.start_token) :]
                self._at_opening = False
            elif self.parser.start_token.startswith(opening):  # whitespace, or part of `<think>`
                self._held = held
                return "", ""
            else:
                self._at_opening = False
        end = self.parser.find_reasoning_end(held)
        if end is not None:
            self.ended = True
            self._held = ""
            return held[: end.start], held[end.content_start :]
        keep = self.parser.end_may_start_at(held)
        self._held = held[keep:]
        return held[:keep], ""

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back is text after all."""
        held, self._held = self._held, ""
        return ("", held) if self.ended else (held, "")


def without_opening(text: str, start_token: str) -> str:
    """`text` less an opening `start_token` and the whitespace before it (a template that
    leaves `<think>` to the model; vLLM drops it too), or `text` as it is."""
    opening = text.lstrip()
    return opening[len(start_token) :] if opening.startswith(start_token) else text


def partial_marker_start(text: str, marker: str) -> int:
    """The first index whose tail of `text` is a proper prefix of `marker`, else len(text)."""
    for i in range(max(0, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[i:]):
            return i
    return len(text)


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when the tokenizer's vocabulary holds it as one token, else None."""
    if tokenizer is None:
        return None
    if hasattr(tokenizer, "get_vocab"):
        return tokenizer.get_vocab().get(text)
    return tokenizer.token_to_id(text)
