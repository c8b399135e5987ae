"""Incremental, UTF-8-safe detokenization with stop strings.

Decoding one token at a time breaks multi-byte characters (a token may hold half of
one, which decodes to U+FFFD) and word-initial spaces (tokenizers decide spacing from
neighbours). So each step decodes a short window that starts a few tokens back, and
emits only what the window adds over its already-emitted prefix, holding back anything
that still ends in an incomplete character. A `tokenizers` fast tokenizer does this in
Rust (`tokenizers.decoders.DecodeStream`, the same algorithm, as vLLM uses it); other
tokenizers, and the rare case DecodeStream refuses, take the Python path. Either way
the text is `tokenizer.decode` of the ids, less a character the last tokens leave
incomplete (never U+FFFD for it, as in vLLM).

With stop strings, the last `len(longest stop) - 1` characters are held back too, so a
streaming client never sees the start of a stop string that is then cut off. The text
is the concatenation of the emitted pieces, streamed or not. As in vLLM, a stop string
is looked for only once `min_tokens` tokens exist, and only where it ends in new text.

`skip_special_tokens` and `spaces_between_special_tokens` mean what they mean to
`tokenizer.decode` (a fast tokenizer ignores the latter: it never puts spaces there).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens to decode along with the first output tokens


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        *,
        include_stop: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        use_decode_stream: bool = True,
    ):
        self.tokenizer = tokenizer
        self.decode_args = dict(
            skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens
        )
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.token_ids)  # tokens before this are already in `decoded`
        self.stream = _decode_stream(tokenizer, self.token_ids, skip_special_tokens) if use_decode_stream else None
        self.backend = tokenizer.backend_tokenizer if self.stream is not None else None
        self.decoded = ""  # all output text found so far (including what is held back)
        self.emitted = 0  # characters of `decoded` handed out
        self.stop = stop
        self.include_stop = include_stop  # keep the stop string at the end of the text
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.stop_reason: str | None = None

    @property
    def uses_decode_stream(self) -> bool:
        return self.stream is not None

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text it releases (possibly empty)."""
        self.token_ids.append(token_id)
        self.num_output_tokens += 1
        new_text = self._stream_step(token_id) if self.stream is not None else self._window_step()
        if new_text:
            start = len(self.decoded)
            self.decoded += new_text
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

    def _window_step(self) -> str:
        """What the tokens from `read_offset` on add to the text ("" while a character is incomplete)."""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.token_ids[self.prefix_offset :])
        if len(window) > len(prefix) and not window.endswith(REPLACEMENT_CHAR):
            return window[len(prefix) :]
        return ""

    def _stream_step(self, token_id: int) -> str:
        try:
            return self.stream.step(self.backend, token_id) or ""
        except Exception as e:  # tokenizers raises a plain Exception
            # DecodeStream gives up when a window's text stops extending its prefix (invalid
            # UTF-8 can do that; vLLM issue 17448). The offsets are ours, so the Python path
            # carries on from the same place.
            logger.debug("DecodeStream failed (%s); detokenizing this request in Python", e)
            self.stream = None
            return self._window_step()

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
        return self.tokenizer.decode(ids, **self.decode_args)


def _decode_stream(tokenizer, context_ids: list[int], skip_special_tokens: bool):
    """A DecodeStream primed with the context, or None where it would not match
    `tokenizer.decode`: not a `tokenizers` fast tokenizer, or one that cleans up spaces
    after decoding (DecodeStream does not)."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
