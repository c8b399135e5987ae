"""vLLM's request fields as api/vllm_fields.py lists them, on the session server through the
real `openai` client: the table covers every field the server declares, each refused field
is a 400 naming it (its harmless values pass), ignored and nested unknown fields reach the
`x-ignored-fields` header, and the honoured fields truncation_side, return_token_ids and
stream_options.continuous_usage_stats do what vLLM does. (Whether the table still matches
vLLM itself: benchmarks/check_vllm_fields.py, where vLLM is installed.)

Oracles: transformers' tokenizer and chat template (read from the same GGUF), the same
request sent with the prompt's token ids cut by hand, and the server's own whole answer for
its streamed one.
"""

from __future__ import annotations

import uuid

import openai
import pytest

from api import vllm_fields
from api.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from tests.api.conftest import MODEL

QUESTION = [{"role": "user", "content": "Name a color."}]
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."
GREEDY = dict(model=MODEL, temperature=0)


def template_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


def declared(model) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


@pytest.mark.parametrize(
    "model, table",
    [
        (CompletionRequest, vllm_fields.COMPLETIONS),
        (ChatCompletionRequest, vllm_fields.CHAT),
        (StreamOptions, vllm_fields.STREAM_OPTIONS),
    ],
)
def test_the_table_lists_every_field_the_server_declares(model, table):
    assert declared(model) - set(table) == set()
    ignored = {name for name, use in table.items() if use.handling == "ignored"}
    assert all(table[name].reason for name in ignored)


def endpoints(client):
    return {
        "completions": (client.completions, {"prompt": "Hi"}),
        "chat": (client.chat.completions, {"messages": QUESTION}),
    }


def refused_cases() -> list:
    return [
        pytest.param(endpoint, name, use, id=f"{endpoint}-{name}")
        for endpoint in vllm_fields.ENDPOINTS
        for name, use in vllm_fields.refused_fields(endpoint).items()
    ]


def unwelcome_value(name: str, use: vllm_fields.FieldUse):
    """A value of the field's type that is not harmless."""
    if name == "functions":
        return [{"name": "f", "parameters": {}}]
    if False in use.harmless[1:]:
        return True
    if 1.0 in use.harmless[1:]:
        return 0.5
    return "x"


@pytest.mark.parametrize("endpoint, name, use", refused_cases())
def test_each_refused_field_is_a_400_naming_it_and_its_harmless_values_pass(client, endpoint, name, use):
    api, args = endpoints(client)[endpoint]
    with pytest.raises(openai.BadRequestError) as e:
        api.create(model=MODEL, max_tokens=1, extra_body={name: unwelcome_value(name, use)}, **args)
    assert e.value.body["param"] == name
    for harmless in use.harmless:
        assert api.create(model=MODEL, max_tokens=1, extra_body={name: harmless}, **args).usage.completion_tokens == 1


@pytest.mark.parametrize("endpoint", list(vllm_fields.ENDPOINTS))
def test_ignored_and_nested_unknown_fields_are_named_in_the_header(client, endpoint):
    api, args = endpoints(client)[endpoint]
    model = CompletionRequest if endpoint == "completions" else ChatCompletionRequest
    table = vllm_fields.ENDPOINTS[endpoint]
    # (A declared field such as `user` is OpenAI's own, and not named.)
    ignored = sorted(n for n, use in table.items() if use.handling == "ignored" and n not in declared(model))
    extra = {name: None for name in ignored}
    unknown = f"unknown_{uuid.uuid4().hex[:8]}"
    extra["stream_options"] = {"include_usage": True, unknown: 1}
    extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", unknown: 2}}
    raw = api.with_raw_response.create(model=MODEL, max_tokens=1, stream=True, extra_body=extra, **args)
    header = raw.headers["x-ignored-fields"].split(", ")
    assert sorted(header) == sorted([*ignored, f"response_format.json_schema.{unknown}", f"stream_options.{unknown}"])
    assert any(chunk.usage for chunk in raw.parse())  # include_usage still honoured beside them


def test_truncation_side_right_keeps_the_first_tokens(client, tokenizer):
    ids = tokenizer(TEXT).input_ids
    for side, kept in (("right", ids[:5]), ("left", ids[-5:]), (None, ids[-5:])):
        cut = client.completions.create(
            prompt=TEXT, max_tokens=6, extra_body={"truncate_prompt_tokens": 5, "truncation_side": side}, **GREEDY
        )
        by_hand = client.completions.create(prompt=kept, max_tokens=6, **GREEDY)
        assert cut.usage.prompt_tokens == 5
        assert cut.choices[0].text == by_hand.choices[0].text, side

    messages = [{"role": "user", "content": TEXT}]
    chat = client.chat.completions.create(
        messages=messages, max_tokens=6, extra_body={"truncate_prompt_tokens": 7, "truncation_side": "right"}, **GREEDY
    )
    template = template_ids(tokenizer, messages)
    by_hand = client.completions.create(prompt=template[:7], max_tokens=6, **GREEDY)
    assert chat.usage.prompt_tokens == 7
    assert chat.choices[0].message.content == by_hand.choices[0].text


def test_return_token_ids_on_completions_whole_and_streamed(client, tokenizer):
    prompt_ids = tokenizer(TEXT).input_ids
    args = dict(prompt=TEXT, max_tokens=8, extra_body={"return_token_ids": True}, **GREEDY)
    whole = client.completions.create(**args).choices[0]
    assert whole.prompt_token_ids == prompt_ids
    assert len(whole.token_ids) == 8 and tokenizer.decode(whole.token_ids) == whole.text
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **args) if c.choices]
    assert chunks[0].prompt_token_ids == prompt_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    plain = client.completions.create(prompt=TEXT, max_tokens=1, model=MODEL).choices[0]
    assert "token_ids" not in plain.model_extra and "prompt_token_ids" not in plain.model_extra


def test_return_token_ids_on_chat_whole_and_streamed(client, tokenizer):
    prompt_ids = client.chat.completions.create(messages=QUESTION, max_tokens=1, **GREEDY).usage.prompt_tokens
    args = dict(messages=QUESTION, max_tokens=8, extra_body={"return_token_ids": True}, **GREEDY)
    whole = client.chat.completions.create(**args)
    assert len(whole.prompt_token_ids) == prompt_ids
    assert whole.prompt_token_ids == template_ids(tokenizer, QUESTION)
    token_ids = whole.choices[0].token_ids
    assert len(token_ids) == whole.usage.completion_tokens
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == whole.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids and chunks[0].choices[0].delta.role == "assistant"
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c.choices[0].token_ids] == token_ids


@pytest.mark.parametrize("endpoint", list(vllm_fields.ENDPOINTS))
def test_continuous_usage_stats_puts_usage_so_far_on_every_chunk(client, endpoint):
    api, args = endpoints(client)[endpoint]
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(api.create(model=MODEL, max_tokens=6, temperature=0, stream=True, stream_options=options, **args))
    *with_choices, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6
    prompt = last.usage.prompt_tokens
    seen = [c.usage.completion_tokens for c in with_choices]
    assert all(
        c.usage.prompt_tokens == prompt and c.usage.total_tokens == prompt + n for c, n in zip(with_choices, seen)
    )
    assert seen == sorted(seen) and seen[-1] == 6
    if endpoint == "chat":
        assert seen[0] == 0  # the role chunk, before any token
    # Without include_usage it asks for nothing, as in vLLM.
    options = {"continuous_usage_stats": True}
    chunks = list(api.create(model=MODEL, max_tokens=2, stream=True, stream_options=options, **args))
    assert all(c.usage is None for c in chunks)
