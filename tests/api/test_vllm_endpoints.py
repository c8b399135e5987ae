"""vLLM's extra routes (/tokenize, /detokenize, /version) and server flags, through real
servers: the session server (default model, default flags) and one server on the tiny model
with every flag these tests need (`flagged`).

Oracles: transformers' tokenizers and chat templates (the GGUF's, the tiny folder's), the
server's own logs and /openapi.json, and the CORS headers a browser would check.
"""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.api.conftest import MODEL, run_server

NAMES = ["tiny", "tiny-alias"]
ORIGIN = "http://allowed.example"
# A template with a branch only chat_template_kwargs reaches (vLLM's enable_thinking).
THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% if enable_thinking %} one two{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_folder):
    return AutoTokenizer.from_pretrained(tiny_folder)


@pytest.fixture(scope="module")
def flagged(tiny_folder, tmp_path_factory):
    """The tiny model's weights without a tokenizer (--tokenizer brings the tiny folder's)."""
    root = tmp_path_factory.mktemp("flagged")
    weights = root / "weights"
    weights.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_folder / name, weights / name)
    template = root / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    flags = [
        "--model",
        str(weights),
        "--tokenizer",
        str(tiny_folder),
        "--served-model-name",
        *NAMES,
        "--chat-template",
        str(template),
        "--trust-request-chat-template",
        "--max-logprobs",
        "3",
        "--disable-log-requests",
        "--uvicorn-log-level",
        "warning",
        "--root-path",
        "/proxy",
        "--allowed-origins",
        f'["{ORIGIN}"]',
        "--allowed-methods",
        '["GET", "POST"]',
        "--max-model-len",
        "64",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
        "--block-size",
        "4",
        "--num-blocks",
        "64",
    ]
    with run_server(root, *flags) as server:
        yield server


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=60)


# -- /tokenize, /detokenize, /version --------------------------------------------------------


def test_tokenize_a_prompt_as_transformers_does(server, tokenizer):
    prompt = "The capital of France is Paris."
    for add_special in (True, False):
        got = post(
            server,
            "/tokenize",
            {"model": MODEL, "prompt": prompt, "add_special_tokens": add_special, "return_token_strs": True},
        ).json()
        want = tokenizer(prompt, add_special_tokens=add_special).input_ids
        max_model_len = server.client().models.list().data[0].model_extra["max_model_len"]
        assert got == {
            "count": len(want),
            "max_model_len": max_model_len,
            "tokens": want,
            "token_strs": tokenizer.convert_ids_to_tokens(want),
        }
    assert post(server, "/tokenize", {"prompt": prompt}).json()["token_strs"] is None


def test_tokenize_messages_renders_the_chat_template_as_transformers_does(server, client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    got = post(server, "/tokenize", {"messages": messages}).json()
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert got["tokens"] == list(want["input_ids"])
    # ... which is the prompt a chat completion runs.
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert usage.prompt_tokens == got["count"]


def test_detokenize_decodes_as_transformers_does(server, tokenizer):
    ids = tokenizer("Hello, world! Ünïcode ✓").input_ids
    assert post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}


def test_tokenize_refusals_name_the_field(server):
    cases = [
        ({}, "messages"),
        ({"prompt": "a", "messages": MESSAGES}, "prompt"),
        ({"prompt": "a", "model": "nope"}, "model"),
    ]
    for body, param in cases:
        r = post(server, "/tokenize", body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)
    r = post(server, "/detokenize", {"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_version(server):
    from importlib.metadata import version

    assert httpx.get(f"{server.url}/version").json() == {"version": version("jaxserve")}


# -- --served-model-name, --tokenizer, --chat-template ----------------------------------------


def test_every_served_name_works_and_responses_report_the_first(flagged):
    client = flagged.client()
    assert [m.id for m in client.models.list().data] == NAMES
    for name in NAMES:
        assert client.completions.create(model=name, prompt="the cat", max_tokens=1).model == NAMES[0]
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="the cat", max_tokens=1)


def test_tokenizer_flag_supplies_the_tokenizer_the_weights_lack(flagged, tiny_tokenizer):
    prompt = "the cat sat on the mat"
    assert post(flagged, "/tokenize", {"prompt": prompt}).json()["tokens"] == tiny_tokenizer(prompt).input_ids
    completion = flagged.client().completions.create(model=NAMES[0], prompt=prompt, max_tokens=1)
    assert completion.usage.prompt_tokens == len(tiny_tokenizer(prompt).input_ids)


def test_chat_template_flag_and_chat_template_kwargs(flagged, tiny_tokenizer):
    client = flagged.client()
    rendered = {}
    for thinking in (None, False, True):
        extra = {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}
        got = post(flagged, "/tokenize", {"messages": MESSAGES, **extra}).json()["tokens"]
        want = tiny_tokenizer.apply_chat_template(
            MESSAGES,
            chat_template=THINKING_TEMPLATE,
            add_generation_prompt=True,
            tokenize=False,
            **extra.get("chat_template_kwargs", {}),
        )
        assert got == tiny_tokenizer(want, add_special_tokens=False).input_ids
        usage = client.chat.completions.create(model=NAMES[0], messages=MESSAGES, max_tokens=1, extra_body=extra).usage
        assert usage.prompt_tokens == len(got)
        rendered[thinking] = got
    assert rendered[None] == rendered[False] != rendered[True]  # the flag's template, its branch taken on request
    assert len(rendered[True]) == len(rendered[False]) + 2


def test_a_request_chat_template_needs_the_trust_flag(flagged, server, tiny_tokenizer):
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    got = post(flagged, "/tokenize", {"messages": MESSAGES, "chat_template": template}).json()["tokens"]
    assert got == tiny_tokenizer("hello world ", add_special_tokens=False).input_ids
    # Not without the flag, nor slipped in as a template variable (which is never allowed).
    for body, param in (
        ({"chat_template": template}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": template}}, "chat_template_kwargs"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, extra_body=body)
        assert e.value.body["param"] == param


# -- --max-logprobs, logging, --root-path, CORS ------------------------------------------------


def test_max_logprobs_refuses_more(flagged):
    client = flagged.client()
    # Greedy, so the sampled token is among the top 3 (no fourth entry for it).
    out = client.completions.create(model=NAMES[0], prompt="the cat", max_tokens=2, logprobs=3, temperature=0)
    assert [len(top) for top in out.choices[0].logprobs.top_logprobs] == [3, 3]
    for call, field in (
        (lambda: client.completions.create(model=NAMES[0], prompt="the cat", max_tokens=1, logprobs=4), "logprobs"),
        (
            lambda: client.chat.completions.create(
                model=NAMES[0], messages=MESSAGES, max_tokens=1, logprobs=True, top_logprobs=4
            ),
            "top_logprobs",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == field


def test_request_log_lines_and_uvicorn_log_level(flagged, server, client):
    logged = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    unlogged = flagged.client().completions.create(model=NAMES[0], prompt="the cat", max_tokens=1)
    assert f"request {logged.id}:" in server.log.read_text()
    log = flagged.log.read_text()
    assert f"request {unlogged.id}" not in log and "request cmpl-" not in log  # --disable-log-requests
    # uvicorn's own info lines: at --log-level info, not at --uvicorn-log-level warning.
    assert "Application startup complete" in server.log.read_text()
    assert "Application startup complete" not in log


def test_root_path_serves_behind_a_prefix_stripping_proxy(flagged, server):
    # The proxy strips /proxy, so requests arrive unprefixed; links and the schema carry it.
    assert httpx.get(f"{flagged.url}/openapi.json").json()["servers"] == [{"url": "/proxy"}]
    assert "servers" not in httpx.get(f"{server.url}/openapi.json").json()
    assert httpx.get(f"{flagged.url}/v1/models", headers=flagged.headers).status_code == 200
    assert httpx.get(f"{flagged.url}/v1/models").status_code == 401  # the API key still guards /v1


def test_cors_preflight_and_simple_request(flagged):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(f"{flagged.url}/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert {"GET", "POST"} <= {m.strip() for m in ok.headers["access-control-allow-methods"].split(",")}
    refused = httpx.options(
        f"{flagged.url}/v1/chat/completions", headers={"Origin": "http://elsewhere.example", **preflight}
    )
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    simple = httpx.get(f"{flagged.url}/v1/models", headers={"Origin": ORIGIN, **flagged.headers})
    assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{flagged.url}/v1/models", headers={"Origin": "http://elsewhere.example", **flagged.headers})
    assert "access-control-allow-origin" not in other.headers
