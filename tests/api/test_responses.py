"""POST /v1/responses on the session server through the real `openai` client's `responses`
methods: text out, events streamed (the client's own stream accumulator puts them back
together), `instructions`, `previous_response_id`, `text.format`, function tools and the
tool-result turn, the bounded store, and the 400s/404s.

Oracles: the same conversation sent to /v1/chat/completions and /tokenize (the prompt the
engine sees must be the same), the unstreamed response for the streamed one (greedy), and
the schemas (jsonschema).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.api.conftest import MODEL

GREEDY = {"temperature": 0.0}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}
SHIRT = {
    "type": "object",
    "properties": {"size": {"type": "string", "enum": ["S", "M", "L"]}, "cotton": {"type": "boolean"}},
    "required": ["size", "cotton"],
}


def prompt_tokens(server, messages: list[dict], **fields) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages, **fields}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_text_in_text_out_as_chat_would_answer(client, server):
    out = client.responses.create(
        model=MODEL, input="Name a color.", instructions="Be brief.", max_output_tokens=8, **GREEDY
    )
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens == prompt_tokens(server, messages)
    assert out.usage.output_tokens == chat.usage.completion_tokens
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if out.status == "incomplete":
        assert out.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_add_up_to_the_response(client):
    held = {"structured_outputs": {"regex": "The sea is (blue|grey|green) and (deep|wide)\\."}}
    kw = dict(model=MODEL, input="Tell me about the sea.", max_output_tokens=30, extra_body=held, **GREEDY)
    whole = client.responses.create(**kw)
    assert whole.status == "completed" and whole.output_text.startswith("The sea is")
    with client.responses.stream(**kw) as stream:  # the client's accumulator checks the event order
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added")
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.done")


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client):
    events = list(
        client.responses.create(model=MODEL, input="Tell me about the sea.", max_output_tokens=3, stream=True)
    )
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens" and last.response.usage.output_tokens == 3


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=6, **GREEDY)
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=6, **GREEDY
    )
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage.input_tokens == prompt_tokens(server, messages)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text

    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope", max_output_tokens=1)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_text_format_json_schema_holds_the_output(client):
    fmt = {"type": "json_schema", "name": "shirt", "schema": SHIRT, "strict": True}
    out = client.responses.create(model=MODEL, input="A shirt, as JSON.", text={"format": fmt}, max_output_tokens=40)
    jsonschema.validate(json.loads(out.output_text), SHIRT)
    assert out.text.format.type == "json_schema"


def test_a_function_tool_loop(client, server):
    """Turn 1 must call the tool (required: a grammar holds the call to its schema); turn 2
    sends its output back as a function_call_output item after the call."""
    first = client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=40,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": "18 C"} for c in calls]
    second = client.responses.create(
        model=MODEL,
        input=results,
        previous_response_id=first.id,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=5,
    )
    assert [item.type for item in second.output] == ["message"]

    # The same turn, carried by hand (no previous_response_id): the same prompt.
    by_hand = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Weather in Paris?"}, *[c.model_dump() for c in calls], *results],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=1,
    )
    assert by_hand.usage.input_tokens == second.usage.input_tokens


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"tool_choice": "auto", "tools": [WEATHER]}, "tool_choice"),  # no --enable-auto-tool-choice here
    ],
)
def test_what_this_server_cannot_do_is_a_400_naming_it(client, fields, param):
    kw = {"input": "Hi", "max_output_tokens": 1, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **kw)
    assert e.value.body["param"] == param
