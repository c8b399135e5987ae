"""The served OpenAPI document states what the server really does (fast: a scripted engine).
Its bounds are checked against SamplingParams itself: the bound is accepted, one step past
it refused. test_fuzz.py then holds a live server to the whole document."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.server import create_app
from scheduler import SamplingParams
from tests.api.test_engine_loop import ScriptedEngine

VOCAB, MAX_MODEL_LEN = 100, 64  # ScriptedEngine's


def served_schema(api_key=None) -> dict:
    with TestClient(create_app(ScriptedEngine(), api_key=api_key)) as http:
        response = http.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


@pytest.fixture(scope="module")
def schema() -> dict:
    return served_schema(api_key="k")


def number_schema(field: dict) -> dict:
    """The non-null member of `X | None`."""
    members = [m for m in field.get("anyOf", [field]) if m.get("type") != "null"]
    assert len(members) == 1, field
    return members[0]


# API field -> SamplingParams field, for the fields whose range SamplingParams checks.
SAMPLED = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "n": "n",
    "min_tokens": "min_tokens",
    "max_tokens": "max_tokens",
    "logprobs": "logprobs",
    "top_logprobs": "logprobs",
    "max_completion_tokens": "max_tokens",
}


def accepts(field: str, value) -> bool:
    extra = {"max_tokens": 10**12} if field == "min_tokens" else {}  # min_tokens <= max_tokens: not a range
    try:
        SamplingParams(**{field: value}, **extra)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("body", ["CompletionRequest", "ChatCompletionRequest"])
def test_schema_bounds_are_sampling_params_bounds(schema, body):
    properties = schema["components"]["schemas"][body]["properties"]
    checked = 0
    for api_name, name in SAMPLED.items():
        if api_name not in properties or (body == "ChatCompletionRequest" and api_name == "logprobs"):
            continue  # chat's logprobs is a bool; its count is top_logprobs
        spec = number_schema(properties[api_name])
        step = 1 if spec["type"] == "integer" else 1e-9
        if spec["type"] == "integer":  # FastAPI writes integer bounds as 1.0
            spec = {k: int(v) if k.endswith("imum") else v for k, v in spec.items()}
        assert {"minimum", "exclusiveMinimum"} & set(spec), f"{api_name} states no lower bound"
        if "minimum" in spec:
            assert accepts(name, spec["minimum"]) and not accepts(name, spec["minimum"] - step), api_name
        if "exclusiveMinimum" in spec:
            assert not accepts(name, spec["exclusiveMinimum"]) and accepts(name, spec["exclusiveMinimum"] + step)
        if spec.get("x-output-tokens"):  # the context's bound, not SamplingParams': a prompt has >= 1 token
            assert spec["maximum"] == MAX_MODEL_LEN - 1, api_name
        elif "maximum" in spec and api_name != "n":  # n's 128 is the API's own cap
            assert accepts(name, spec["maximum"]) and not accepts(name, spec["maximum"] + step), api_name
        elif api_name != "n":
            assert accepts(name, 10**9), f"{api_name}: SamplingParams has an upper bound the schema does not state"
        checked += 1
    assert checked >= 11


@pytest.mark.parametrize("body", ["CompletionRequest", "ChatCompletionRequest"])
def test_the_seed_range_is_vllms_in_exact_integers(schema, body):
    """FastAPI's own document would round 2**63 - 1 to a float, 2**63, which the server refuses."""
    spec = number_schema(schema["components"]["schemas"][body]["properties"]["seed"])
    assert (spec["minimum"], spec["maximum"]) == (-(2**63), 2**63 - 1)
    assert type(spec["minimum"]) is type(spec["maximum"]) is int


def test_schema_has_only_json_schema_keywords_and_the_vocabulary_bound(schema):
    token_ids = []

    def walk(node):
        if isinstance(node, dict):
            assert not {"ge", "gt", "le", "lt"} & set(node), node  # pydantic's names, not JSON Schema's
            if node.get("x-token-id"):
                token_ids.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    # prompt ids, lists of prompt ids, stop_token_ids and allowed_token_ids (of both endpoints), /detokenize's tokens
    assert len(token_ids) == 7
    assert all(t["minimum"] == 0 and t["maximum"] == VOCAB - 1 for t in token_ids)


@pytest.mark.parametrize("body", ["CompletionRequest", "ChatCompletionRequest"])
def test_logit_bias_keys_are_the_vocabulary(schema, body):
    import re

    (member,) = [
        m
        for m in schema["components"]["schemas"][body]["properties"]["logit_bias"]["anyOf"]
        if m.get("type") == "object"
    ]
    assert member["additionalProperties"] is False
    ((pattern, values),) = member["patternProperties"].items()
    assert [k for k in map(str, range(3 * VOCAB)) if re.search(pattern, k)] == [str(i) for i in range(VOCAB)]
    assert not any(re.search(pattern, k) for k in ("", "01", "-1", "1.0", "x"))
    assert (values["minimum"], values["maximum"]) == (-100, 100)
    assert accepts("logit_bias", {VOCAB - 1: 100}) and not accepts("logit_bias", {1: 100.5})


def test_responses_are_documented(schema):
    paths = schema["paths"]
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "503"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "itemSchema" in responses["200"]["content"]["text/event-stream"]
        for status in ("400", "401", "404", "413", "503"):
            assert responses[status]["content"]["application/json"]["schema"] == error
        assert "Retry-After" in responses["503"]["headers"]
    assert set(paths["/health"]["get"]["responses"]) == {"200", "503"}
    assert "content" not in paths["/health"]["get"]["responses"]["200"]  # an empty body
    metrics = paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain; version=0.0.4; charset=utf-8"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]  # this server answers 400, not 422
    for path, item in paths.items():
        for operation in item.values():
            assert "422" not in operation["responses"]
            assert (operation.get("security") == [{"bearer": []}]) == path.startswith("/v1"), path


def test_without_an_api_key_nothing_asks_for_one():
    schema = served_schema(api_key=None)
    assert "securitySchemes" not in schema["components"]
    for item in schema["paths"].values():
        for operation in item.values():
            assert "security" not in operation and "401" not in operation["responses"]
