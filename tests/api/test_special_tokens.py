"""vLLM's skip_special_tokens and spaces_between_special_tokens, through the real `openai`
client (`extra_body=`), streamed and not; the oracle is the tokenizer's own decode."""

from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import MODEL
from tests.api.test_completions import stream_text

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def chat_prompt(tokenizer) -> str:
    return tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)


def completion(client, prompt: str, stream: bool = False, **extra):
    """Greedy, past EOS: the model writes <|im_end|> and carries on."""
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True, **extra})
    if stream:
        return stream_text(client.completions.create(stream=True, **kw))[0][0]
    return client.completions.create(**kw).choices[0].text


def test_special_tokens_shown_when_not_skipped(client, tokenizer, chat_prompt):
    skipped = completion(client, chat_prompt)
    shown = completion(client, chat_prompt, skip_special_tokens=False)
    assert IM_END in shown and IM_END not in skipped
    # The same tokens: decoding the shown text's tokens without their special tokens gives the default text.
    assert tokenizer.decode(tokenizer.encode(shown, add_special_tokens=False), skip_special_tokens=True) == skipped
    assert completion(client, chat_prompt, stream=True, skip_special_tokens=False) == shown
    assert completion(client, chat_prompt, stream=True) == skipped
    # A fast tokenizer puts no spaces around special tokens either way, as tokenizer.decode.
    ids = tokenizer.encode(shown, add_special_tokens=False)
    for spaces in (True, False):
        want = tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert (
            completion(client, chat_prompt, skip_special_tokens=False, spaces_between_special_tokens=spaces)
            == want
            == shown
        )


def test_chat_shows_special_tokens_when_not_skipped(client):
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    extra = {"ignore_eos": True, "skip_special_tokens": False}
    whole = client.chat.completions.create(extra_body=extra, **kw).choices[0].message.content
    assert IM_END in whole
    chunks = client.chat.completions.create(stream=True, extra_body=extra, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    default = client.chat.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].message.content
    assert whole.replace(IM_END, "").replace("<|im_start|>", "") == default


def test_the_eos_that_ends_a_request_is_not_text(client):
    """As vLLM: the stop token itself is left out of the text unless include_stop_str_in_output."""
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0)
    ended = client.chat.completions.create(extra_body={"skip_special_tokens": False}, **kw).choices[0]
    assert ended.finish_reason == "stop" and IM_END not in ended.message.content
    kept = client.chat.completions.create(
        extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True}, **kw
    ).choices[0]
    assert kept.message.content == ended.message.content + IM_END


@pytest.mark.parametrize("field", ["skip_special_tokens", "spaces_between_special_tokens"])
def test_a_field_that_is_not_a_bool_is_a_400_naming_it(server, field):
    r = httpx.post(
        f"{server.url}/v1/completions",
        headers=server.headers,
        timeout=60,
        json={"model": MODEL, "prompt": "hi", "max_tokens": 1, field: "no"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == field
