"""vLLM's request fields around the prompt, on the session server through the real `openai`
client (`extra_body` for vLLM's): add_generation_prompt, continue_final_message,
truncate_prompt_tokens, the `x-ignored-fields` header for unknown fields, and the 400s for
fields the server cannot honour (tool_choice "auto" without --enable-auto-tool-choice, functions, beam search,
structural tags, ...). What it does honour of structured output: test_structured_output.py.

Oracles: transformers' tokenizer and chat template (read from the same GGUF), and the same
request sent with the prompt's token ids cut by hand.
"""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.api.conftest import MODEL

QUESTION = [{"role": "user", "content": "Name a color."}]
PARTIAL = [*QUESTION, {"role": "assistant", "content": "My favorite color is"}]
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."


def tokenize(server, body: dict) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def template_ids(tokenizer, messages, **kw) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])


def test_continue_final_message_leaves_the_last_message_open(server, client, tokenizer):
    want = template_ids(tokenizer, PARTIAL, continue_final_message=True)
    assert tokenizer.decode(want).endswith("My favorite color is")  # no end-of-turn after it
    assert tokenize(server, {"messages": PARTIAL, "continue_final_message": True}) == want
    assert (
        tokenize(server, {"messages": PARTIAL, "continue_final_message": True, "add_generation_prompt": False}) == want
    )
    usage = client.chat.completions.create(
        model=MODEL, messages=PARTIAL, max_tokens=1, extra_body={"continue_final_message": True}
    ).usage
    assert usage.prompt_tokens == len(want)


def test_add_generation_prompt(server, client, tokenizer):
    for add in (True, False):
        want = template_ids(tokenizer, QUESTION, add_generation_prompt=add)
        assert tokenize(server, {"messages": QUESTION, "add_generation_prompt": add}) == want
        usage = client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=1, extra_body={"add_generation_prompt": add}
        ).usage
        assert usage.prompt_tokens == len(want)
    assert len(template_ids(tokenizer, QUESTION, add_generation_prompt=True)) > len(
        template_ids(tokenizer, QUESTION, add_generation_prompt=False)
    )


def test_continue_final_message_with_add_generation_prompt_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL,
            messages=PARTIAL,
            max_tokens=1,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )
    assert e.value.body["param"] == "continue_final_message"


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tokenizer):
    greedy = dict(model=MODEL, max_tokens=6, temperature=0)
    ids = tokenizer(TEXT).input_ids
    cut = client.completions.create(prompt=TEXT, extra_body={"truncate_prompt_tokens": 5}, **greedy)
    by_hand = client.completions.create(prompt=ids[-5:], **greedy)
    assert cut.usage.prompt_tokens == by_hand.usage.prompt_tokens == 5
    assert cut.choices[0].text == by_hand.choices[0].text
    # -1: the context length, which this prompt fits whole.
    whole = client.completions.create(prompt=TEXT, extra_body={"truncate_prompt_tokens": -1}, **greedy)
    assert whole.usage.prompt_tokens == len(ids)

    messages = [{"role": "user", "content": TEXT}]
    chat = client.chat.completions.create(messages=messages, extra_body={"truncate_prompt_tokens": 7}, **greedy)
    by_hand = client.completions.create(
        prompt=template_ids(tokenizer, messages, add_generation_prompt=True)[-7:], **greedy
    )
    assert chat.usage.prompt_tokens == 7
    assert chat.choices[0].message.content == by_hand.choices[0].text


def test_truncate_prompt_tokens_out_of_range_is_a_400(client):
    max_model_len = client.models.list().data[0].model_extra["max_model_len"]
    for value in (0, -2, max_model_len + 1):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(
                model=MODEL, prompt=TEXT, max_tokens=1, extra_body={"truncate_prompt_tokens": value}
            )
        assert "truncate_prompt_tokens" in (e.value.body["param"] or e.value.body["message"]), value


def test_unknown_fields_are_named_in_a_header_and_logged_once(server, client):
    names = sorted(f"unknown_{uuid.uuid4().hex[:8]}" for _ in range(2))  # unseen by this server before
    extra = dict.fromkeys(names, 1)
    header = ", ".join(names)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body=extra)
    assert raw.headers["x-ignored-fields"] == header
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, max_tokens=1, stream=True, extra_body=extra
    )
    assert raw.headers["x-ignored-fields"] == header
    assert any(chunk.choices for chunk in raw.parse())
    # An error after the body was read carries it too.
    r = httpx.post(
        f"{server.url}/v1/completions",
        headers=server.headers,
        timeout=60,
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 10**6, **extra},
    )
    assert r.status_code == 400 and r.headers["x-ignored-fields"] == header
    plain = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert "x-ignored-fields" not in plain.headers
    log = server.log.read_text()
    assert [log.count(repr(name)) for name in names] == [1, 1]  # three requests, one log line each name


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": TOOLS}, "tool_choice"),  # "auto" (the default with tools) needs --enable-auto-tool-choice
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "[a-z]+", "whitespace_pattern": " "}}, "structured_outputs"),
    ],
)
def test_fields_the_server_cannot_honour_are_400s_naming_them(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, extra_body=fields)
    assert e.value.body["param"] == param


def test_the_sdks_tool_call_message_goes_back_in_the_next_turn(client):
    """The assistant message the SDK hands back (content null, tool_calls) and a tool
    message render through the default model's own template (which reads every content)."""
    color = {"type": "object", "properties": {"name": {"enum": ["red", "blue"]}}, "required": ["name"]}
    tools = [{"type": "function", "function": {"name": "paint", "parameters": color}}]
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=30, tools=tools, tool_choice="required", parallel_tool_calls=False
    ).choices[0]
    assert first.message.content is None and first.message.tool_calls and first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    turn = [*QUESTION, first.message, {"role": "tool", "tool_call_id": call.id, "content": "blue"}]
    second = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=2, tools=tools, tool_choice="none")
    assert second.choices[0].message.tool_calls is None and second.usage.completion_tokens >= 1


def test_tools_with_tool_choice_none_go_to_the_template_and_the_reply_is_text(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "field, value, harmless",
    [
        ("use_beam_search", True, False),
        ("length_penalty", 0.5, 1.0),
        ("return_tokens_as_token_ids", True, False),
        ("logits_processors", ["my.module:Processor"], None),
        ("guided_decoding_backend", "xgrammar", None),
        ("guided_whitespace_pattern", "[ ]*", None),
        ("structural_tag", "{}", None),
    ],
)
def test_vllm_fields_that_would_change_the_output_are_400s_on_both_endpoints(client, field, value, harmless):
    """vLLM honours these; dropping them would answer with different text, so each is a 400
    naming it, while its harmless value (vLLM's default) is accepted."""
    for create, args in (
        (client.chat.completions.create, {"messages": QUESTION}),
        (client.completions.create, {"prompt": "Hi"}),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, max_tokens=1, extra_body={field: value}, **args)
        assert e.value.body["param"] == field
        assert create(model=MODEL, max_tokens=1, extra_body={field: harmless}, **args).usage.completion_tokens == 1


def test_echo_in_chat_is_refused_and_response_format_text_is_free_text(client):
    """vLLM's chat `echo` would change the output, so it is a 400; response_format
    {"type": "text"} (OpenAI's default) asks for nothing, on both endpoints."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, extra_body={"echo": True})
    assert e.value.body["param"] == "echo"
    plain = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=1, extra_body={"response_format": {"type": "text"}}
    )
    assert plain.usage.completion_tokens == 1
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=1, response_format={"type": "text"}
    )
    assert chat.usage.completion_tokens == 1
