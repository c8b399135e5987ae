"""A grammar that starts after a token (`after_token_id`: a reasoning model's `</think>`):
free before it, the grammar alone after it, drafts across the boundary included.

Oracles: a matcher of the same grammar without `after_token_id` fed only the answer's
tokens, the regex's own alphabet read from the tokenizer (which tokens decode to a digit),
and, in the engine, the same request run without any constraint (the thinking must come
out token for token as the free run's) and `re.fullmatch` for the answer.
"""

import dataclasses
import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from jaxserve.structured import GrammarCompiler, RequestGrammar
from jaxserve.structured.llguidance import LLGuidanceBackend
from scheduler import SamplingParams, StructuredOutputsParams
from tests.jaxserve.structured.test_structured import engine, run
from tests.tiny_models import make_tiny_char_tokenizer

REGEX = "[0-9]{3}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """One token per character, and `</think>` one special token (id 97, past the tiny models' vocab)."""
    folder = tmp_path_factory.mktemp("think-chars")
    make_tiny_char_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": ["</think>"]})
    return tok


@pytest.fixture(scope="module")
def backend(tokenizer):
    return LLGuidanceBackend(tokenizer, (tokenizer.eos_token_id,), len(tokenizer))


@pytest.fixture(scope="module")
def end(tokenizer):
    return tokenizer.convert_tokens_to_ids("</think>")


def ids(tokenizer, text):
    out = tokenizer.encode(text, add_special_tokens=False)
    assert len(out) == len(text)
    return out


def grammar(backend, after_token_id=None) -> RequestGrammar:
    compiled = backend.compile(StructuredOutputsParams(regex=REGEX))
    return RequestGrammar(backend.new_matcher(compiled), backend.bitmask_words, after_token_id=after_token_id)


def mask(g: RequestGrammar, ahead=()) -> np.ndarray:
    row = np.zeros(g.bitmask_words, np.int32)
    g.fill_bitmask(row, ahead)
    return row


def allowed(row: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def grammar_alone_after(backend, tokens) -> np.ndarray:
    g = grammar(backend)
    for t in tokens:
        g.accept(t)
    return mask(g)


def test_before_the_token_everything_is_allowed_and_nothing_is_fed(backend, tokenizer, end):
    g = grammar(backend, after_token_id=end)
    everything = np.full(g.bitmask_words, -1, np.int32)
    np.testing.assert_array_equal(mask(g), everything)
    for t in ids(tokenizer, "Let me think: {x} ab"):  # all forbidden by the grammar
        g.accept(t)
        np.testing.assert_array_equal(mask(g), everything)
    assert not g.started and g.error is None
    g.accept(end)
    assert g.started
    # The end token was not fed: the grammar is at its start, where only a digit may come.
    digits = {t for t in range(len(tokenizer)) if tokenizer.decode([t]).isdigit() and len(tokenizer.decode([t])) == 1}
    assert len(digits) == 10
    assert allowed(mask(g), len(tokenizer)) == digits
    np.testing.assert_array_equal(mask(g), grammar_alone_after(backend, []))


def test_after_the_token_exactly_the_grammar_alone(backend, tokenizer, end):
    g = grammar(backend, after_token_id=end)
    for t in ids(tokenizer, "hmm 9 ") + [end] + ids(tokenizer, "12"):
        g.accept(t)
    np.testing.assert_array_equal(mask(g), grammar_alone_after(backend, ids(tokenizer, "12")))
    g.accept(ids(tokenizer, "3")[0])
    assert allowed(mask(g), len(tokenizer)) == {tokenizer.eos_token_id}  # complete: only EOS
    g.accept(end)  # a second </think> is the grammar's to judge (it only reaches here past EOS)
    assert g.matcher.is_terminated()


@pytest.mark.parametrize(
    "ahead_text, answer_drafts",
    [
        ("ab", None),  # drafts still in the thinking: every token
        ("ab|", ""),  # the drafts end the thinking: the grammar's start
        ("a|1", "1"),  # and run into the answer
        ("|12", "12"),
        ("|1x", "1x"),  # a draft the grammar forbids: the last valid state's mask
        ("|", ""),
        ("x|y|", "y|"),  # the first end token starts the grammar; a later one is the answer's
    ],
)
def test_drafts_across_the_token(backend, tokenizer, end, ahead_text, answer_drafts):
    as_ids = {c: (end if c == "|" else ids(tokenizer, c)[0]) for c in set(ahead_text)}
    ahead = [as_ids[c] for c in ahead_text]
    g = grammar(backend, after_token_id=end)
    g.accept(ids(tokenizer, "q")[0])
    row = mask(g, ahead)
    if answer_drafts is None:
        np.testing.assert_array_equal(row, np.full(g.bitmask_words, -1, np.int32))
    else:
        alone = grammar(backend)
        np.testing.assert_array_equal(row, mask(alone, [as_ids[c] for c in answer_drafts]))
    # Looking ahead changed nothing: the request is still thinking.
    assert not g.started
    np.testing.assert_array_equal(mask(g), np.full(g.bitmask_words, -1, np.int32))


def test_drafts_after_the_grammar_started(backend, tokenizer, end):
    g = grammar(backend, after_token_id=end)
    g.accept(end)
    ahead = ids(tokenizer, "4") + [end]  # the end token is no longer special
    np.testing.assert_array_equal(mask(g, ahead), mask(grammar(backend), ahead))
    np.testing.assert_array_equal(mask(g), grammar_alone_after(backend, []))


def test_params_compare_hash_and_compile_once(backend, end):
    plain = StructuredOutputsParams(regex=REGEX)
    after = StructuredOutputsParams(regex=REGEX, after_token_id=end)
    assert after == dataclasses.replace(plain, after_token_id=end) and after != plain
    assert hash(after) == hash(StructuredOutputsParams(regex=REGEX, after_token_id=end))
    assert len({plain, after, StructuredOutputsParams(regex=REGEX)}) == 2
    assert after.key() == plain.key()  # one grammar: compiled once
    compiler = GrammarCompiler(lambda: backend)
    assert compiler.compile(after) is compiler.compile(plain)
    assert not compiler.request_grammar(compiler.compile(after).result(), end).started
    assert compiler.request_grammar(compiler.compile(after).result()).started


@pytest.mark.parametrize("bad", [-1, True, 1.0, "5"])
def test_after_token_id_is_a_token_id(bad):
    with pytest.raises(ValueError, match="after_token_id must be a token id"):
        StructuredOutputsParams(regex=REGEX, after_token_id=bad)


def test_after_token_id_must_be_in_the_vocabulary():
    params = SamplingParams(structured_outputs={"regex": REGEX, "after_token_id": 97})
    params.check_token_ids(98)
    with pytest.raises(ValueError, match="after_token_id must name token ids below the vocabulary size 97"):
        params.check_token_ids(97)


def test_the_engine_constrains_only_the_answer(tiny_llama_chars):
    """The random model thinks freely (letters the regex forbids) until it happens to write
    the chosen end token; from there the answer follows the regex and ends."""
    prompts = [[5, 17, 33, 60, 8], [40, 41, 42], [70, 3, 12, 90, 11, 30]]
    free = run(engine(tiny_llama_chars), prompts, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 3)
    tokenizer = tiny_llama_chars.tokenizer
    # For each prompt, an end token the free run writes first at position >= 2 after a non-digit.
    cases = []
    for prompt, out in zip(prompts, free):
        tokens = out.outputs[0].token_ids
        for k in range(2, len(tokens)):
            if tokens[k] not in tokens[:k] and not tokenizer.decode(tokens[:k]).isdigit():
                cases.append((prompt, tokens, k))
                break
    assert cases, [o.outputs[0].text for o in free]
    params = [
        SamplingParams(temperature=0, max_tokens=60, structured_outputs={"regex": REGEX, "after_token_id": t[k]})
        for _, t, k in cases
    ]
    outs = run(engine(tiny_llama_chars), [p for p, _, _ in cases], params)
    for (_, tokens, k), out in zip(cases, outs):
        got = out.outputs[0]
        assert got.token_ids[: k + 1] == tokens[: k + 1], "the thinking is not constrained"
        thinking = tokenizer.decode(tokens[:k])
        assert re.fullmatch(REGEX, thinking) is None and not re.fullmatch("[0-9]*", thinking)
        answer = tokenizer.decode(got.token_ids[k + 1 :], skip_special_tokens=True)
        assert re.fullmatch(REGEX, answer), (thinking, answer)
        assert got.finish_reason == "stop"


# -- thinking_token_budget: the end of the thinking forced after so many tokens ----------


def budget_grammar(backend, end, budget, constrained=True) -> RequestGrammar:
    compiled = backend.compile(StructuredOutputsParams(regex=REGEX)) if constrained else None
    matcher = backend.new_matcher(compiled) if compiled is not None else None
    return RequestGrammar(matcher, backend.bitmask_words, after_token_id=end, thinking_budget=budget)


def test_the_budget_allows_everything_then_the_end_token_alone(backend, tokenizer, end):
    vocab = len(tokenizer)
    for constrained in (False, True):
        g = budget_grammar(backend, end, 3, constrained)
        for token in ids(tokenizer, "ab"):
            assert allowed(mask(g), vocab) == set(range(vocab))
            g.accept(token)
        assert allowed(mask(g), vocab) == set(range(vocab))  # the third token is still free
        assert allowed(mask(g, ahead=ids(tokenizer, "c")), vocab) == {end}  # a draft spends the budget too
        g.accept(ids(tokenizer, "c")[0])
        assert allowed(mask(g), vocab) == {end}
        g.accept(end)
        after = allowed(mask(g), vocab)
        want = allowed(grammar_alone_after(backend, []), vocab) if constrained else set(range(vocab))
        assert after == want


def test_a_budget_of_zero_ends_the_thinking_at_once(backend, tokenizer, end):
    assert allowed(mask(budget_grammar(backend, end, 0, constrained=False)), len(tokenizer)) == {end}


def test_the_budget_needs_its_end_token():
    with pytest.raises(ValueError, match="thinking_token_budget needs thinking_end_token_id"):
        SamplingParams(thinking_token_budget=4)
    with pytest.raises(ValueError, match="thinking_token_budget must be an integer >= 0"):
        SamplingParams(thinking_token_budget=-1, thinking_end_token_id=3)
    with pytest.raises(ValueError, match="thinking_end_token_id must name token ids below"):
        SamplingParams(thinking_token_budget=1, thinking_end_token_id=97).check_token_ids(97)


def test_the_engine_ends_the_thinking_at_the_budget(tiny_llama_chars):
    """The thinking runs as the free run does for `budget` tokens, then the end token comes
    whether the model would have written it or not; after it the answer is free, or follows
    the regex when there is one."""
    prompts = [[5, 17, 33, 60, 8], [40, 41, 42]]
    budget = 4
    free = run(engine(tiny_llama_chars), prompts, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2)
    ends = []
    for out in free:  # an end token the free run does not write within the budget (a forced end)
        tokens = out.outputs[0].token_ids
        ends.append(next(t for t in range(3, 97) if t not in tokens[: budget + 1]))
    for regex in (None, REGEX):
        params = [
            SamplingParams(
                temperature=0,
                max_tokens=20,
                ignore_eos=regex is None,
                thinking_token_budget=budget,
                thinking_end_token_id=end,
                structured_outputs={"regex": regex, "after_token_id": end} if regex else None,
            )
            for end in ends
        ]
        outs = run(engine(tiny_llama_chars), prompts, params)
        for free_out, out, end in zip(free, outs, ends):
            got = out.outputs[0].token_ids
            assert got[:budget] == free_out.outputs[0].token_ids[:budget]
            assert got[budget] == end
            if regex is not None:
                answer = tiny_llama_chars.tokenizer.decode(got[budget + 1 :], skip_special_tokens=True)
                assert re.fullmatch(REGEX, answer), answer
