"""Reasoning output, end to end: a real server on the default model with
`--reasoning-parser qwen3` (and the hermes tool-call parser of test_tools.py), through the
real `openai` client. SmolLM2 does not think by itself, so each test holds its output to a
thinking-then-answer text with a regex; the server must then split it, whole and streamed.
Oracle: the text the regex forced, and the unstreamed reply for the streamed one.
"""

from __future__ import annotations

import openai
import pytest

from tests.api.conftest import MODEL, SMALL_ENGINE, run_server
from tests.api.test_tools import ASK, CALL, TOOL_FLAGS, TOOLS, held_to, streamed

THINK = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){0,3}\n</think>\n\nThe answer is 4\."
QUESTION = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = [*TOOL_FLAGS, "--reasoning-parser", "qwen3"]
    with run_server(tmp_path_factory.mktemp("reasoning"), *SMALL_ENGINE, *flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_the_thinking_goes_to_reasoning_content_never_to_content(client):
    kw = dict(messages=QUESTION, max_tokens=60, temperature=0.0, extra_body=held_to(THINK))
    message = client.chat.completions.create(model=MODEL, **kw).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "think>" not in reasoning and message.model_extra["reasoning"] == reasoning
    assert message.content.strip() == "The answer is 4."

    chunks, reply = streamed(client, **kw)
    assert reply["reasoning"] == reasoning and reply["content"].strip() == "The answer is 4."
    for chunk in chunks:  # no content delta holds any of the thinking
        for choice in chunk.choices:
            assert "think>" not in (choice.delta.content or "")

    kw["extra_body"] = {**held_to(THINK), "include_reasoning": False}
    hidden = client.chat.completions.create(model=MODEL, **kw).choices[0].message
    assert "reasoning_content" not in (hidden.model_extra or {}) and hidden.content.strip() == "The answer is 4."


def test_a_reply_cut_before_the_end_of_its_thinking_is_all_reasoning(client):
    """As vLLM's qwen3 parser: no </think> (max_tokens ran out) means the model was still thinking."""
    kw = dict(messages=QUESTION, max_tokens=8, extra_body=held_to(r"<think>\n(well ){20}"))
    choice = client.chat.completions.create(model=MODEL, **kw).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"].strip().startswith("well")
    _, reply = streamed(client, **kw)
    assert reply["content"] == "" and reply["reasoning"] == choice.message.model_extra["reasoning_content"]


def test_with_thinking_off_the_whole_reply_is_content(client):
    kw = dict(
        messages=QUESTION,
        max_tokens=8,
        extra_body={**held_to("It is four"), "chat_template_kwargs": {"enable_thinking": False}},
    )
    message = client.chat.completions.create(model=MODEL, **kw).choices[0].message
    assert message.content == "It is four" and "reasoning_content" not in (message.model_extra or {})
    _, reply = streamed(client, **kw)
    assert reply["content"] == "It is four" and reply["reasoning"] == ""


def test_a_call_after_the_thinking_is_found(client):
    kw = dict(messages=ASK, tools=TOOLS, max_tokens=100, extra_body=held_to(r"<think>\nhm\n</think>\n\n" + CALL))
    choice = client.chat.completions.create(model=MODEL, **kw).choices[0]
    assert choice.message.model_extra["reasoning_content"].strip() == "hm"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert choice.finish_reason == "tool_calls"
    _, reply = streamed(client, **kw)
    assert reply["reasoning"].strip() == "hm" and [c["name"] for c in reply["calls"].values()] == ["get_weather"]


def test_responses_carry_the_thinking_as_a_reasoning_item(client):
    out = client.responses.create(model=MODEL, input="2+2?", max_output_tokens=60, extra_body=held_to(THINK))
    kinds = [item.type for item in out.output]
    assert kinds == ["reasoning", "message"]
    assert out.output[0].content[0].text.strip() and "think>" not in out.output[0].content[0].text
    assert out.output_text.strip() == "The answer is 4."
    with client.responses.stream(
        model=MODEL, input="2+2?", max_output_tokens=60, extra_body=held_to(THINK), temperature=0.0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert (
        "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == final.output[0].content[0].text
    )


def test_a_thinking_budget_needs_an_end_of_thinking_token(client):
    """SmolLM2's vocabulary has no `</think>` token, so nothing could be forced: a 400 naming
    the field (tests/jaxserve/structured/test_after_token.py runs the budget on a model that has one)."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=4, extra_body={"thinking_token_budget": 2}
        )
    assert e.value.body["param"] == "thinking_token_budget" and "--reasoning-parser" in e.value.body["message"]
