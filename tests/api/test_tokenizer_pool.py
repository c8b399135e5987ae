"""Tokenizing, shared fairly: prompt text too long for the context is a 400 before the
tokenizer sees it (api.prompt_size), on completions, chat and /tokenize; and big prompts
being tokenized do not hold up a small request (a pool of tokenizer threads).

Oracles: a tokenizer wrapper that records every text it is asked to encode (an in-process
server on the tiny model); the order in which real requests finish on the session server.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from api.prompt_size import bytes_per_token
from api.server import create_app
from tests.api.conftest import MODEL, serve_in_thread


class RecordingTokenizer:
    """The real tokenizer, noting every text it encodes or renders."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.texts: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._tokenizer, name)
        if name not in ("encode", "apply_chat_template"):
            return attr

        def recorded(text, *args, **kwargs):
            self.texts.append(text if isinstance(text, str) else "".join(str(m["content"]) for m in text))
            return attr(text, *args, **kwargs)

        return recorded


def test_prompt_text_over_the_byte_limit_is_a_400_and_never_tokenized(tiny_engine):
    app = create_app(tiny_engine)
    state = app.state.server
    limit = bytes_per_token(state.tokenizer) * state.max_model_len
    assert state.max_prompt_bytes == limit
    recorder = state.tokenizer = RecordingTokenizer(state.tokenizer)
    over, under = "é" * (limit // 2 + 1), "a " * (limit // 4)  # é: two bytes, so over by bytes, not characters
    cases = [
        ("/v1/completions", {"prompt": over, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": ["Hi", over], "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": over}], "max_tokens": 1}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": over}]}], "max_tokens": 1},
            "messages",
        ),
        ("/tokenize", {"prompt": over}, "prompt"),
        ("/tokenize", {"messages": [{"role": "system", "content": under}, {"role": "user", "content": under}]}, None),
        ("/tokenize", {"messages": [{"role": "user", "content": over}]}, "messages"),
    ]
    with serve_in_thread(app) as url:
        for path, body, param in cases:
            r = httpx.post(f"{url}{path}", json=body, timeout=120)
            if param is None:  # two messages of half the limit each: within it together
                assert r.status_code == 200, r.text
                continue
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "context_length_exceeded"
        # Only the chat within the limit reached the tokenizer (its render, then its encode).
        assert len(recorder.texts) == 2 and not any("é" in text for text in recorder.texts)
        # Asking for the text to be cut (as vLLM): tokenized whole, then truncated, not refused.
        words = "w1 " * (limit // 2)  # over the limit, in words of the tiny vocabulary
        cut = {"prompt": words, "max_tokens": 1, "truncate_prompt_tokens": 8}
        r = httpx.post(f"{url}/v1/completions", json=cut, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 8 and recorder.texts[-1] == words


def hex_text(size: int, seed: int) -> str:
    """Text the tokenizer is slow on for its size: about one token per byte."""
    rng = random.Random(seed)
    return "".join(rng.choice("0123456789abcdef") for _ in range(size))


def test_big_prompts_being_tokenized_do_not_hold_up_a_small_one(server, tokenizer):
    """Three /tokenize calls just under the byte limit go first; a short one sent after them
    must finish before all of them. With one tokenizer thread it would wait behind them."""
    max_model_len = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "x"}, timeout=60).json()[
        "max_model_len"
    ]
    max_prompt_bytes = bytes_per_token(tokenizer) * max_model_len
    finished: list[str] = []
    lock = threading.Lock()

    def tokenize(name: str, prompt: str) -> None:
        r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=300)
        assert r.status_code == 200, r.text
        with lock:
            finished.append(name)

    big = [hex_text(max_prompt_bytes - 16, seed) for seed in range(3)]  # the pool has 4 threads
    with ThreadPoolExecutor(len(big) + 1) as pool:
        pending = [pool.submit(tokenize, f"big{i}", text) for i, text in enumerate(big)]
        # NOTE: not a timing assert: the pause lets the big bodies reach the server first, which
        # is what makes a one-thread pool fail here; the pool passes whatever the order.
        time.sleep(0.1)
        pending.append(pool.submit(tokenize, "small", "Hello there"))
        for future in pending:
            future.result()
    assert finished[0] == "small", finished


@pytest.mark.parametrize("size", [0, -1])
def test_the_pool_needs_a_thread(tiny_engine, size):
    with pytest.raises(ValueError, match="tokenizer_pool_size"):
        create_app(tiny_engine, tokenizer_pool_size=size)
