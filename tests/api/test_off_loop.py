"""Tokenizer work (encoding a prompt, rendering a chat template) runs off the event loop.

The proof is a deadlock that only the right design escapes: the tokenizer is wrapped so
that it blocks until the test has had `/health` answered. If the tokenizer ran on the event
loop, the loop would be stuck inside it, `/health` could never answer, and the test fails
on the health check's timeout (the gate is then opened, so nothing hangs for good).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from api.server import create_app
from tests.api.conftest import serve_in_thread

HEALTH_TIMEOUT = 10  # seconds: a loop that is free answers in milliseconds


class GatedTokenizer:
    """The real tokenizer, except that `method` waits for `gate` (and records the thread)."""

    def __init__(self, tokenizer, method: str):
        self._tokenizer = tokenizer
        self._method = method
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.threads: set[str] = set()

    def __getattr__(self, name):
        attr = getattr(self._tokenizer, name)
        if name != self._method:
            return attr

        def gated(*args, **kwargs):
            self.threads.add(threading.current_thread().name)
            self.entered.set()
            if not self.gate.wait(60):  # NOTE: bounded, so a broken run fails instead of hanging
                raise TimeoutError("the test never opened the gate")
            return attr(*args, **kwargs)

        return gated


CASES = {
    "encode": ("/v1/completions", {"prompt": "the cat sat on the mat", "max_tokens": 2, "temperature": 0}),
    "apply_chat_template": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 2, "temperature": 0},
    ),
}


@pytest.mark.parametrize("method", list(CASES))
def test_tokenizer_work_does_not_block_the_event_loop(tiny_engine, method):
    path, body = CASES[method]
    app = create_app(tiny_engine)
    tokenizer = GatedTokenizer(app.state.server.tokenizer, method)
    app.state.server.tokenizer = tokenizer
    with serve_in_thread(app) as url, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{url}{path}", json=body, timeout=120)
        assert tokenizer.entered.wait(30), f"the request never reached tokenizer.{method}"
        try:
            health = httpx.get(f"{url}/health", timeout=HEALTH_TIMEOUT)
        finally:
            tokenizer.gate.set()
        assert health.status_code == 200
        response = pending.result()
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
    assert len(tokenizer.threads) == 1 and tokenizer.threads.pop().startswith("tokenizer")
