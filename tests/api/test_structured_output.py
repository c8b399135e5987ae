"""Structured output through the real `openai` client, on the session server (default model):
response_format (json_object, json_schema, the client's `parse`), vLLM's structured_outputs
and guided_* fields, and a named tool_choice, streamed and not, greedy and sampled.

Oracles: `jsonschema` for every JSON output (and finish_reason "stop": the output is
complete, not cut by max_tokens); re.fullmatch for regexes, choices and grammars whose
languages are regular; the same text streamed and not, and from guided_json and
structured_outputs.json; the same language in Lark and GBNF giving the same greedy text;
and free requests run alone against the same requests batched with constrained ones.
Schemas bound their strings, integers and arrays (maxLength, maximum, maxItems) so that even
sampled output ends.
"""

from __future__ import annotations

import asyncio
import json
import math
import re

import jsonschema
import openai
import pydantic
import pytest

from tests.api.conftest import MODEL

MAX_TOKENS = 200  # generous: every schema below ends well within it

POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": -100, "maximum": 100},
        "y": {"type": "integer", "minimum": -100, "maximum": 100},
    },
    "required": ["x", "y"],
    "additionalProperties": False,
}
NAME = {"type": "string", "minLength": 1, "maxLength": 20}

SCHEMAS = {
    "nested": (
        "Describe a person and where they live as JSON.",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "address"],
            "properties": {
                "name": NAME,
                "address": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["city", "zip"],
                    "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                },
            },
        },
    ),
    "array": (
        "List a few colors as JSON.",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["colors"],
            "properties": {
                "colors": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4}
            },
        },
    ),
    "enum": (
        "Pick a T-shirt size and color as JSON.",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["size", "color"],
            "properties": {
                "size": {"enum": ["small", "medium", "large"]},
                "color": {"type": "string", "enum": ["red", "green", "blue"]},
            },
        },
    ),
    "bounds": (
        "Give an age and a score between 0 and 1 as JSON.",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["age", "score", "count"],
            "properties": {
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
                "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9},
            },
        },
    ),
    "optional": (
        "Describe a book as JSON.",
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["title"],
            "properties": {
                "title": NAME,
                "subtitle": NAME,
                "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            },
        },
    ),
    "refs": (
        "Give a line segment as JSON.",
        {
            "$defs": {"point": POINT},
            "type": "object",
            "additionalProperties": False,
            "required": ["start", "end"],
            "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        },
    ),
}
SAMPLED = {"temperature": 1.0, "seed": 1234}
GREEDY = {"temperature": 0.0}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def run(coroutine):
    return asyncio.run(coroutine)


async def chat_text(client: openai.AsyncOpenAI, stream: bool, **kw) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice, the streamed deltas joined."""
    if not stream:
        out = await client.chat.completions.create(model=MODEL, **kw)
        return [(c.message.content, c.finish_reason) for c in out.choices]
    texts, finish = {}, {}
    async for chunk in await client.chat.completions.create(model=MODEL, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    return [(texts[i], finish[i]) for i in sorted(texts)]


async def completion_text(client: openai.AsyncOpenAI, stream: bool, **kw) -> list[tuple[str, str]]:
    if not stream:
        out = await client.completions.create(model=MODEL, **kw)
        return [(c.text, c.finish_reason) for c in out.choices]
    texts, finish = {}, {}
    async for chunk in await client.completions.create(model=MODEL, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
    return [(texts[i], finish[i]) for i in sorted(texts)]


def schema_requests(schema_name: str):
    """Every way of asking for the schema: ((endpoint, greedy or sampled, streamed), coroutine
    factory) for chat's response_format and completions' guided_json (streamed:
    structured_outputs), greedy and sampled (one seed), streamed and not."""
    prompt, schema = SCHEMAS[schema_name]
    response_format = {"type": "json_schema", "json_schema": {"name": schema_name, "schema": schema, "strict": True}}
    for stream in (False, True):
        for how, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
            yield (
                ("chat", how, stream),
                lambda c, s=stream, kw=sampling: chat_text(
                    c, s, messages=user(prompt), max_tokens=MAX_TOKENS, response_format=response_format, **kw
                ),
            )
            body = {"structured_outputs": {"json": schema}} if stream else {"guided_json": schema}
            yield (
                ("completions", how, stream),
                lambda c, s=stream, kw=sampling, b=body: completion_text(
                    c, s, prompt=f"{prompt}\n", max_tokens=MAX_TOKENS, extra_body=b, **kw
                ),
            )


@pytest.fixture(scope="module")
def schema_outputs(server) -> dict[str, dict[tuple, tuple[str, str]]]:
    """All the schema requests at once (they batch): schema name -> {how: (text, finish_reason)}."""

    async def go():
        async with server.async_client() as client:
            jobs = [(name, how, make(client)) for name in SCHEMAS for how, make in schema_requests(name)]
            results = await asyncio.gather(*(job for _, _, job in jobs))
        out = {name: {} for name in SCHEMAS}
        for (name, how, _), [choice] in zip(jobs, results):
            out[name][how] = choice
        return out

    return run(go())


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_follows_its_json_schema(schema_outputs, name):
    schema = SCHEMAS[name][1]
    jsonschema.Draft202012Validator.check_schema(schema)
    outputs = schema_outputs[name]
    assert len(outputs) == 8
    for how, (text, finish) in outputs.items():
        assert finish == "stop", (how, text)
        jsonschema.validate(json.loads(text), schema)
    # Streaming changes nothing, nor does the field's name (guided_json, structured_outputs.json):
    # greedy is greedy, and a seed fixes the sample.
    for (endpoint, how, stream), (text, _) in outputs.items():
        assert text == outputs[endpoint, how, not stream][0], (endpoint, how)


def test_json_object_and_the_clients_parse(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=user("Describe a cat as JSON."),
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)

    class Person(pydantic.BaseModel):  # the client sends its JSON schema, strict, and parses the reply
        name: str = pydantic.Field(max_length=20)
        age: int = pydantic.Field(ge=0, le=120)

    parsed = client.chat.completions.parse(
        model=MODEL,
        messages=user("Describe a person as JSON."),
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=Person,
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)


PHONE, DATE = r"\d{3}-\d{4}", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
COLORS = ["red", "green", "blue", "light yellow"]
# One language in both grammar dialects: a pair of small numbers in parentheses.
LARK = 'start: "(" NUM "," NUM ")"\nNUM: /[0-9]{1,3}/'
GBNF = 'root ::= "(" num "," num ")"\nnum ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9]'
PAIR = r"\(\d{1,3},\d{1,3}\)"
# vLLM's documented example (GBNF, as its xgrammar backend takes it), and its language.
SQL = """root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
SQL_TEXT = r"SELECT col_[12]  from table_[12]  where col_[12] = [12] "


def test_regex_choice_and_grammar_outputs_match(server):
    cases = [  # (how the request asks, the full match its text must be)
        ({"structured_outputs": {"regex": PHONE}}, PHONE),
        ({"guided_regex": DATE}, DATE),
        ({"structured_outputs": {"choice": COLORS}}, "|".join(map(re.escape, COLORS))),
        ({"guided_choice": COLORS}, "|".join(map(re.escape, COLORS))),
        ({"structured_outputs": {"grammar": LARK}}, PAIR),
        ({"guided_grammar": GBNF}, PAIR),
        ({"structured_outputs": {"grammar": SQL}}, SQL_TEXT),
    ]

    async def go():
        jobs = []
        client = server.async_client()
        for body, _ in cases:
            for stream in (False, True):
                for sampling in (GREEDY, SAMPLED):
                    jobs.append(
                        completion_text(
                            client,
                            stream,
                            prompt="My phone number, birthday and favorite color:",
                            max_tokens=40,
                            extra_body=body,
                            **sampling,
                        )
                    )
                    jobs.append(
                        chat_text(
                            client,
                            stream,
                            messages=user("What is your favorite color?"),
                            max_tokens=40,
                            extra_body=body,
                            **sampling,
                        )
                    )
        async with client:
            return await asyncio.gather(*jobs)

    results = run(go())
    per_case = len(results) // len(cases)
    for i, (body, pattern) in enumerate(cases):
        for [(text, finish)] in results[i * per_case : (i + 1) * per_case]:
            assert re.fullmatch(pattern, text) and finish == "stop", (body, text, finish)
    # Greedy: the same language in Lark and GBNF gives the same text.
    lark, gbnf = results[4 * per_case], results[5 * per_case]
    assert lark == gbnf


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {
                "city": NAME,
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": NAME},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}


def test_a_named_tool_choice_returns_a_call_whose_arguments_follow_its_schema(client):
    kw = dict(
        model=MODEL,
        messages=user("What's the weather like in Paris this week?"),
        max_tokens=MAX_TOKENS,
        tools=[SEARCH, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    for sampling in (GREEDY, SAMPLED):
        out = client.chat.completions.create(**kw, **sampling, n=2)
        for choice in out.choices:
            message = choice.message
            assert message.content is None and choice.finish_reason == "stop"
            (call,) = message.tool_calls
            assert call.type == "function" and call.function.name == "get_weather" and call.id
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

        # Streamed: the first delta opens the call (id, name), the others carry its arguments.
        calls = {}
        for chunk in client.chat.completions.create(**kw, **sampling, n=2, stream=True):
            for c in chunk.choices:
                assert c.delta.content is None
                for delta in c.delta.tool_calls or ():
                    assert delta.index == 0
                    if c.index not in calls:
                        assert delta.id and delta.type == "function" and delta.function.name == "get_weather"
                        calls[c.index] = ""
                    calls[c.index] += delta.function.arguments or ""
        assert sorted(calls) == [0, 1]
        for arguments in calls.values():
            jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_n_samples_and_logprobs_with_a_schema(client):
    prompt, schema = SCHEMAS["enum"]
    response_format = {"type": "json_schema", "json_schema": {"name": "shirt", "schema": schema}}
    out = client.chat.completions.create(
        model=MODEL, messages=user(prompt), max_tokens=MAX_TOKENS, n=4, response_format=response_format, **SAMPLED
    )
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)

    out = client.chat.completions.create(
        model=MODEL,
        messages=user(prompt),
        max_tokens=MAX_TOKENS,
        logprobs=True,
        top_logprobs=3,
        response_format=response_format,
        **GREEDY,
    )
    choice = out.choices[0]
    jsonschema.validate(json.loads(choice.message.content), schema)
    entries = choice.logprobs.content
    assert len(entries) == out.usage.completion_tokens
    assert "".join(e.token for e in entries).startswith(choice.message.content)  # then EOS
    for entry in entries:  # the model's own logprobs (jaxserve.sample.sampler: before the grammar's mask)
        assert -math.inf < entry.logprob <= 0 and len(entry.top_logprobs) == 3

    out = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        logprobs=2,
        extra_body={"structured_outputs": {"json": schema}},
        **GREEDY,
    )
    choice = out.choices[0]
    jsonschema.validate(json.loads(choice.text), schema)
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == out.usage.completion_tokens


FREE_PROMPTS = ["The capital of France is", "Once upon a time, there was a", "The three primary colors are"]


def test_constrained_requests_do_not_change_free_ones_batched_with_them(server, client):
    free = dict(model=MODEL, max_tokens=24, temperature=0)
    alone = [client.completions.create(prompt=p, **free).choices[0].text for p in FREE_PROMPTS]

    async def go():
        c = server.async_client()
        constrained = [
            completion_text(
                c,
                stream,
                prompt=SCHEMAS[name][0],
                max_tokens=MAX_TOKENS,
                extra_body={"guided_json": SCHEMAS[name][1]},
                **SAMPLED,
            )
            for name in ("nested", "array", "refs")
            for stream in (False, True)
        ]
        constrained.append(
            completion_text(c, False, prompt="Phone:", max_tokens=20, extra_body={"guided_regex": PHONE})
        )
        free_jobs = [c.completions.create(prompt=p, **free) for p in FREE_PROMPTS]
        async with c:
            outs = await asyncio.gather(*constrained[:4], *free_jobs, *constrained[4:])
        return [o.choices[0].text for o in outs[4 : 4 + len(FREE_PROMPTS)]], outs[:4] + outs[4 + len(FREE_PROMPTS) :]

    batched, constrained = run(go())
    assert batched == alone
    assert all(finish == "stop" for [(_, finish)] in constrained)
    server.wait_idle()  # and every KV block is free again


BAD_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": {"type": "objekt"}}}
UNSUPPORTED = {"type": "json_schema", "json_schema": {"name": "thing", "schema": {"not": {"type": "string"}}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
BAD_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "minProperties": "two"}},
}


@pytest.mark.parametrize(
    "endpoint, body, param, says",
    [
        ("chat", {"response_format": BAD_SCHEMA_FORMAT}, "response_format", ["response_format 'thing'", "objekt"]),
        ("chat", {"response_format": UNSUPPORTED}, "response_format", ["does not support", '["not"]']),
        ("chat", {"response_format": {"type": "json_schema"}}, "response_format", ["needs a json_schema"]),
        ("chat", {"response_format": {"type": "xml"}}, "response_format.type", ["json_schema"]),
        ("completions", {"guided_json": "{not json"}, "guided_json", ["not JSON"]),
        (
            "completions",
            {"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}},
            "structured_outputs",
            ["structured_outputs.json", "minimum (5) is greater than maximum (1)"],
        ),
        ("completions", {"guided_regex": "[a-"}, "guided_regex", ["regular expression", "unclosed character class"]),
        ("completions", {"structured_outputs": {"regex": "(?<=a)b"}}, "structured_outputs", ["look-around"]),
        ("completions", {"guided_grammar": "start: foo"}, "guided_grammar", ["grammar", "foo"]),
        ("completions", {"guided_grammar": "root ::= foo"}, "guided_grammar", ["GBNF", "foo"]),
        ("completions", {"guided_grammar": "just words"}, "guided_grammar", ["neither Lark", "GBNF"]),
        ("completions", {"guided_choice": []}, "guided_choice", ["at least 1"]),
        (
            "completions",
            {"guided_regex": "a", "guided_choice": ["b"]},
            "guided_choice",
            ["only one", "guided_regex, guided_choice"],
        ),
        ("completions", {"structured_outputs": {}}, "structured_outputs", ["exactly one", "none"]),
        (
            "completions",
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            ["exactly one", "regex, choice"],
        ),
        ("completions", {"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", ["Extra inputs"]),
        (
            "chat",
            {"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "tool_choice",
            ["only one", "response_format, tool_choice"],
        ),
        ("chat", {"tools": [SEARCH], "tool_choice": NAMED}, "tool_choice", ["'get_weather'", "not among the tools"]),
        (
            "chat",
            {"tools": [BAD_TOOL], "tool_choice": NAMED},
            "tools[0].function.parameters",
            ["function 'get_weather'"],
        ),
    ],
)
def test_invalid_constraints_are_400s_that_say_what_is_wrong(client, endpoint, body, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=user("Hi"), max_tokens=4, extra_body=body)
        else:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=body)
    error = e.value.body
    assert error["param"] == param, error
    for words in says:
        assert words in error["message"], error


class Town(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=999)


def test_a_pydantic_schema_takes_no_other_keys_unless_the_request_allows_them(client):
    """Pydantic's schemas do not say additionalProperties: as vLLM's xgrammar, no other key is
    allowed, so the output is complete (not cut by max_tokens) and has exactly the model's
    keys; `structured_outputs.disable_additional_properties: false` lets other keys in."""
    schema = Town.model_json_schema()
    for options in ({}, {"disable_additional_properties": True}):
        out = client.completions.create(
            model=MODEL,
            prompt="A small town as JSON:",
            max_tokens=60,
            temperature=0,
            extra_body={"structured_outputs": {"json": schema, **options}},
        )
        text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert finish == "stop" and Town.model_validate_json(text, strict=True), text
        jsonschema.validate(json.loads(text), {**schema, "additionalProperties": False})
    lenient = client.completions.create(
        model=MODEL,
        prompt="A small town as JSON:",
        max_tokens=8,
        extra_body={"structured_outputs": {"json": schema, "disable_additional_properties": False}},
    )
    assert lenient.choices[0].text.startswith("{")


def test_a_choice_list_too_long_to_hold_is_a_400_and_the_server_goes_on(client):
    """The grammar engine holds at most 1999 choices: 50,000 were compiled, then ended
    "abort" at the first token; now they are a 400 naming the field, before generation."""
    many = [f"option-{i}" for i in range(50_000)]
    for body, param, field in [
        ({"structured_outputs": {"choice": many}}, "structured_outputs", "structured_outputs.choice"),
        ({"guided_choice": many}, "guided_choice", "guided_choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=8, extra_body=body)
        error = e.value.body
        assert error["param"] == param and field in error["message"], error
        assert "at most 1999 choices are supported, got 50000" in error["message"], error
    some = [f"option-{i}" for i in range(100)]
    for body in ({"guided_choice": some}, {"structured_outputs": {"choice": some}}):
        out = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=20, extra_body=body)
        assert out.choices[0].text in some and out.choices[0].finish_reason == "stop", out
