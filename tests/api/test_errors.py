"""Bad input gets an OpenAI-shaped 4xx (never a 500) and never disturbs other requests."""

from __future__ import annotations

import socket
import threading

import httpx
import openai
import pytest

from tests.api.conftest import MODEL


def post(server, path: str, body, headers=None) -> httpx.Response:
    kw = {"json": body} if not isinstance(body, (str, bytes)) else {"content": body}
    return httpx.post(
        f"{server.url}{path}",
        headers={**server.headers, **(headers or {}), "Content-Type": "application/json"},
        timeout=60,
        **kw,
    )


def assert_error(response: httpx.Response, status: int, param=..., code=...) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error


COMPLETION_CASES = [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),  # a wrong type: FastAPI's 422 becomes a 400
    ({"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "extra": 1, "top_k": -2}, "top_k"),
    ({"prompt": "hi", "min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "hi", "stop_token_ids": [10**12], "min_tokens": 1}, "stop_token_ids"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "logit_bias": {"49152": 10}}, "logit_bias"),  # past the vocabulary
    ({"prompt": ""}, "prompt"),  # the engine's ValueError: an empty prompt
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [49152]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),  # vLLM's range, [-2**63, 2**63 - 1]: not wrapped onto 0
    ({"prompt": "hi", "seed": 2**63}, "seed"),
    ({"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    # A lone surrogate, which Python's JSON parser accepts, as raw JSON (a client would not encode it).
    (r'{"prompt": "a\ud800b"}', "prompt"),
    (r'{"prompt": ["fine", "a\udc00"]}', "prompt"),
    (r'{"prompt": "hi", "stop": ["\ud800"]}', "stop"),
]


@pytest.mark.parametrize("body,param", COMPLETION_CASES, ids=[str(b)[:60] for b, _ in COMPLETION_CASES])
def test_bad_completion_parameters_are_400(server, body, param):
    assert_error(post(server, "/v1/completions", body), 400, param=param)


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content",
    ),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "seed"),
    (r'{"messages": [{"role": "user", "content": "a\ud800b"}]}', "messages[0].content"),
    (
        r'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\udfff"}]}',
        "messages[1].content",
    ),
    (r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]}', "messages[0].content"),
    (
        r'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": "\ud800"}}',
        "chat_template_kwargs",
    ),
]


@pytest.mark.parametrize("body,param", CHAT_CASES, ids=[str(b)[:60] for b, _ in CHAT_CASES])
def test_bad_chat_parameters_are_400(server, body, param):
    assert_error(post(server, "/v1/chat/completions", body), 400, param=param)


def test_text_that_is_not_unicode_is_400_naming_the_field(server, client):
    """A lone surrogate ("\\ud800" in the JSON) is a 400 on every route that takes text, not the
    tokenizer's TypeError (a 500); its message escapes it, and the server serves on."""
    error = assert_error(post(server, "/v1/completions", r'{"prompt": "a\ud800b"}'), 400, param="prompt")
    assert "lone surrogate U+D800" in error["message"]
    assert_error(post(server, "/tokenize", r'{"prompt": "a\ud800b"}'), 400, param="prompt")
    chat = r'{"messages": [{"role": "user", "content": "a\ud800b"}]}'
    assert_error(post(server, "/tokenize", chat), 400, param="messages[0].content")
    assert_error(post(server, "/v1/completions", r'{"model": "\ud800", "prompt": "hi"}'), 400, param="model")
    # A surrogate pair is a valid character.
    assert post(server, "/tokenize", r'{"prompt": "a\ud83d\ude00b"}').json()["count"] > 0
    assert client.completions.create(model=MODEL, prompt="a\U0001f600b", max_tokens=1).choices[0].finish_reason


def test_seeds_at_the_ends_of_the_range_run(client):
    for seed in (-(2**63), 2**63 - 1):
        out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, seed=seed)
        assert out.usage.completion_tokens >= 1
        messages = [{"role": "user", "content": "hi"}]
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, seed=seed)
        assert out.usage.completion_tokens >= 1


def test_bad_json_and_bodies_are_400(server):
    assert_error(post(server, "/v1/completions", "{not json"), 400)
    assert_error(post(server, "/v1/completions", "[]"), 400)
    assert_error(post(server, "/v1/chat/completions", '"text"'), 400)


def test_a_request_without_a_body_says_so(server):
    for path in ("/v1/completions", "/v1/chat/completions"):
        for response in (
            post(server, path, b""),  # an empty JSON body
            httpx.post(f"{server.url}{path}", headers=server.headers, timeout=60),
        ):  # no body at all
            error = assert_error(response, 400, param=None)
            assert "no body" in error["message"] and "None" not in error["message"], error


def test_prompt_longer_than_the_context_is_400(server, client):
    max_model_len = client.models.retrieve(MODEL).model_extra["max_model_len"]
    long_prompt = [100] * (max_model_len + 5)
    assert_error(
        post(server, "/v1/completions", {"prompt": long_prompt}), 400, param="prompt", code="context_length_exceeded"
    )
    # The prompt fits, but not with the completion asked for (OpenAI's and vLLM's rule).
    error = assert_error(
        post(server, "/v1/completions", {"prompt": [100] * 100, "max_tokens": max_model_len}),
        400,
        code="context_length_exceeded",
    )
    assert f"maximum context length is {max_model_len} tokens" in error["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * max_model_len}])
    assert e.value.code == "context_length_exceeded"


def test_unknown_model_is_404_model_not_found(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-5", prompt="hi")
    assert e.value.code == "model_not_found" and "`gpt-5` does not exist" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")
    assert_error(
        post(server, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
        404,
        code="model_not_found",
    )


def test_unknown_path_and_method_are_openai_errors(server):
    assert_error(httpx.get(f"{server.url}/v1/nothing", headers=server.headers), 404)
    assert_error(httpx.get(f"{server.url}/nothing"), 404)
    assert_error(httpx.get(f"{server.url}/v1/completions", headers=server.headers), 405)


def test_api_key_is_required_on_v1(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Basic dGVzdC1rZXk="},
        {"Authorization": f"Bearer {server.api_key}x"},
    ):
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert_error(response, 401, code="invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"
    assert_error(httpx.get(f"{server.url}/v1/models"), 401)
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 401)  # every /v1 path, known or not
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers).status_code == 200
    wrong = server.client(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    # Probes and scrapers need no key.
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_a_request_without_the_key_is_refused_before_its_body_is_read(server):
    """The key is checked on the headers: a keyless upload of 31 MiB (under the body limit)
    gets its 401 while the client has sent a few bytes of it (were the body read first, the
    server would wait for the rest and this read would time out)."""
    url = httpx.URL(server.url)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {31 << 20}\r\n\r\n"
    )
    with socket.create_connection((url.host, url.port), timeout=60) as sock:
        sock.sendall(head.encode() + b'{"prompt": "')
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(65536)
            assert data, f"the server closed the connection without an answer: {answer!r}"
            answer += data
    assert answer.startswith(b"HTTP/1.1 401"), answer
    # With the key, the same route serves.
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers).status_code == 200


def test_bad_requests_do_not_disturb_a_running_stream(server, client):
    """Every bad request above is sent, over and over, while a stream runs; the stream
    completes intact and equals the same request run alone."""
    kw = dict(
        model=MODEL,
        prompt="Tell me a story about a dragon.",
        max_tokens=40,
        temperature=0.9,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    alone = client.completions.create(**kw).choices[0].text
    pieces, started = [], threading.Event()

    def consume():
        for chunk in client.completions.create(stream=True, **kw):
            pieces.extend(c.text for c in chunk.choices)
            started.set()

    thread = threading.Thread(target=consume)
    thread.start()
    assert started.wait(120)
    rounds = 0
    while thread.is_alive():  # keep the bad requests coming for as long as the stream runs
        for body, _ in COMPLETION_CASES:
            assert post(server, "/v1/completions", body).status_code == 400
        for body, _ in CHAT_CASES:
            assert post(server, "/v1/chat/completions", body).status_code == 400
        rounds += 1
    thread.join()
    assert rounds >= 1
    assert "".join(pieces) == alone
    server.wait_idle()
