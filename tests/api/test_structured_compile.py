"""A grammar compiles off the step loop: a slow one holds up its own request, no other.

The compile is gated: it blocks until the test opens the gate. Meanwhile a free request
must run to completion; if the compile ran on the engine's thread or the event loop, the
free request could not finish and the test fails on its timeout (the gate is then opened,
so nothing hangs for good). Then the constrained request completes, its output following
its regex.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from api.server import create_app
from jaxserve.engine import EngineConfig, LLMEngine
from tests.api.conftest import serve_in_thread

SLOW = r"[a-z]{3}-[0-9]{2}"


def test_a_slow_grammar_compile_holds_up_only_its_own_request(tiny_llama_chars):
    engine = LLMEngine(
        tiny_llama_chars,
        EngineConfig(
            max_num_seqs=4,
            max_num_batched_tokens=64,
            block_size=4,
            num_blocks=128,
            max_model_len=128,
            token_buckets=(8, 64),
        ),
    )
    backend = engine.grammars.backend
    compile_, entered, gate = backend.compile, threading.Event(), threading.Event()

    def gated(spec):
        if spec.regex == SLOW:
            entered.set()
            if not gate.wait(60):  # NOTE: bounded, so a broken run fails instead of hanging
                raise TimeoutError("the test never opened the gate")
        return compile_(spec)

    backend.compile = gated
    body = {"model": "tiny", "prompt": "hello", "temperature": 0}
    with serve_in_thread(create_app(engine, model_name="tiny")) as url, ThreadPoolExecutor(1) as pool:
        slow = pool.submit(
            httpx.post,
            f"{url}/v1/completions",
            timeout=120,
            json={**body, "max_tokens": 20, "structured_outputs": {"regex": SLOW}},
        )
        assert entered.wait(30), "the constrained request never reached the compile"
        try:
            free = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 5, "ignore_eos": True}, timeout=30)
            compiling = not slow.done()
        finally:
            gate.set()
        assert free.status_code == 200, free.text
        assert free.json()["usage"]["completion_tokens"] == 5
        assert compiling, "the constrained request finished before its grammar compiled"
        response = slow.result()
        assert response.status_code == 200, response.text
        assert re.fullmatch(SLOW, response.json()["choices"][0]["text"])
