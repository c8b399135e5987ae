"""logit_bias, allowed_token_ids and bad_words: the sampler against NumPy statements of
their definitions (vLLM's), and the engine against the same requests without them.

Oracles: the bias added exactly (and before the penalties); draws over the allowed ids
following the renormalized softmax (chi-square); a heavily biased token always chosen;
an unconstrained greedy output that holds a word, and the same request with that word
banned, which never does and agrees with it up to where the word would end; free requests
batched with constrained ones giving the tokens they give alone.
"""

import jax
import numpy as np
import pytest
from scipy import stats

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.sample.sampler import adjust_logits, sample
from jaxserve.spec_decode.proposers import decoding
from scheduler import SamplingParams
from scheduler.step_batch import TokenBias, banned_by_bad_words, token_bias_matrix
from tests.sampling_oracle import meta, softmax

V = 12
VOCAB = 97  # tests/tiny_models.py
PROMPT = [5, 17, 33, 8, 61, 40, 12, 90, 3]

sample_jit = jax.jit(sample)


def with_bias(m, bias, history_width=4):
    """`m` in the token-bias variant: `bias` [S, V], no history (penalties off)."""
    rows = bias.shape[0]
    m.token_bias = np.asarray(bias, np.float32)
    m.history, m.history_lens, m.prompt_lens = (
        np.zeros((rows, history_width), np.int32),
        np.zeros(rows, np.int32),
        np.zeros(rows, np.int32),
    )
    return m


# -- host side: the rows' bias ---------------------------------------------------------


def test_bad_words_ban_the_last_token_after_the_rest_of_the_word():
    words = [(7,), (3, 4), (3, 4, 5), (9, 9)]
    assert banned_by_bad_words(words, []) == [7]  # only one-token words before any output
    assert banned_by_bad_words(words, [1, 3]) == [7, 4]
    assert banned_by_bad_words(words, [3, 4]) == [7, 5]
    assert banned_by_bad_words(words, [9]) == [7, 9]
    assert banned_by_bad_words(words, [4, 3, 9, 1]) == [7]


def test_token_bias_matrix_is_bias_then_allowed_then_banned():
    params = SamplingParams(logit_bias={"2": 5.0, 3: -1.5, 4: 100}, allowed_token_ids=[2, 3, 6], bad_words=["x"])
    params = params.with_bad_words_tokenized(lambda text: [6])
    rows = [None, TokenBias.for_row(params, []), TokenBias.for_row(SamplingParams(logit_bias={1: 0.5}), [])]
    got = token_bias_matrix(rows, 4, V)
    want = np.zeros((4, V), np.float32)
    want[1] = -np.inf
    want[1, 2], want[1, 3] = 5.0, -1.5  # 4 is biased but not allowed; 6 is allowed but a bad word
    want[2, 1] = 0.5
    np.testing.assert_array_equal(got, want)


# -- the sampler -----------------------------------------------------------------------


def test_bias_is_added_exactly_before_the_penalties():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (3, V)).astype(np.float32)
    bias = rng.uniform(-100, 100, (3, V)).astype(np.float32)
    got = np.asarray(adjust_logits(logits, with_bias(meta(3), bias)))
    np.testing.assert_array_equal(got, logits + bias)
    # Repetition penalty on a seen token, after the bias: (z + b) / 2 when z + b > 0.
    z = np.full((1, V), -0.5, np.float32)
    b = np.zeros((1, V), np.float32)
    b[0, 4] = 1.0
    m = with_bias(meta(1, repetition_penalty=2.0), b)
    m.history[0, 0], m.history_lens[0] = 4, 1
    assert np.asarray(adjust_logits(z, m))[0, 4] == 0.25  # penalty first would give -1 + 1 = 0


def test_greedy_takes_the_biased_argmax_and_logprobs_stay_raw():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (4, V)).astype(np.float32)
    bias = np.zeros((4, V), np.float32)
    bias[0, 3] = 100.0
    bias[1] = -np.inf
    bias[1, [5, 7]] = 0  # allowed ids
    out = sample_jit(logits, with_bias(meta(4, temperature=0.0, want_logprobs=True), bias))
    want = np.argmax(logits + bias, axis=-1)
    np.testing.assert_array_equal(np.asarray(out.token_ids), want)
    assert want[0] == 3 and want[1] in (5, 7)
    raw = np.log(softmax(logits.astype(np.float64)))
    np.testing.assert_allclose(np.asarray(out.logprobs), raw[np.arange(4), want], atol=1e-5)


def test_draws_over_allowed_ids_follow_the_renormalized_softmax():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1.5, V).astype(np.float32)
    allowed = [0, 3, 4, 8, 11]
    row = TokenBias.for_row(SamplingParams(allowed_token_ids=allowed, logit_bias={3: 1.0, 8: -0.7}), [])
    n = 4000  # one row per draw, each with its own seed
    bias = token_bias_matrix([row] * n, n, V)
    out = sample_jit(np.tile(logits, (n, 1)), with_bias(meta(n, temperature=0.8, top_k=4), bias))
    counts = np.bincount(np.asarray(out.token_ids), minlength=V)
    assert set(np.flatnonzero(counts)) <= set(allowed)
    z = (logits.astype(np.float64) + bias[0]) / 0.8
    z = np.where(z >= np.sort(z)[-4], z, -np.inf)  # top-k 4 among the allowed
    want = softmax(z)
    kept = want > 0
    assert counts[~kept].sum() == 0
    assert stats.chisquare(counts[kept], want[kept] * n).pvalue > 0.001


# -- the engine --------------------------------------------------------------------------


def make_engine(loaded, **kw):
    cfg = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=4,
        num_blocks=256,
        max_model_len=128,
        token_buckets=(4, 16, 64),
    )
    return LLMEngine(loaded, EngineConfig(**{**cfg, **kw}))


def generate(eng, requests):
    """requests: [(prompt, SamplingParams)] all at once; each one's token ids, in order."""
    for i, (prompt, params) in enumerate(requests):
        eng.add_request(str(i), prompt, params)
    outs = {o.request_id: o for o in eng.generate_all()}
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.config.num_blocks - 1, "blocks leaked"
    return [outs[str(i)].outputs[0].token_ids for i in range(len(requests))]


@pytest.fixture(scope="module")
def eng(tiny_llama_tok):
    return make_engine(tiny_llama_tok)


def greedy(max_tokens=12, **fields):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **fields)


def contains(tokens, word):
    return any(list(tokens[i : i + len(word)]) == list(word) for i in range(len(tokens) - len(word) + 1))


def test_a_large_bias_makes_greedy_emit_the_token(eng):
    (free,) = generate(eng, [(PROMPT, greedy())])
    x = next(t for t in range(3, VOCAB) if t not in free)
    (biased,) = generate(eng, [(PROMPT, greedy(logit_bias={str(x): 100}))])
    assert biased == [x] * 12
    (held_back,) = generate(eng, [(PROMPT, greedy(logit_bias={free[0]: -100}))])
    assert held_back[0] != free[0]


def test_sampled_tokens_stay_in_allowed_token_ids(eng):
    allowed = [4, 9, 23, 50, 77]
    outs = generate(
        eng,
        [
            (PROMPT, SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed))
            for s in range(6)
        ],
    )
    assert all(set(out) <= set(allowed) for out in outs)
    assert len({t for out in outs for t in out}) > 1  # really sampled, not one forced token


def test_bad_words_never_appear_and_change_nothing_before(eng):
    tok = eng.tokenizer
    (free,) = generate(eng, [(PROMPT, greedy(max_tokens=16))])
    # A two-token word from the middle of the free output, and a one-token word from it.
    pair, single = free[4:6], free[9]
    word = tok.decode(pair)
    assert tok.encode(word, add_special_tokens=False) == pair
    (banned,) = generate(eng, [(PROMPT, greedy(max_tokens=16, bad_words=[word]))])
    assert contains(free, pair) and not contains(banned, pair)
    first = next(i for i in range(len(free) - 1) if free[i : i + 2] == pair)
    assert banned[: first + 1] == free[: first + 1] and banned[first + 1] != pair[1]
    (no_single,) = generate(eng, [(PROMPT, greedy(max_tokens=16, bad_words=[tok.decode([single])]))])
    assert single not in no_single and no_single[: free.index(single)] == free[: free.index(single)]


def test_free_requests_batched_with_constrained_ones_are_unchanged(eng):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, rng.integers(2, 20)).tolist() for _ in range(6)]
    free = [greedy(max_tokens=10), SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)] * 3
    alone = [generate(eng, [(p, sp)])[0] for p, sp in zip(prompts, free)]
    word = eng.tokenizer.decode([alone[0][3]])
    constrained = [
        greedy(logit_bias={10: 50.0}),
        greedy(allowed_token_ids=[6, 7, 8]),
        greedy(bad_words=[word]),
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, logit_bias={"11": -5}, repetition_penalty=1.3
        ),
    ]
    compiles = eng.compilations
    outs = generate(eng, [(p, sp) for p, sp in zip(prompts, free)] + [(prompts[0], sp) for sp in constrained])
    assert outs[: len(free)] == alone
    assert set(outs[len(free) + 1]) <= {6, 7, 8} and alone[0][3] not in outs[len(free) + 2]
    assert eng.compilations == compiles, "the token-bias variant must be compiled by warm-up"


def test_out_of_vocabulary_ids_are_refused(eng):
    for fields, name in [
        (dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[3, VOCAB + 5]), "allowed_token_ids"),
    ]:
        with pytest.raises(ValueError, match=f"^{name} must"):
            eng.add_request("bad", PROMPT, greedy(**fields))
    assert not eng.has_unfinished()


class FreeProposer:
    """Drafts the unconstrained greedy continuation (`free`): just what a constrained
    request must refuse at the word's end, or where a bias turns it elsewhere."""

    overlaps = False  # drafts for every step: the serial loop

    def __init__(self, config, free: list[int]):
        self.config, self.free, self.proposed = config, free, 0

    def propose(self, running):
        for req in decoding(running, self.config):
            done = req.num_output_tokens
            room = req.sampling_params.max_tokens - done - 1
            req.spec_token_ids = list(self.free[done : done + min(self.config.num_speculative_tokens, room)])
            self.proposed += len(req.spec_token_ids)

    def draft_probs(self, batch):
        return None

    def follow(self, batch, handle):
        pass


def test_speculative_decoding_keeps_the_constraints(tiny_llama_tok, eng):
    """Verifying drafts applies the same bias to the target (bad words also counting the
    drafts before each position): outputs equal those without speculation."""
    spec = make_engine(
        tiny_llama_tok,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        token_buckets=(4, 16),
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    )
    (free,) = generate(eng, [(PROMPT, greedy(max_tokens=16))])
    spec.proposer = proposer = FreeProposer(spec.config.speculative_config, free)
    words = [eng.tokenizer.decode(free[2:4]), eng.tokenizer.decode(free[8:10])]
    requests = [
        (PROMPT, greedy(max_tokens=16, bad_words=words)),
        (PROMPT, greedy(max_tokens=16, logit_bias={free[5]: -100, 30: 4.0})),
        (PROMPT, greedy(max_tokens=16, allowed_token_ids=sorted(set(free[1:])))),
    ]
    assert generate(spec, requests) == [generate(eng, [r])[0] for r in requests]
    # Sampled, the tokens differ from a run without drafts (other draws), but not the rule.
    sampled = [
        (PROMPT, SamplingParams(temperature=0.5, seed=s, max_tokens=16, ignore_eos=True, bad_words=words))
        for s in range(4)
    ]
    assert not any(contains(out, free[2:4]) or contains(out, free[8:10]) for out in generate(spec, sampled))
    assert proposer.proposed > 0
