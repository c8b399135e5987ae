"""Prompt lookup's index against a brute-force oracle: for each n from the longest down,
every earlier window of the sequence compared with its suffix, the latest match winning."""

import numpy as np
import pytest

from jaxserve.spec_decode.ngram import NgramIndex, propose_ngram


def lookup_by_brute_force(tokens: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + num_tokens]
    return []


def test_the_docstring_example():
    the, cat, sat, on, mat, dot = range(6)
    tokens = [the, cat, sat, on, the, mat, dot, the, cat, sat]
    assert propose_ngram(tokens, 3, 1, 3) == [on, the, mat]


@pytest.mark.parametrize("vocab", [2, 5, 50])
@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_an_index_fed_step_by_step_proposes_what_the_oracle_does(vocab, min_n, max_n):
    rng = np.random.default_rng(vocab * 10 + max_n)
    tokens = rng.integers(0, vocab, size=40).tolist()  # a prompt (indexed in one go)...
    index = NgramIndex(key_length=min(min_n, 2))
    index.extend(tokens)
    for _ in range(60):  # ...then decode steps of 1 to 4 tokens (a token and accepted drafts)
        assert index.propose(4, min_n, max_n) == lookup_by_brute_force(tokens, 4, min_n, max_n)
        new = rng.integers(0, vocab, size=int(rng.integers(1, 5))).tolist()
        tokens += new
        index.extend(new)
        assert len(index) == len(tokens)


@pytest.mark.parametrize("min_n", [1, 2])
@pytest.mark.parametrize("length", [0, 1, 2, 3])
def test_sequences_too_short_to_match(length, min_n):
    tokens = [7] * length
    assert propose_ngram(tokens, 2, min_n, 3) == lookup_by_brute_force(tokens, 2, min_n, 3)


@pytest.mark.parametrize("key_length", [1, 2])
def test_a_prompt_of_many_distinct_tokens_is_indexed_like_one_fed_token_by_token(key_length):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300, size=2000).tolist()
    whole, fed = NgramIndex(key_length), NgramIndex(key_length)
    whole.extend(tokens)
    for token in tokens:
        fed.extend([token])
    assert whole.positions.keys() == fed.positions.keys()
    for token, positions in whole.positions.items():
        np.testing.assert_array_equal(positions.values, fed.positions[token].values)
    assert whole.propose(5, key_length, 4) == lookup_by_brute_force(tokens, 5, key_length, 4)


def test_token_ids_past_16_bits_keep_their_bigrams_apart():
    big = 2**31 - 1
    tokens = [big, 1, 5, 1, big, 1, 9, 0, 1]  # the suffix bigram (0, 1) never occurred before
    assert propose_ngram(tokens, 2, 2, 3) == lookup_by_brute_force(tokens, 2, 2, 3) == []
    assert propose_ngram([*tokens, 5], 2, 2, 3) == lookup_by_brute_force([*tokens, 5], 2, 2, 3) == [1, big]


def test_the_proposer_feeds_each_request_only_its_new_tokens_and_forgets_the_gone():
    from jaxserve.spec_decode.config import SpeculativeConfig
    from jaxserve.spec_decode.proposers import NgramProposer
    from scheduler import Request, SamplingParams

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
    proposer = NgramProposer(config)
    rng = np.random.default_rng(1)
    requests = [Request(str(i), rng.integers(0, 6, 30).tolist(), SamplingParams(max_tokens=1000)) for i in range(3)]
    for step in range(40):
        for req in requests:
            req.num_computed_tokens = req.num_tokens - 1  # decoding: one token to compute
        running = requests if step < 20 else requests[1:]  # request 0 finishes at step 20
        proposer.propose(running)
        for req in running:
            assert req.spec_token_ids == lookup_by_brute_force(req.all_token_ids, 3, 2, 4)
            assert len(proposer.indexes[req.request_id]) == len(req.all_token_ids)
        assert proposer.indexes.keys() == {r.request_id for r in running}
        for req in running:  # the step's sampled token and up to 2 accepted drafts arrive
            for token in rng.integers(0, 6, int(rng.integers(1, 4))).tolist():
                req.num_pending += 1
                req.append_output(token)
