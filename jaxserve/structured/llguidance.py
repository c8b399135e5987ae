"""The grammar engine behind one small interface; llguidance implements it.

A backend compiles a spec once (`compile`, thread-safe, run in the compile pool) and
makes a matcher per sequence from the result (`new_matcher`, cheap). A matcher follows
one sequence's output tokens and fills its packed bitmask of allowed next tokens (bit j of
word i: token 32 * i + j, over the tokenizer's vocabulary).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import numpy as np

from jaxserve.structured.errors import GrammarError
from scheduler.sampling_params import StructuredOutputsParams


class Matcher(Protocol):
    def accept_tokens(self, token_ids: list[int]) -> bool: ...  # False: a token the grammar forbids
    def num_valid_prefix(self, token_ids: list[int]) -> int: ...  # how many it would accept; no change
    def fill_bitmask(self, row: np.ndarray) -> None: ...  # int32 [bitmask_words]
    def rollback(self, num_tokens: int) -> None: ...
    def is_terminated(self) -> bool: ...  # the grammar is complete: nothing but EOS may follow
    def is_error(self) -> bool: ...  # the matcher failed (a forbidden token, an engine limit)
    def error(self) -> str: ...


class GrammarBackend(Protocol):
    bitmask_words: int  # int32 words of a matcher's mask (the tokenizer's vocabulary, packed)

    def compile(self, spec: StructuredOutputsParams) -> Any: ...  # raises GrammarError
    def new_matcher(self, compiled: Any) -> Matcher: ...


# Compact JSON (no free whitespace): outputs stay short, and a model cannot pad forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

# llguidance's parser holds at most 2,000 items in a row (its `max_items_in_row`); a choice
# list puts one item per choice, and one for the start rule, in its first row. A longer list
# compiles but fails at the first token, so it is refused at compile time, with this number.
MAX_CHOICES = 1999

# The keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = (
    "additionalProperties",
    "items",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def without_additional_properties(schema: Any, *, closed: bool = True) -> Any:
    """`schema` with `additionalProperties: false` in every object schema (one with
    `properties` or `patternProperties`) that does not say otherwise, as vLLM's xgrammar
    reads it. A copy: the caller's schema (also the compile cache's key) is left alone. Only
    schema keywords are walked, so an `enum`, `const` or `default` value stays as given.
    The members of an `allOf` stay open (`closed=False`), what is inside them is closed:
    each member closed would refuse the keys the others list."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for name in _SUBSCHEMA:
        if isinstance(out.get(name), dict):
            out[name] = without_additional_properties(out[name])
    for name in _SUBSCHEMA_LISTS:
        if isinstance(out.get(name), list):
            out[name] = [without_additional_properties(s, closed=name != "allOf") for s in out[name]]
    for name in _SUBSCHEMA_MAPS:
        if isinstance(out.get(name), dict):
            out[name] = {key: without_additional_properties(s) for key, s in out[name].items()}
    if closed and ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def llguidance_grammar(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a spec. A grammar may be Lark (llguidance's dialect) or
    GBNF (llama.cpp's EBNF, `root ::= ...`, as vLLM's xgrammar users write it)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(kind, f"the schema is not JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(kind, f"a schema is an object, got {type(schema).__name__}")
        if spec.disable_additional_properties:
            schema = without_additional_properties(schema)
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(kind, str(e)) from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        if len(spec.choice) > MAX_CHOICES:
            raise GrammarError(kind, f"at most {MAX_CHOICES} choices are supported, got {len(spec.choice)}")
        # Lark string literals (JSON's escapes), so no choice is read as a pattern.
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        )
    try:
        lark = any_to_lark(spec.grammar)
    except Exception as e:  # the converter raises plain Exceptions too (a rule not found)
        raise GrammarError(kind, f"neither Lark (a `start:` rule) nor GBNF (`root ::= ...`): {e}") from None
    return LLMatcher.grammar_from_lark(lark)


class LLGuidanceBackend:
    """llguidance (no torch needed): masks computed in Rust, the GIL released meanwhile."""

    def __init__(self, hf_tokenizer, eos_token_ids: tuple[int, ...], model_vocab_size: int):
        import llguidance.hf

        self.eos_token_ids = frozenset(eos_token_ids)
        # A model's vocab may be padded past the tokenizer's: llguidance's vocab covers
        # both, so the padding ids are simply never allowed.
        n_vocab = max(model_vocab_size, len(hf_tokenizer))
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=n_vocab, eos_token=list(eos_token_ids) or None
        )
        self.bitmask_words = (self.tokenizer.vocab_size + 31) // 32

    def compile(self, spec: StructuredOutputsParams):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, llguidance_grammar(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(spec.kind, error_of(matcher))
        # The first mask here, in the pool: llguidance builds its lexer lazily, so some
        # errors show only now, and the copies reuse what it built.
        # And the first token: the parser builds its first row only then, so a row too long
        # to hold (a grammar of thousands of alternatives) shows there, not while generating.
        probe = matcher.deep_copy()
        mask = np.frombuffer(probe.compute_bitmask(), np.uint8)
        allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little"))
        first = next((int(t) for t in allowed if t not in self.eos_token_ids), None)
        if first is not None:
            probe.consume_tokens([first])
        if probe.is_error():
            raise GrammarError(spec.kind, error_of(probe))
        return matcher  # the prototype: each sequence gets a copy in its start state

    def new_matcher(self, compiled) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy())


class LLGuidanceMatcher:
    def __init__(self, matcher):
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return self.matcher.consume_tokens(list(token_ids))

    def num_valid_prefix(self, token_ids: list[int]) -> int:
        return self.matcher.validate_tokens(list(token_ids))

    def fill_bitmask(self, row: np.ndarray) -> None:
        assert row.dtype == np.int32 and row.flags["C_CONTIGUOUS"]
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def is_error(self) -> bool:
        return self.matcher.is_error()

    def error(self) -> str:
        return error_of(self.matcher)


def error_of(matcher) -> str:
    """An llguidance matcher's error message, without the dump of its state that follows it."""
    return matcher.get_error().split("\n<state>")[0].strip()
