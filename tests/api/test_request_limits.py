"""What one request may ask for: a body over the size limit is a 413 (declared or chunked),
a call that fans out to more than max_request_sequences (prompts x n) is a 400; both are
OpenAI-shaped, cost the engine nothing, and the server serves normally afterwards. However
much text a call carries, its log line stays short.
The app runs in-process (uvicorn on loopback) on the tiny model, with small limits."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from api.server import create_app
from api.serving import MAX_LOGGED_FIELD_CHARS
from tests.api.conftest import parse_metrics, serve_in_thread
from tests.api.test_errors import assert_error

MAX_BODY = 64 << 10
MAX_SEQUENCES = 4


@pytest.fixture(scope="module")
def url(tiny_engine):
    app = create_app(
        tiny_engine, model_name="tiny", max_request_sequences=MAX_SEQUENCES, max_request_body_bytes=MAX_BODY
    )
    with serve_in_thread(app) as url:
        yield url


def body_of_size(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (the padding is an ignored field)."""
    head = json.dumps({"prompt": "the cat", "max_tokens": 1, "padding": ""}).encode()
    body = head[:-2] + b"x" * (size - len(head)) + head[-2:]
    assert len(body) == size and json.loads(body)
    return body


def assert_idle_and_serving(url: str) -> None:
    m = parse_metrics(httpx.get(f"{url}/metrics").text)
    assert m["jaxserve:num_requests_running"] == m["jaxserve:num_requests_waiting"] == 0
    assert m["jaxserve:kv_cache_free_blocks"] == m["jaxserve:kv_cache_total_blocks"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    out = client.completions.create(model="tiny", prompt="the dog", max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2  # sampled: without ignore_eos the tiny model may end at once


def test_a_body_over_the_limit_is_413_whether_declared_or_chunked(url):
    fits = httpx.post(
        f"{url}/v1/completions",
        content=body_of_size(MAX_BODY),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert fits.status_code == 200, fits.text

    declared = httpx.post(
        f"{url}/v1/completions",
        content=body_of_size(MAX_BODY + 1),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    error = assert_error(declared, 413, code="request_too_large")
    assert str(MAX_BODY) in error["message"] and "--max-request-body-bytes" in error["message"]

    def chunks():  # no Content-Length: the server counts as the body arrives
        body = body_of_size(4 * MAX_BODY)
        for i in range(0, len(body), 8192):
            yield body[i : i + 8192]

    chunked = httpx.post(
        f"{url}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}, timeout=60
    )
    assert "content-length" not in chunked.request.headers
    assert_error(chunked, 413, code="request_too_large")

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="the " * MAX_BODY, max_tokens=1)
    assert e.value.status_code == 413 and e.value.code == "request_too_large"
    assert_idle_and_serving(url)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "the cat", "n": MAX_SEQUENCES + 1}, "n"),
        ("/v1/completions", {"prompt": ["the cat", "a dog", "the sun"], "n": 2}, "n"),
        ("/v1/completions", {"prompt": [[5, 6]] * (MAX_SEQUENCES + 1)}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": MAX_SEQUENCES + 1}, "n"),
    ],
)
def test_too_many_sequences_in_one_call_is_400(url, path, body, param):
    error = assert_error(httpx.post(f"{url}{path}", json={**body, "max_tokens": 1}, timeout=60), 400, param=param)
    assert f"at most {MAX_SEQUENCES} per request" in error["message"]
    assert_idle_and_serving(url)


def test_a_call_at_the_sequence_limit_runs(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    out = client.completions.create(
        model="tiny", prompt=["the cat", "a dog"], n=2, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == MAX_SEQUENCES * 3
    assert_idle_and_serving(url)


def test_the_request_log_line_cuts_long_fields(url, caplog):
    """The one log line per call (its id, prompt sizes and sampling parameters) shows each
    field's first MAX_LOGGED_FIELD_CHARS characters and how many more there were, whatever the
    call carries; the prompt is never in it."""
    body = {
        "prompt": "the cat sat " * 2000,
        "truncate_prompt_tokens": 8,
        "max_tokens": 1,
        "stop": ["the dog ran " * 60] * 20,
        "logit_bias": {str(i): 0.5 for i in range(97)},
        "allowed_token_ids": list(range(3, 97)),
    }
    with caplog.at_level(logging.INFO):
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    lines = [record.getMessage() for record in caplog.records]
    (line,) = [line for line in lines if "prompt token(s)" in line]
    assert "stop=('the dog ran" in line and "more chars]" in line and "the cat" not in line
    # Three fields cut, about 20 short ones; whole, the stop strings alone would be 14,000 characters.
    assert max(len(line) for line in lines) < 12 * MAX_LOGGED_FIELD_CHARS
    assert_idle_and_serving(url)
