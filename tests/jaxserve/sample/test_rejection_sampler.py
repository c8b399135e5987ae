"""Speculative decoding's acceptance rule (`jaxserve.sample.rejection_sampler.verify`)
against math it does not implement.

The main test simulates generation: a synthetic target model (a second-order Markov chain
over a few tokens, given as logit tables) and a draft model that disagrees with it (zero
mass where the target has some, and the other way round). Many independent streams are
verified at once, each with its own seed; a stream that has not yet produced three tokens
goes through another verify step. The joint counts of the first tokens are compared with
a chi-square test to the target's own distribution, computed in NumPy from the tables
(tests/sampling_oracle.py; penalties, banned tokens, temperature and top-k applied by
their documented definitions).
A deliberately wrong acceptance rule must fail the same test.

The others compare with NumPy statements of the rules: greedy acceptance, rows without
drafts drawing what `sampler.sample` draws, logprobs of the raw model output, and banned
tokens never emitted where they are banned.

Layout (scheduler.batch_builder.build_verify_sampling): row r * (K + 1) + j of the logits
and the metadata is request r's draft position j, sampling output token `output_index + j`;
positions past a request's drafts repeat its last one.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.sample.rejection_sampler import verify
from jaxserve.sample.sampler import MAX_LOGPROBS, SamplingMetadata, sample
from tests.sampling_oracle import (
    DRAFT,
    IGNORED_POSITION,
    LENGTH,
    PROMPT,
    SETTINGS,
    STOP,
    TARGET,
    Fit,
    Setting,
    V,
    draw,
    goodness_of_fit,
    log_softmax,
    meta,
    penalized,
    seed_words,
    softmax,
    table_rows,
)

verify_jit = jax.jit(verify)
sample_jit = jax.jit(sample)


metadata = meta  # `rows` sampling rows: temperature 1, no filters, no penalties, seeds 0..rows-1


# --------------------------------------------------------------------------------------
# The distribution of generated tokens
# --------------------------------------------------------------------------------------

K = 2
NUM_STREAMS = 30_000


def generate(setting: Setting, drafts: str, told: str, verify_fn=verify_jit, seed: int = 0) -> np.ndarray:
    """LENGTH tokens for each of NUM_STREAMS streams, by repeated verify steps. `drafts`:
    'model' (drawn from the draft model's q) or 'fixed' (a deterministic rule, as n-gram
    drafts are); `told`: what verify is told the drafts were drawn from, 'q', 'nothing'
    (point masses) or 'uniform' (a lie). [NUM_STREAMS, LENGTH]"""
    rng = np.random.default_rng(seed)
    n = NUM_STREAMS
    rows = np.arange(n)
    width = LENGTH + 2 * K + 1
    tokens = np.zeros((n, width), np.int64)  # emitted tokens, then this step's drafts
    count = np.zeros(n, np.int64)
    seeds = seed_words(rows.astype(np.uint64) * np.uint64(7919) + np.uint64(1 << 33) * np.uint64(seed + 1))
    sample_index = (rows % 3).astype(np.int32)
    steps = 0
    while (count < LENGTH).any():
        steps += 1
        assert steps <= LENGTH
        num_drafts = np.array([2, 2, 2, 1, 0])[(rows + steps) % 5]  # mostly K, some fewer, some none
        draft_ids = np.zeros((n, K), np.int64)
        draft_probs = np.zeros((n, K, V), np.float32)
        for j in range(K):
            length = count + j
            if drafts == "model":
                q = table_rows(DRAFT, tokens, length)
                d = draw(q, rng)
                draft_probs[:, j] = q
            else:
                last = tokens[rows, np.maximum(length - 1, 0)] * (length > 0)
                d = (3 * last + rows + 2 * length) % V
            d = np.where(j < num_drafts, d, 0)
            draft_probs[:, j] *= (j < num_drafts)[:, None]
            draft_ids[:, j] = d
            tokens[rows, length] = d

        logits = np.zeros((n, K + 1, V), np.float32)
        offset = np.minimum(np.arange(K + 1)[None, :], num_drafts[:, None])  # [n, K+1]
        for j in range(K + 1):
            logits[:, j] = table_rows(TARGET, tokens, count + offset[:, j])
            logits[j > num_drafts, j] = IGNORED_POSITION
        output_index = (count[:, None] + offset).reshape(-1)
        fields = dict(
            temperature=setting.temperature,
            top_k=setting.top_k,
            seeds=np.repeat(seeds, K + 1, axis=0),
            sample_index=np.repeat(sample_index, K + 1),
            output_index=output_index,
            ban=output_index < setting.min_tokens,
            banned_token_ids=np.full((n * (K + 1), 4), STOP),
        )
        if setting.penalties:
            history = np.concatenate([np.tile(PROMPT, (n, 1)), tokens], axis=1)
            fields.update(
                presence_penalty=setting.presence,
                frequency_penalty=setting.frequency,
                repetition_penalty=setting.repetition,
                history=np.repeat(history, K + 1, axis=0),
                history_lens=len(PROMPT) + output_index,
                prompt_lens=np.full(n * (K + 1), len(PROMPT)),
            )
        claimed = dict(q=draft_probs, nothing=None, uniform=np.full_like(draft_probs, 1 / V))[told]
        out = verify_fn(
            logits.reshape(n * (K + 1), V),
            metadata(n * (K + 1), **fields),
            draft_ids.astype(np.int32),
            num_drafts.astype(np.int32),
            claimed,
        )
        emitted, num = np.asarray(out.token_ids), np.asarray(out.num_tokens)
        assert ((1 <= num) & (num <= num_drafts + 1)).all()
        np.testing.assert_array_equal(
            np.where(np.arange(K)[None, :] < num[:, None] - 1, emitted[:, :K], 0),
            np.where(np.arange(K)[None, :] < num[:, None] - 1, draft_ids, 0),
            "the tokens before the last must be the accepted drafts",
        )
        for j in range(K + 1):
            writes = (count < LENGTH) & (j < num)
            tokens[rows[writes], count[writes] + j] = emitted[writes, j]
        count = np.where(count < LENGTH, count + num, count)
        tokens[rows[:, None], count[:, None] + np.arange(K)[None, :]] = 0  # forget this step's drafts
    return tokens[:, :LENGTH]


def fit(setting: Setting, drafts: str, told: str, verify_fn=verify_jit) -> Fit:
    return goodness_of_fit(generate(setting, drafts, told, verify_fn), setting)


@pytest.mark.parametrize("drafts, told", [("model", "q"), ("fixed", "nothing")])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_generated_tokens_follow_the_target_distribution(name, drafts, told):
    """Drafts from a draft model (verify told q) or from a fixed rule (point masses):
    either way the tokens are distributed as the target alone would sample them."""
    setting = SETTINGS[name]
    # The test's premise: the draft model proposes tokens the target never emits, and the
    # other way round.
    p1, q1 = setting.target(()), DRAFT[0]
    assert ((p1 == 0) & (q1 > 0)).any() and ((p1 > 0) & (q1 == 0)).any()
    result = fit(setting, drafts, told)
    assert result.impossible == 0, "a token the target gives no probability was emitted"
    assert result.p_pairs > 1e-3 and result.p_triples > 1e-3, result


def test_point_mass_verification_is_exact_whatever_the_drafts_came_from():
    """Drafts from q verified as point masses (accepted with probability p(d), else a draw
    from p without d): still exactly p, since the drafts do not depend on the verifier's
    random numbers. Only acceptance is lower. So this is not a wrong rule to test against."""
    result = fit(SETTINGS["temperature-top-k"], "model", "nothing")
    assert result.impossible == 0
    assert result.p_pairs > 1e-3 and result.p_triples > 1e-3, result


def verify_drawing_from_p_after_a_rejection(logits, meta, draft_ids, num_drafts, draft_probs=None):
    """A classic mistake, for the test of the test: the accepted drafts are verify's, but
    the token after them is drawn from p even after a rejection (not from max(0, p - q))."""
    out = verify(logits, meta, draft_ids, num_drafts, draft_probs)
    from_p = sample(logits, meta).token_ids.reshape(draft_ids.shape[0], -1)  # independent of acceptance
    last = out.num_tokens - 1
    rows = jax.numpy.arange(draft_ids.shape[0])
    return dataclasses.replace(out, token_ids=out.token_ids.at[rows, last].set(from_p[rows, last]))


@pytest.mark.parametrize("wrong", ["q claimed uniform", "no residual"])
def test_the_distribution_test_fails_wrong_acceptance_rules(wrong):
    """The harness above must see a wrong rule: drafts drawn from q while verify is told
    they were uniform (accepted with min(1, p/u), residual max(0, p - u)); or the draw
    after a rejection taken from p instead of the residual."""
    if wrong == "q claimed uniform":
        result = fit(SETTINGS["plain"], "model", "uniform")
    else:
        result = fit(SETTINGS["plain"], "model", "q", jax.jit(verify_drawing_from_p_after_a_rejection))
    assert result.p_pairs < 1e-6, result


# --------------------------------------------------------------------------------------
# The rules one by one, against NumPy. One shape for all (R requests, K_ drafts, vocabulary
# V_, a penalty history W_ wide, always given), so that few programs compile.
# --------------------------------------------------------------------------------------

R, K_, V_, W_ = 2000, 3, 24, 12
S = R * (K_ + 1)  # sampling rows


def rows_metadata(**fields) -> SamplingMetadata:
    """S rows; a penalty history (empty unless given), which penalties left off ignore."""
    history = dict(
        history=np.zeros((S, W_), np.int32), history_lens=np.zeros(S, np.int32), prompt_lens=np.zeros(S, np.int32)
    )
    return metadata(S, **{**history, **fields})


def per_position(values) -> np.ndarray:
    """A per-request value for each of its K_ + 1 positions."""
    return np.repeat(np.asarray(values), K_ + 1, axis=0)


def verify_layout(rng, num_drafts):
    """As the batch builder lays out a verify step: position j samples the request's output
    token `num_output + min(j, num_drafts)`, after its prompt, its output and its first
    min(j, num_drafts) drafts. Returns (min(j, num_drafts) [R, K_ + 1], num_prompt, num_output)."""
    offset = np.minimum(np.arange(K_ + 1)[None, :], num_drafts[:, None])  # [R, K_ + 1]
    num_prompt = rng.integers(1, 4, R)
    num_output = rng.integers(0, W_ - K_ - 3, R)
    return offset, num_prompt, num_output


def history_for(rng, num_prompt, num_output, draft_ids):
    """[R, W_]: prompt, output, drafts, zero padded."""
    history = np.zeros((R, W_), np.int32)
    for r in range(R):
        known = rng.integers(0, V_, num_prompt[r] + num_output[r]).tolist() + draft_ids[r].tolist()
        history[r, : len(known)] = known
    return history


def test_drafts_given_as_one_hot_distributions_are_point_masses():
    """Draft probabilities that are one-hot on the drafts: the same tokens as with none."""
    rng = np.random.default_rng(8)
    logits = rng.normal(0, 1.5, (S, V_)).astype(np.float32)
    draft_ids = rng.integers(0, V_, (R, K_)).astype(np.int32)
    num_drafts = rng.integers(0, K_ + 1, R).astype(np.int32)
    meta = rows_metadata(seeds=seed_words(rng.integers(0, 2**63, S)), output_index=np.tile(np.arange(K_ + 1), R))
    one_hot = np.eye(V_, dtype=np.float32)[draft_ids]
    a = verify_jit(logits, meta, draft_ids, num_drafts)
    b = verify_jit(logits, meta, draft_ids, num_drafts, one_hot)
    np.testing.assert_array_equal(np.asarray(a.num_tokens), np.asarray(b.num_tokens))
    np.testing.assert_array_equal(np.asarray(a.token_ids), np.asarray(b.token_ids))


def greedy_oracle(adjusted: np.ndarray, draft_ids: np.ndarray, num_drafts: np.ndarray) -> list[list[int]]:
    """The longest prefix of drafts equal to each position's argmax, then the argmax at the
    first mismatch (or after the last draft): each row's tokens."""
    k = draft_ids.shape[1]
    best = adjusted.reshape(len(draft_ids), k + 1, -1).argmax(-1)
    result = []
    for r in range(len(draft_ids)):
        a = 0
        while a < num_drafts[r] and draft_ids[r, a] == best[r, a]:
            a += 1
        result.append(draft_ids[r, :a].tolist() + [int(best[r, a])])
    return result


def check_rows(out, want: list[list[int]], rows) -> None:
    tokens, num = np.asarray(out.token_ids), np.asarray(out.num_tokens)
    for r in rows:
        assert num[r] == len(want[r]), (r, num[r], want[r])
        assert tokens[r, : num[r]].tolist() == want[r], (r, tokens[r].tolist(), want[r])


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_greedy_rows_accept_the_longest_prefix_equal_to_the_argmax(with_draft_probs):
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(S, V_)).astype(np.float32)
    best = logits.reshape(R, K_ + 1, V_).argmax(-1)
    # Drafts mostly equal to the argmax, so that long runs are accepted; past num_drafts
    # they equal it too, and must still be ignored.
    draft_ids = np.where(rng.random((R, K_)) < 0.75, best[:, :K_], rng.integers(0, V_, (R, K_))).astype(np.int32)
    num_drafts = rng.integers(0, K_ + 1, R).astype(np.int32)
    draft_probs = softmax(rng.normal(size=(R, K_, V_))).astype(np.float32) if with_draft_probs else None
    want = greedy_oracle(logits, draft_ids, num_drafts)
    lengths = np.array([len(w) for w in want])
    assert set(lengths) == set(range(1, K_ + 2)), "every acceptance length occurs"
    assert ((lengths == num_drafts + 1) & (num_drafts < K_) & (draft_ids[:, -1] == best[:, K_ - 1])).any(), (
        "some rows ran out of drafts before K, with an acceptable draft after them"
    )

    all_greedy = rows_metadata(temperature=0.0)
    check_rows(verify_jit(logits, all_greedy, draft_ids, num_drafts, draft_probs), want, range(R))

    # Mixed with sampled rows (every other request): the greedy rows' result is unchanged.
    mixed = rows_metadata(temperature=per_position(np.arange(R) % 2), output_index=np.tile(np.arange(K_ + 1), R))
    out = verify_jit(logits, mixed, draft_ids, num_drafts, draft_probs)
    check_rows(out, want, range(0, R, 2))
    sampled = [
        w != t[:n].tolist()
        for w, t, n in zip(want[1::2], np.asarray(out.token_ids)[1::2], np.asarray(out.num_tokens)[1::2])
    ]
    assert np.mean(sampled) > 0.2, "the sampled rows were not sampled"


def test_rows_without_drafts_draw_what_the_sampler_draws():
    """Same seed, same output index: the same token as `sampler.sample`, so a seeded
    request's output does not depend on whether drafts were proposed for it or others.
    Likewise the token after a request's drafts when all were accepted: position j draws
    from output index `output_index + j`'s stream, as plain sampling of that token would."""
    rng = np.random.default_rng(10)
    logits = rng.normal(0, 1.5, (S, V_)).astype(np.float32)
    best = logits.reshape(R, K_ + 1, V_).argmax(-1)
    num_drafts = np.where(rng.random(R) < 0.5, 0, rng.integers(1, K_ + 1, R)).astype(np.int32)
    draft_ids = np.where(rng.random((R, K_)) < 0.8, best[:, :K_], rng.integers(0, V_, (R, K_)))
    draft_ids = np.where(np.arange(K_)[None, :] < num_drafts[:, None], draft_ids, 0).astype(np.int32)
    offset, num_prompt, num_output = verify_layout(rng, num_drafts)
    kind = per_position(np.arange(R) % 5)  # per request: greedy, plain, top-k, top-p, min-p + top-k
    penalties = per_position(np.arange(R) % 3 == 0)  # on for a third of the requests
    meta = rows_metadata(
        temperature=np.array([0.0, 1.0, 0.8, 1.3, 0.6])[kind],
        top_k=np.array([0, 0, 3, 0, 5])[kind],
        top_p=np.array([1, 1, 1, 0.7, 1])[kind],
        min_p=np.array([0, 0, 0, 0, 0.1])[kind],
        presence_penalty=0.6 * penalties,
        frequency_penalty=0.3 * penalties,
        repetition_penalty=1 + 0.4 * penalties,
        history=per_position(history_for(rng, num_prompt, num_output, draft_ids)),
        history_lens=(num_prompt[:, None] + num_output[:, None] + offset).reshape(-1),
        prompt_lens=per_position(num_prompt),
        seeds=per_position(seed_words(rng.integers(0, 2**63, R))),
        sample_index=per_position(rng.integers(0, 4, R)),
        output_index=(num_output[:, None] + offset).reshape(-1),
        ban=per_position(rng.random(R) < 0.3),
        banned_token_ids=np.tile([1, 2, 1, 1], (S, 1)),
    )
    out = verify_jit(logits, meta, draft_ids, num_drafts)
    tokens, num = np.asarray(out.token_ids), np.asarray(out.num_tokens)
    plain = np.asarray(sample_jit(logits, meta).token_ids).reshape(R, K_ + 1)
    zero = num_drafts == 0
    np.testing.assert_array_equal(num[zero], 1)
    np.testing.assert_array_equal(tokens[zero, 0], plain[zero, 0])
    assert zero.sum() > R // 3 and len(set(plain[zero, 0].tolist())) > V_ // 2  # not a degenerate comparison

    all_accepted = (num_drafts > 0) & (num == num_drafts + 1)
    bonus = np.arange(R)[all_accepted], num_drafts[all_accepted]
    np.testing.assert_array_equal(tokens[bonus], plain[bonus])
    assert all_accepted.sum() > R // 10 and (kind[:: K_ + 1][all_accepted] > 0).sum() > R // 20


def test_logprobs_are_those_of_the_raw_model_output():
    """Per emitted token, the log_softmax of its position's raw logits (before penalties,
    bans and temperature); the top tables likewise, min(MAX_LOGPROBS, V) wide."""
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 2.0, (S, V_)).astype(np.float32)
    best = logits.reshape(R, K_ + 1, V_).argmax(-1)
    draft_ids = np.where(rng.random((R, K_)) < 0.7, best[:, :K_], rng.integers(0, V_, (R, K_))).astype(np.int32)
    num_drafts = rng.integers(0, K_ + 1, R).astype(np.int32)
    offset, num_prompt, num_output = verify_layout(rng, num_drafts)
    fields = dict(
        temperature=per_position(np.array([0.0, 0.5, 1.0])[np.arange(R) % 3]),
        top_k=8,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        history=per_position(history_for(rng, num_prompt, num_output, draft_ids)),
        history_lens=(num_prompt[:, None] + num_output[:, None] + offset).reshape(-1),
        prompt_lens=per_position(num_prompt),
        ban=per_position(np.arange(R) % 4 == 0),
        banned_token_ids=np.tile([5, 7, 5, 5], (S, 1)),
        seeds=seed_words(rng.integers(0, 2**63, S)),
        output_index=np.tile(np.arange(K_ + 1), R),
    )
    out = verify_jit(logits, rows_metadata(want_logprobs=np.bool_(True), **fields), draft_ids, num_drafts)
    raw = log_softmax(logits).reshape(R, K_ + 1, V_)
    tokens, num = np.asarray(out.token_ids), np.asarray(out.num_tokens)
    emitted = np.arange(K_ + 1)[None, :] < num[:, None]
    want = np.take_along_axis(raw, tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs)[emitted], want[emitted], atol=2e-5)
    assert (num > 2).sum() > R // 10  # drafts were accepted: later positions are checked too

    width = min(MAX_LOGPROBS, V_)
    top = np.argsort(-raw, axis=-1, kind="stable")[..., :width]
    assert out.top_logprob_ids.shape == (R, K_ + 1, width) and width < V_
    np.testing.assert_array_equal(np.asarray(out.top_logprob_ids), top)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(raw, top, -1), atol=2e-5)

    # Asking for logprobs changes no token.
    plain = verify_jit(logits, rows_metadata(**fields), draft_ids, num_drafts)
    np.testing.assert_array_equal(np.asarray(plain.num_tokens), num)
    np.testing.assert_array_equal(np.asarray(plain.token_ids)[emitted], tokens[emitted])


@pytest.mark.parametrize("mode", ["greedy", "fixed-drafts", "model-drafts"])
def test_banned_tokens_are_never_emitted_where_banned(mode):
    """min_tokens bans the stop tokens at the positions before it: per position, so a
    request one token short of min_tokens may emit a stop token second, not first. Greedy
    rows: exactly the argmax of the penalized logits with the ban (penalty history per
    position: the drafts before it count as output)."""
    rng = np.random.default_rng(12)
    stop, other_stop, min_tokens = 3, 6, 4
    presence, frequency, repetition = 0.7, 0.2, 1.2
    logits = rng.normal(0, 1.0, (R, K_ + 1, V_)).astype(np.float32)
    logits[..., stop] += 3.0  # the favourite, everywhere
    num_drafts = rng.integers(0, K_ + 1, R).astype(np.int32)
    offset, num_prompt, num_output = verify_layout(rng, num_drafts)
    output_index = num_output[:, None] + offset
    banned = output_index < min_tokens
    known = [rng.integers(0, V_, num_prompt[r] + num_output[r]).tolist() for r in range(R)]

    def adjusted(r, j, drafts):
        """Position j's logits after penalties (history: prompt, output, drafts before j) and the ban."""
        z = penalized(logits[r, j], known[r] + drafts[:j], num_prompt[r], presence, frequency, repetition)
        if banned[r, j]:
            z[[stop, other_stop]] = -np.inf
        return z

    # Drafts drawn from q: half on the argmax (accepted by greedy rows), some on the stop
    # token (which a banned position must reject), the rest uniform.
    draft_ids = np.zeros((R, K_), np.int32)
    draft_probs = np.zeros((R, K_, V_), np.float32)
    for r in range(R):
        for j in range(num_drafts[r]):
            q = 0.5 * (np.arange(V_) == adjusted(r, j, draft_ids[r].tolist()).argmax())
            q = q + 0.3 * (np.arange(V_) == stop) + 0.2 / V_
            draft_probs[r, j] = q
            draft_ids[r, j] = rng.choice(V_, p=q / q.sum())
    history = history_for(rng, num_prompt, num_output, draft_ids)
    for r in range(R):
        history[r, : len(known[r])] = known[r]
    meta = rows_metadata(
        temperature=0.0 if mode == "greedy" else 1.0,
        ban=banned.reshape(-1),
        banned_token_ids=np.tile([stop, other_stop, stop, stop], (S, 1)),  # as the batch builder pads
        seeds=seed_words(rng.integers(0, 2**63, S)),
        output_index=output_index.reshape(-1),
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        history=per_position(history),
        history_lens=(num_prompt[:, None] + output_index).reshape(-1),
        prompt_lens=per_position(num_prompt),
    )
    out = verify_jit(
        logits.reshape(S, V_), meta, draft_ids, num_drafts, draft_probs if mode == "model-drafts" else None
    )
    tokens, num = np.asarray(out.token_ids), np.asarray(out.num_tokens)
    emitted = np.arange(K_ + 1)[None, :] < num[:, None]
    assert (emitted & banned)[:, 1:].sum() > 50, "banned positions past the first are checked"
    assert not (np.isin(tokens, [stop, other_stop]) & emitted & banned).any(), "a banned token was emitted"
    assert (tokens == stop)[emitted & ~banned].mean() > 0.2, "unbanned, the favourite is emitted"

    if mode == "greedy":
        best = np.array([[adjusted(r, j, draft_ids[r].tolist()) for j in range(K_ + 1)] for r in range(R)])
        check_rows(out, greedy_oracle(best, draft_ids, num_drafts), range(R))
