"""A cap on prompt text, checked before anything is tokenized.

Tokenizing costs time in proportion to the text (more for long runs without spaces), and a
request body may be tens of megabytes: three 8.5 MB prompts once held the tokenizer for
minutes. vLLM tokenizes first and compares the token count with the context after; here a
text that cannot fit the context whole is refused before the tokenizer sees it.

The cap is `max_model_len` times the UTF-8 length of the vocabulary's longest token: no
prompt that fits the context can be longer, since each of its tokens stands for at most
that many bytes of text. (The vocabulary is measured as its token strings are stored: a
byte-level BPE writes a space as "Ġ", two bytes, so the cap is up to twice as generous as
it must be; safe, and still far below a body limit of megabytes.) NOTE: a tokenizer whose
normalizer deletes characters could in principle fit more text; none of the supported
model families has one. A request with truncate_prompt_tokens is not capped: it asks for
a longer text to be cut after tokenizing, as vLLM does (the body limit and the tokenizer
pool still bound what it costs others).
"""

from __future__ import annotations

from api.errors import bad_request

# A floor for tokenizers whose vocabulary says little (a few short tokens).
MIN_BYTES_PER_TOKEN = 16


def bytes_per_token(tokenizer) -> int:
    """The most UTF-8 bytes any one token of `tokenizer` stands for (an upper bound)."""
    longest = max((len(token.encode()) for token in tokenizer.get_vocab()), default=0)
    return max(longest, MIN_BYTES_PER_TOKEN)


def max_prompt_bytes(tokenizer, max_model_len: int) -> int | None:
    """The cap for a server of context `max_model_len` (None without a tokenizer: prompts are then token ids)."""
    return None if tokenizer is None else bytes_per_token(tokenizer) * max_model_len


def check_prompt_bytes(texts: list[str], limit: int, max_model_len: int, param: str) -> None:
    """A 400 naming `param` when the texts (one prompt's, or a chat's messages) together
    are over `limit` UTF-8 bytes."""
    size = 0
    for text in texts:
        # len(text) is a lower bound of the bytes, and free: only a text near the limit is encoded.
        size += len(text) if len(text) > limit else len(text.encode())
        if size > limit:
            raise bad_request(
                f"The {param} is over {limit} bytes of text, more than this model's context of {max_model_len} "
                f"tokens could hold; it was not tokenized. Please shorten the {param}.",
                param,
                code="context_length_exceeded",
            )
