"""Logprobs in OpenAI's two shapes, with each token's text and exact UTF-8 bytes.

A token may hold part of a multi-byte character, so its text alone can't be decoded.
For byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM, Qwen) each character of the
vocabulary entry stands for one byte, which gives the exact bytes; the shown text is
those bytes decoded, with any incomplete character written as `\\xNN` escapes (as the
OpenAI API does), so distinct tokens keep distinct strings. SentencePiece tokenizers
(Llama 2, Mistral, TinyLlama) spell a space `▁` and a byte outside the vocabulary
`<0xE2>`: those pieces stand for " " and that one byte.
"""

from __future__ import annotations

import functools
import json
import re

_SPACE = "\u2581"  # SentencePiece's visible space, "▁"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (used by byte-level BPE)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


class TokenText:
    """Token id -> (text, bytes) as shown in logprobs; cached, since the vocabulary is fixed."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        kinds = _decoder_kinds(decoder)
        self.byte_level = "ByteLevel" in kinds
        self.sentencepiece = not self.byte_level and bool(kinds & {"Metaspace", "ByteFallback"})
        self.added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.lookup = functools.lru_cache(maxsize=65536)(self._lookup)

    def text(self, token_id: int) -> str:
        return self.lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return list(self.lookup(token_id)[1])

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        if self.tokenizer is None:  # prompts were token ids; name tokens the way vLLM does then
            text = f"token_id:{token_id}"
            return text, text.encode()
        if self.byte_level and token_id not in self.added:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is not None and all(c in _BYTE_DECODER for c in piece):
                raw = bytes(_BYTE_DECODER[c] for c in piece)
                return raw.decode("utf-8", errors="backslashreplace"), raw
        if self.sentencepiece and token_id not in self.added:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is not None:
                byte = _BYTE_PIECE.fullmatch(piece)
                raw = bytes([int(byte.group(1), 16)]) if byte else piece.replace(_SPACE, " ").encode("utf-8")
                return raw.decode("utf-8", errors="backslashreplace"), raw
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text, text.encode("utf-8")


def _decoder_kinds(decoder) -> set[str]:
    """The types of a `tokenizers` decoder and of the decoders inside it (a Sequence)."""
    if decoder is None:
        return set()
    kinds, todo = set(), [json.loads(decoder.__getstate__())]
    while todo:
        state = todo.pop()
        kinds.add(state.get("type"))
        todo += state.get("decoders") or []
    return kinds


def ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
    """An engine logprobs entry (top-k plus the sampled token) from most to least likely."""
    return sorted(((t, finite(lp)) for t, lp in entry.items()), key=lambda kv: -kv[1])


def finite(logprob: float) -> float:
    """-inf (a token the grammar or allowed_token_ids rules out) as vLLM writes it: -9999.0,
    since JSON has no infinity."""
    return max(logprob, -9999.0)


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, float] | None], tokens: TokenText, text_offset: int
) -> dict:
    """The legacy completions shape: parallel lists, `top_logprobs` keyed by token text.

    `text_offset` is where the first token starts in the choice's text (later stream
    chunks continue from the earlier ones). An entry None (an echoed prompt's first
    token, which nothing predicts) gives null logprobs.
    """
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = tokens.text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else finite(entry[token_id]))
        out["top_logprobs"].append(None if entry is None else {tokens.text(t): lp for t, lp in ranked(entry)})
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, float]], tokens: TokenText, top_logprobs: int
) -> list[dict]:
    """The chat shape: `logprobs.content`, one object per token with its `top_logprobs` alternatives."""

    def item(token_id, logprob):
        return {"token": tokens.text(token_id), "logprob": logprob, "bytes": tokens.bytes(token_id)}

    return [
        {
            **item(token_id, finite(entry[token_id])),
            "top_logprobs": [item(t, lp) for t, lp in ranked(entry)[:top_logprobs]],
        }
        for token_id, entry in zip(token_ids, entries)
    ]


def echo_entries(prompt_token_ids: list[int], prompt_logprobs: list, k: int) -> list[dict[int, float] | None]:
    """An engine's prompt logprobs as completion logprobs entries: each prompt token and its
    top `k` alternatives (the engine may have computed more, for `prompt_logprobs`)."""
    return [
        None if entry is None else {t: lp.logprob for t, lp in entry.items() if lp.rank <= k or t == token}
        for token, entry in zip(prompt_token_ids, prompt_logprobs)
    ]


def vllm_prompt_logprobs(
    prompt_token_ids: list[int], prompt_logprobs: list | None, k: int, tokens: TokenText
) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token_id:
    {logprob, rank, decoded_token}} for the token and its top `k` alternatives."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {
                "logprob": finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token if lp.decoded_token is not None else tokens.text(t),
            }
            for t, lp in entry.items()
            if lp.rank <= k or t == token
        }
        for token, entry in zip(prompt_token_ids, prompt_logprobs)
    ]
