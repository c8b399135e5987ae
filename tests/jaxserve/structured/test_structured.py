"""Structured output in the engine: every output follows its grammar, and nothing else changes.

Oracles: `jsonschema`, `re.fullmatch` and the choice list for the outputs (the grammar
engine did not write them); numpy for the packed mask; and the same requests run without
the thing under test (alone instead of batched, a roomy cache instead of preemption, no
drafts instead of speculation) for token-for-token equality. The tiny random model, with a
byte-level tokenizer of one token per character, can spell any JSON, so its outputs
exercise the mask at every step: left alone it would never write valid JSON.
"""

import gc
import json
import re
import weakref

import jsonschema
import numpy as np
import pytest

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.sample.sampler import unpack_bitmask
from jaxserve.structured import GrammarError
from scheduler import SamplingParams, StructuredOutputsParams
from tests.jaxserve.spec_decode.test_spec_decode import OracleProposer
from tests.jaxserve.spec_decode.test_spec_decode_tree import SPEC as TREE_SPEC
from tests.jaxserve.spec_decode.test_spec_decode_tree import TreeOracleProposer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bc", "d"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "delta": {"type": "integer", "minimum": -50, "maximum": -10},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
POINTS = {
    "$defs": {
        "pt": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 9},
                "y": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "a": {"$ref": "#/$defs/pt"},
        "path": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 2},
    },
    "required": ["a", "path"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-\d{3}"
CHOICES = ["yes", "no", "maybe so"]
SPECS = [{"json": PERSON}, {"json": POINTS}, {"regex": REGEX}, {"choice": CHOICES}]


def follows(spec: dict, text: str) -> bool:
    """Whether `text` is in the language of `spec`, checked without the grammar engine."""
    if "json" in spec:
        try:
            jsonschema.validate(json.loads(text), spec["json"])
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if "regex" in spec:
        return re.fullmatch(spec["regex"], text) is not None
    return text in spec["choice"]


@pytest.fixture(scope="module")
def tiny_chars(tiny_llama_chars):
    return tiny_llama_chars


def engine(loaded, **kw):
    cfg = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=4,
        num_blocks=512,
        max_model_len=200,
        token_buckets=(8, 64),
    )  # few programs to compile
    return LLMEngine(loaded, EngineConfig(**{**cfg, **kw}))


def run(eng, prompts, params):
    """Every request at once; the outputs in prompt order (streamed deltas checked against them)."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    final, texts = {}, {}
    while eng.has_unfinished():
        for out in eng.step():
            for c in out.outputs:
                texts.setdefault((out.request_id, c.index), []).append(c.new_text)
            if out.finished:
                final[out.request_id] = out
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.config.num_blocks - 1, "blocks leaked"
    outs = [final[str(i)] for i in range(len(prompts))]
    for out in outs:
        for c in out.outputs:
            assert "".join(texts[(out.request_id, c.index)]) == c.text, "streamed deltas differ from the output"
    return outs


def workload(count=12, rng_seed=0, **overrides):
    rng = np.random.default_rng(rng_seed)
    prompts = [rng.integers(3, 97, rng.integers(2, 20)).tolist() for _ in range(count)]
    params = [
        SamplingParams(
            **{"temperature": 0, "max_tokens": 120, "structured_outputs": SPECS[i % len(SPECS)], **overrides}
        )
        for i in range(count)
    ]
    return prompts, params


def texts(outs):
    return [[c.text for c in o.outputs] for o in outs]


def test_unpack_bitmask_is_numpys_little_endian_bits():
    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, (3, 4), dtype=np.int64).astype(np.int32)
    vocab = 4 * 32 - 5  # the last word only partly used
    expected = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    np.testing.assert_array_equal(np.asarray(unpack_bitmask(words, vocab)), expected)


@pytest.mark.parametrize("temperature", [0, 1])
def test_every_output_follows_its_grammar(tiny_chars, temperature):
    prompts, params = workload(rng_seed=temperature, temperature=temperature, seed=7, n=2, logprobs=2)
    outs = run(engine(tiny_chars), prompts, params)
    for out, p in zip(outs, params):
        spec = {p.structured_outputs.kind: getattr(p.structured_outputs, p.structured_outputs.kind)}
        for c in out.outputs:
            assert c.finish_reason == "stop", (spec, c.text)
            assert follows(spec, c.text), (spec, c.text)
            assert len(c.logprobs) == len(c.token_ids)
    # Left alone (no grammar) the random model writes no JSON at all: the mask did the work.
    free = run(engine(tiny_chars), prompts, [SamplingParams(temperature=0, max_tokens=40)] * len(prompts))
    assert not any(follows(SPECS[i % len(SPECS)], o.outputs[0].text) for i, o in enumerate(free))


def test_a_lark_grammar_and_json_object(tiny_chars):
    grammar = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'
    prompts, _ = workload(count=4)
    params = [
        SamplingParams(temperature=1, seed=i, max_tokens=60, structured_outputs={"grammar": grammar}) for i in range(2)
    ]
    params += [
        SamplingParams(temperature=0, max_tokens=150, structured_outputs={"json_object": True}) for _ in range(2)
    ]
    outs = run(engine(tiny_chars), prompts, params)
    for out in outs[:2]:
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", out.outputs[0].text) or (
            out.outputs[0].finish_reason == "length"
        ), out.outputs[0].text
    for out in outs[2:]:
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(out.outputs[0].text), dict)


def test_free_and_constrained_requests_are_unchanged_by_each_other(tiny_chars):
    """A batch mixing constrained and free requests: each gives what it gives alone."""
    prompts, params = workload(count=8)
    params = [p if i % 2 else SamplingParams(temperature=0, max_tokens=30) for i, p in enumerate(params)]
    batched = run(engine(tiny_chars), prompts, params)
    alone = [run(engine(tiny_chars, max_num_seqs=1), [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert texts(batched) == texts(alone)


@pytest.mark.parametrize("setting", ["preempted", "chunked"])
def test_preemption_and_chunked_prefill_keep_the_grammar_in_step(tiny_chars, setting):
    prompts, params = workload()
    roomy = run(engine(tiny_chars), prompts, params)
    kw = {
        "preempted": dict(num_blocks=40),
        "chunked": dict(long_prefill_token_threshold=3, max_num_batched_tokens=16, token_buckets=(8, 16)),
    }[setting]
    eng = engine(tiny_chars, **kw)
    assert texts(run(eng, prompts, params)) == texts(roomy)
    if setting == "preempted":
        assert eng.scheduler.num_preemptions > 0


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_speculative_drafts_are_checked_against_the_grammar(tiny_chars, monkeypatch, shape):
    """Drafts that break the grammar are rejected and the matcher never keeps them: greedy
    output is token for token what it is without speculation, and the drafts the oracle
    corrupts (almost all of which the grammar forbids) cost exactly their own rejection."""
    prompts, params = workload()
    plain = run(engine(tiny_chars), prompts, params)
    truth = {tuple(p): o.outputs[0].token_ids + [2] for p, o in zip(prompts, plain)}  # then EOS
    if shape == "chain":
        oracle = OracleProposer(None, truth)
        spec = {"method": "ngram", "num_speculative_tokens": 4}
    else:
        oracle, spec = TreeOracleProposer(truth), TREE_SPEC

    def make_proposer(config, eng):
        oracle.config = config
        return oracle

    monkeypatch.setattr("jaxserve.engine.builder.make_proposer", make_proposer)
    eng = engine(tiny_chars, speculative_config=spec)
    assert texts(run(eng, prompts, params)) == texts(plain)
    stats = eng.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "the run must both accept and reject drafts"


def test_sampled_drafts_from_a_draft_model_keep_outputs_valid(tiny_chars):
    """Rejection sampling against the masked target: a draft the grammar forbids has target
    probability zero, so it is never accepted, whatever the draft model thought of it."""
    prompts, params = workload(temperature=1, seed=3)
    eng = engine(
        tiny_chars, speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1}
    )
    for out, p in zip(run(eng, prompts, params), params):
        spec = {p.structured_outputs.kind: getattr(p.structured_outputs, p.structured_outputs.kind)}
        assert out.outputs[0].finish_reason == "stop" and follows(spec, out.outputs[0].text), out.outputs[0].text
    assert eng.scheduler.spec_stats.num_draft_tokens > 0


def test_logprobs_are_over_what_the_grammar_allows(tiny_chars):
    """As vLLM: a forced token (one character the regex allows) has probability one, and a
    forbidden token is never among the top alternatives."""
    prompts, _ = workload(count=1)
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3, structured_outputs={"regex": "hello"})
    c = run(engine(tiny_chars), prompts, [params])[0].outputs[0]
    assert c.text == "hello" and len(c.logprobs) == len(c.token_ids)
    for token, entry in zip(c.token_ids[:5], c.logprobs):
        assert entry[token] == 0.0
        assert all(v == -np.inf for t, v in entry.items() if t != token)


def test_stop_strings_end_a_constrained_output(tiny_chars):
    prompts, _ = workload(count=2)
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs={"json": PERSON}, stop=['"age"'])] * 2
    for out in run(engine(tiny_chars), prompts, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == '"age"' and c.text.startswith('{"name":"')


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"json": {"type": "nonsense"}}, "Invalid type"),
        ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"json": {"$ref": "#/$defs/missing"}}, "does not exist"),
        ({"json": "{not json"}, "not JSON"),
        ({"regex": "[a-z"}, "unclosed character class"),
        ({"grammar": "start: foo"}, "unknown name"),
        ({"regex": "(a{1000}){1000}"}, "too many expressions"),  # its lexer outgrows the limits at the first token
    ],
)
def test_an_invalid_spec_is_refused_and_nothing_is_queued(tiny_chars, spec, message):
    eng = engine(tiny_chars, warm_up=False)
    with pytest.raises(GrammarError, match=message):
        eng.add_request("bad", [5, 6], SamplingParams(max_tokens=5, structured_outputs=spec))
    assert not eng.has_unfinished() and "bad" not in eng.outputs.groups


def test_a_gbnf_grammar_means_the_same_as_lark(tiny_chars):
    prompts, _ = workload(count=2)
    gbnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'
    out = [
        run(
            engine(tiny_chars),
            prompts,
            [SamplingParams(temperature=1, seed=i, max_tokens=60, structured_outputs={"grammar": g}) for i in range(2)],
        )
        for g in (gbnf, lark)
    ]
    assert texts(out[0]) == texts(out[1])


def test_a_grammar_the_engine_gives_up_on_ends_its_request(tiny_chars):
    """A regex whose lexer outgrows llguidance's limits after its first token (compiling tries
    only that one) fails on the way: the request ends ("abort") instead of going on
    unconstrained; others are unharmed."""
    prompts, params = workload(count=2)
    params[0] = SamplingParams(temperature=0, max_tokens=100, structured_outputs={"regex": "[ab](a{1000}){1000}"})
    outs = run(engine(tiny_chars), prompts, params)
    assert outs[0].outputs[0].finish_reason == "abort" and set(outs[0].outputs[0].text) <= {"a", "b"}
    assert follows(SPECS[1], outs[1].outputs[0].text)


def test_a_tokenizer_the_grammar_engine_cannot_read_is_a_clear_error(tiny_llama_tok):
    eng = LLMEngine(tiny_llama_tok, EngineConfig(max_num_seqs=2, num_blocks=64, block_size=4, warm_up=False))
    for _ in range(2):  # the second time too, from the remembered failure
        with pytest.raises(ValueError, match="a tokenizer the grammar engine can read"):
            eng.add_request("r", "the cat", SamplingParams(structured_outputs={"regex": "a"}))
    assert not eng.has_unfinished()


def test_a_dropped_engine_is_freed_at_once(tiny_chars):
    """No reference cycle through the grammar compiler: an engine (and its compiled
    programs, each holding memory maps) goes when its last reference does, not at some later
    full GC. A test session builds hundreds of engines; kept alive, their maps ran the process
    out of vm.max_map_count and XLA crashed."""
    eng = engine(tiny_chars, warm_up=False)
    run(eng, *workload(count=2))
    ref = weakref.ref(eng)
    gc.disable()
    try:
        del eng
        assert ref() is None
    finally:
        gc.enable()


def test_a_spec_compiles_once(tiny_chars):
    eng = engine(tiny_chars, warm_up=False)
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    same = {"properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "type": "object"}  # keys reordered
    first = eng.compile_grammar(StructuredOutputsParams(json=schema))
    assert eng.compile_grammar(StructuredOutputsParams(json=same)) is first
    bad = eng.compile_grammar(StructuredOutputsParams(regex="("))
    with pytest.raises(GrammarError):
        bad.result()
    assert eng.compile_grammar(StructuredOutputsParams(regex="(")) is bad  # refused again without recompiling


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "non-empty"),
        ({"json": 3}, "JSON schema"),
        ({"jsn": {}}, "unknown structured_outputs field"),
    ],
)
def test_structured_outputs_params_are_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=fields)
