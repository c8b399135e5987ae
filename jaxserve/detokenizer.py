"""Incremental, UTF-8-safe detokenization with stop strings.

Decoding one token at a time breaks multi-byte characters (a token may hold half of
one, which decodes to U+FFFD) and word-initial spaces (tokenizers decide spacing from
neighbours). So each step decodes a short window that starts a few tokens back, and
emits only what the window adds over its already-emitted prefix, holding back anything
that still ends in an incomplete character.

With stop strings, the last `len(longest stop) - 1` characters are held back too, so a
streaming client never sees the start of a stop string that is then cut off. The text
is the concatenation of the emitted pieces, streamed or not. As in vLLM, a stop string
is looked for only once `min_tokens` tokens exist, and only where it ends in new text.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens to decode along with the first output tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (), *,
                 include_stop: bool = False, min_tokens: int = 0, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.token_ids)  # tokens before this are already in `decoded`
        self.decoded = ""  # all output text found so far (including what is held back)
        self.emitted = 0  # characters of `decoded` handed out
        self.stop = stop
        self.include_stop = include_stop  # keep the stop string at the end of the text
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.stop_reason: str | None = None

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text it releases (possibly empty)."""
        self.token_ids.append(token_id)
        self.num_output_tokens += 1
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.token_ids[self.prefix_offset :])
        if len(window) > len(prefix) and not window.endswith(REPLACEMENT_CHAR):
            start = len(self.decoded)
            self.decoded += window[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            if self.stop and self.num_output_tokens >= self.min_tokens and self._find_stop(start):
                return self._release(len(self.decoded))
        return self._release(len(self.decoded) - self.hold_back)

    def finish(self) -> str:
        """The request ended: release whatever was held back."""
        return self._release(len(self.decoded))

    @property
    def text(self) -> str:
        return self.decoded[: self.emitted]

    def _find_stop(self, new_from: int) -> bool:
        """Cut `decoded` at the first stop string that ends in the new text."""
        search_from = max(0, new_from - self.hold_back)
        hits = [(i, s) for s in self.stop if (i := self.decoded.find(s, search_from)) >= 0]
        if not hits:
            return False
        index, self.stop_reason = min(hits)
        self.decoded = self.decoded[: index + (len(self.stop_reason) if self.include_stop else 0)]
        return True

    def _release(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        piece = self.decoded[self.emitted : upto]
        self.emitted = upto
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
