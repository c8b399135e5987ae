"""Tool calling, end to end: a real server on the default model with
`--enable-auto-tool-choice --tool-call-parser hermes` and a Hermes-style chat template,
driven by the real `openai` client and two agent frameworks (openai-agents, pydantic-ai)
as their users run them.

SmolLM2 does not call tools by itself, so where a test needs a call in the text it holds
the output to one with a regex (`structured_outputs`): the server's parsers must then find
it, whole and streamed. Oracles: the tools' JSON schemas (jsonschema), transformers'
apply_chat_template on the same messages, and the unstreamed reply for the streamed one.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest

from tests.api.conftest import MODEL, SMALL_ENGINE, run_server

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools_template.jinja"
TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", str(TEMPLATE)]
CITIES = ["Paris", "Rome"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": CITIES}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}, "24h": {"type": "boolean"}},
            "required": ["zone", "24h"],
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("tools"), *SMALL_ENGINE, *TOOL_FLAGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def held_to(regex: str) -> dict:
    return {"structured_outputs": {"regex": regex}}


def streamed(client, **kw) -> tuple[list, dict]:
    """The chunks of a streamed call, and its reply put back together: content, reasoning,
    calls (by index: id, name, arguments joined) and finish_reason."""
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for piece in delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": "", "pieces": 0})
                if piece.id is not None:
                    assert call["id"] is None, "a call's id comes once, in its first delta"
                    call["id"] = piece.id
                if piece.function.name is not None:
                    assert call["name"] is None and call["arguments"] == "", "the name comes first, once"
                    call["name"] = piece.function.name
                call["arguments"] += piece.function.arguments or ""
                call["pieces"] += 1
            finish = choice.finish_reason or finish
    return chunks, {"content": content, "reasoning": reasoning, "calls": calls, "finish_reason": finish}


def test_a_call_in_the_text_becomes_tool_calls_whole_and_streamed(client):
    kw = dict(messages=ASK, tools=TOOLS, max_tokens=60, extra_body=held_to(CALL))
    out = client.chat.completions.create(model=MODEL, **kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in CITIES

    _, reply = streamed(client, **kw)
    assert reply["finish_reason"] == "tool_calls" and reply["content"] == ""
    (call,) = reply["calls"].values()
    assert call["name"] == "get_weather" and call["id"].startswith("chatcmpl-tool-")
    assert json.loads(call["arguments"])["city"] in CITIES


def test_text_before_a_call_stays_content_and_parallel_tool_calls_false_keeps_one(client):
    two = rf"Let me look\.\n{CALL}\n{CALL}"
    kw = dict(messages=ASK, tools=TOOLS, max_tokens=120, extra_body=held_to(two))
    message = client.chat.completions.create(model=MODEL, **kw).choices[0].message
    assert message.content.strip() == "Let me look."
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_weather"]
    assert len({c.id for c in message.tool_calls}) == 2

    _, reply = streamed(client, **kw)
    assert reply["content"].strip() == "Let me look."
    assert [c["name"] for c in reply["calls"].values()] == ["get_weather", "get_weather"]

    one = client.chat.completions.create(model=MODEL, parallel_tool_calls=False, **kw).choices[0]
    assert len(one.message.tool_calls) == 1 and one.finish_reason == "tool_calls"
    _, reply = streamed(client, parallel_tool_calls=False, **kw)
    assert list(reply["calls"]) == [0]


def test_auto_with_no_call_in_the_text_is_content(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, extra_body=held_to("It is sunny today")
    )
    choice = out.choices[0]
    assert choice.message.content == "It is sunny today" and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def validate_call(name: str, arguments: str) -> None:
    (tool,) = [t for t in TOOLS if t["function"]["name"] == name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def test_required_always_yields_schema_valid_calls(client):
    """No parser is involved: a grammar holds the output to the tools' schemas, so every
    sample is a valid call, whatever the model would have written."""
    kw = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0.0)
    # Sampled, one call each (a grammar with no end to the array could run to max_tokens).
    out = client.chat.completions.create(
        model=MODEL, n=4, **{**kw, "temperature": 1.0, "max_tokens": 60}, parallel_tool_calls=False
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            validate_call(call.function.name, call.function.arguments)
    _, reply = streamed(client, **kw)
    assert reply["finish_reason"] == "tool_calls" and reply["calls"]
    for call in reply["calls"].values():
        validate_call(call["name"], call["arguments"])


def test_tool_choice_needs_tools(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required", max_tokens=1)
    assert e.value.body["param"] == "tool_choice" and "tools" in e.value.body["message"]


def test_a_two_turn_tool_loop_as_the_sdk_hands_messages_back(client, server, tokenizer):
    """Turn 1 calls a tool; the SDK's assistant message (content null, tool_calls) and a
    tool message go back in turn 2, which the template renders exactly as transformers does."""
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=40, parallel_tool_calls=False
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    conversation = [*ASK, message, {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    second = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=[WEATHER], tool_choice="none", max_tokens=5
    )
    assert second.choices[0].message.tool_calls is None and second.usage.completion_tokens >= 1

    plain = [*ASK, message.model_dump(exclude_none=True), conversation[-1]]
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": plain, "tools": [WEATHER]}, timeout=60)
    assert r.status_code == 200, r.text
    # transformers' documented form: a call's arguments as an object.
    oracle = json.loads(json.dumps(plain))
    oracle[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    want = tokenizer.apply_chat_template(
        oracle, tools=[WEATHER], chat_template=TEMPLATE.read_text(), add_generation_prompt=True, tokenize=False
    )
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in want and call.function.name in want
    assert r.json()["tokens"] == tokenizer.encode(want, add_special_tokens=False)
    assert second.usage.prompt_tokens == len(r.json()["tokens"])


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_an_openai_agents_tool_loop(server, api, streamed):
    """openai-agents as its users run it: the first turn must call the tool (a named
    tool_choice), the SDK runs it and, its tool_choice reset to "auto", asks again with the
    result; SmolLM2 then answers in text. Over both of the SDK's model classes, whole
    (Runner.run) and streamed (Runner.run_streamed, the SDK reading our stream events)."""
    import agents

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"18 C and sunny in {city}"

    async def loop():
        client = server.async_client()
        model_class = agents.OpenAIChatCompletionsModel if api == "chat_completions" else agents.OpenAIResponsesModel
        settings = agents.ModelSettings(tool_choice="get_weather", max_tokens=120, temperature=0.0)
        agent = agents.Agent(
            name="weather",
            tools=[get_weather],
            model=model_class(model=MODEL, openai_client=client),
            model_settings=settings,
        )
        question = "What is the weather in Paris?"
        if not streamed:
            return await agents.Runner.run(agent, question, max_turns=4)
        result = agents.Runner.run_streamed(agent, question, max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(loop())
    assert len(calls) == 1 and isinstance(calls[0], str)  # called once, with the argument its schema asks
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


def test_a_pydantic_ai_agent_with_structured_output(server):
    """pydantic-ai's default structured output is a tool the model must call
    (tool_choice "required"): the grammar makes the call valid, so the agent gets its object."""
    import pydantic_ai
    from pydantic import BaseModel
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Shirt(BaseModel):
        size: Literal["S", "M", "L"]
        cotton: bool

    provider = OpenAIProvider(openai_client=server.async_client())
    agent = pydantic_ai.Agent(
        OpenAIChatModel(MODEL, provider=provider),
        output_type=Shirt,
        model_settings={"max_tokens": 40, "parallel_tool_calls": False},
    )
    result = agent.run_sync("Describe a shirt.")
    assert isinstance(result.output, Shirt)
