"""The grammar backend alone (no model, no engine): which texts a compiled spec accepts, and
which specs are refused at compile time rather than failing while a request generates.

Oracles: hand-written texts fed through a matcher one character (one token) at a time, with
the byte-level tokenizer of one token per character, so the number of tokens a matcher
accepts is the length of the longest prefix it allows.
"""

import json

import pydantic
import pytest
from transformers import AutoTokenizer

from jaxserve.structured import GrammarError
from jaxserve.structured.llguidance import MAX_CHOICES, LLGuidanceBackend, without_additional_properties
from scheduler import StructuredOutputsParams
from tests.tiny_models import BASE, make_tiny_char_tokenizer


class City(pydantic.BaseModel):
    name: str
    population: int


class Country(pydantic.BaseModel):
    name: str
    capital: City


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    folder = tmp_path_factory.mktemp("char-tokenizer")
    make_tiny_char_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    backend = LLGuidanceBackend(tokenizer, (tokenizer.eos_token_id,), BASE["vocab_size"])
    backend.hf_tokenizer = tokenizer
    return backend


def accepted(backend, spec: StructuredOutputsParams, text: str) -> tuple[int, bool]:
    """How many characters of `text` the spec's grammar allows, and whether it is then complete."""
    matcher = backend.new_matcher(backend.compile(spec))
    tokens = backend.hf_tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) == len(text)
    valid = matcher.num_valid_prefix(tokens)
    matcher.accept_tokens(tokens[:valid])
    return valid, matcher.is_terminated()


@pytest.mark.parametrize(
    "model, text, valid_prefix",
    [
        (City, '{"name":"Oslo","population":7,"mayor":"x"}', '{"name":"Oslo","population":7'),
        # An extra key in a nested object (pydantic puts City in $defs) is refused too.
        (
            Country,
            '{"name":"Norway","capital":{"name":"Oslo","population":7,"x":1}}',
            '{"name":"Norway","capital":{"name":"Oslo","population":7',
        ),
    ],
)
def test_an_object_schema_without_additional_properties_takes_only_its_keys(backend, model, text, valid_prefix):
    """vLLM's xgrammar reads a schema that does not say additionalProperties (pydantic's never
    do) as allowing no other key; `disable_additional_properties=False` keeps JSON Schema's
    default."""
    schema = model.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema)
    strict = StructuredOutputsParams(json=schema)
    assert strict.disable_additional_properties
    assert accepted(backend, strict, text) == (len(valid_prefix), False)
    as_text = StructuredOutputsParams(json=json.dumps(schema))  # a schema given as its JSON text: the same
    assert accepted(backend, as_text, text) == (len(valid_prefix), False)
    lenient = StructuredOutputsParams(json=schema, disable_additional_properties=False)
    assert accepted(backend, lenient, text) == (len(text), True)


def test_an_explicit_additional_properties_is_kept(backend):
    text = '{"name":"Oslo","mayor":"x"}'
    for extra in (True, {"type": "string"}):
        schema = {"type": "object", "properties": {"name": {"type": "string"}}, "additionalProperties": extra}
        assert accepted(backend, StructuredOutputsParams(json=schema), text) == (len(text), True)
    schema["additionalProperties"] = {"type": "integer"}
    assert accepted(backend, StructuredOutputsParams(json=schema), text)[0] == len('{"name":"Oslo","mayor":')


def test_without_additional_properties_rewrites_only_object_schemas():
    schema = {
        "type": "object",
        # A property named like a keyword is a property, not a keyword.
        "properties": {"properties": {"type": "object", "properties": {"a": {}}}, "additionalProperties": {}},
        "anyOf": [{"properties": {"b": {}}}, {"type": "object"}],
        "allOf": [{"properties": {"e": {"properties": {}}}}, {"properties": {"f": {}}}],
        "items": [{"patternProperties": {"^x": {}}}],
        "$defs": {"d": {"properties": {}, "additionalProperties": True}},
        "enum": [{"properties": {"c": 1}}],
        "default": {"properties": {}},
    }
    before = json.dumps(schema)
    out = without_additional_properties(schema)
    assert json.dumps(schema) == before, "the caller's schema changed"
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["additionalProperties"] == {}  # the property's schema, untouched
    assert set(out["properties"]) == {"properties", "additionalProperties"}
    assert out["anyOf"] == [{"properties": {"b": {}}, "additionalProperties": False}, {"type": "object"}]
    assert out["items"][0]["additionalProperties"] is False
    # allOf's members stay open (each closed would refuse the others' keys); inside them, closed.
    assert out["allOf"] == [
        {"properties": {"e": {"properties": {}, "additionalProperties": False}}},
        {"properties": {"f": {}}},
    ]
    assert out["$defs"]["d"]["additionalProperties"] is True
    assert out["enum"] == schema["enum"] and out["default"] == schema["default"]


def test_the_switch_is_part_of_the_compile_cache_key():
    schema = City.model_json_schema()
    assert (
        StructuredOutputsParams(json=schema).key()
        != StructuredOutputsParams(json=schema, disable_additional_properties=False).key()
    )
    with pytest.raises(ValueError, match="disable_additional_properties must be a bool"):
        StructuredOutputsParams(json=schema, disable_additional_properties="no")


def test_a_choice_list_the_parser_cannot_hold_is_refused_at_compile_time(backend):
    """llguidance's parser row holds MAX_CHOICES + 1 items: a longer choice list compiled, then
    failed at its first token (the request ended "abort"); now it is refused with the limit."""
    choices = [f"option-{i}" for i in range(MAX_CHOICES)]
    assert accepted(backend, StructuredOutputsParams(choice=choices), choices[-1]) == (len(choices[-1]), True)
    for count in (MAX_CHOICES + 1, 50_000):
        with pytest.raises(GrammarError, match=f"at most {MAX_CHOICES} choices are supported, got {count}"):
            backend.compile(StructuredOutputsParams(choice=[f"option-{i}" for i in range(count)]))


def test_a_grammar_whose_first_row_is_too_long_is_refused_at_compile_time(backend):
    """The same limit in a Lark grammar: the first token is tried at compile time, where the
    parser builds that row."""
    lark = "start: " + " | ".join(json.dumps(f"option-{i}") for i in range(MAX_CHOICES + 1))
    with pytest.raises(GrammarError, match="max is 2000") as e:
        backend.compile(StructuredOutputsParams(grammar=lark))
    assert e.value.kind == "grammar"
