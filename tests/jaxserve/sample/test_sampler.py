"""The on-device sampler against NumPy re-statements of each rule, and against the
target distribution itself (empirical frequencies over many seeds)."""

import jax
import numpy as np
import pytest

from jaxserve.sample.sampler import MAX_LOGPROBS, adjust_logits, apply_penalties, greedy_argmax, sample
from tests.sampling_oracle import kept_by_documentation, meta, seed_words, softmax

V = 12


def target_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """NumPy statement of the filters: top-k, then top-p on what is left, then min-p."""
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(V, bool)
    k = top_k or V
    p = softmax(z[order[:k]])
    mass_before = np.cumsum(p) - p
    keep[order[:k][mass_before < top_p]] = True
    z = np.where(keep, z, -np.inf)
    probs = softmax(z)
    probs = np.where(probs >= min_p * probs.max(), probs, 0)
    return probs / probs.sum()


sample_jit = jax.jit(sample)


@pytest.mark.parametrize(
    "filters", [dict(), dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=5, top_p=0.8, min_p=0.05)]
)
def test_draws_follow_the_target_distribution(filters):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, V).astype(np.float32)
    n = 4000  # one row per draw, each with its own seed
    out = sample_jit(np.tile(logits, (n, 1)), meta(n, temperature=0.8, **filters))
    counts = np.bincount(np.asarray(out.token_ids), minlength=V)
    want = target_probs(logits.astype(np.float64), 0.8, **filters)
    assert counts[want == 0].sum() == 0, "a filtered-out token was drawn"
    # Every bin within 5 standard deviations of its binomial expectation.
    sd = np.sqrt(n * want * (1 - want)) + 1e-9
    assert np.all(np.abs(counts - n * want) <= 5 * sd + 1), (counts, n * want)


def test_greedy_rows_take_the_argmax_and_mix_with_sampled_rows():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, V)).astype(np.float32)
    out = sample_jit(logits, meta(6, temperature=[0, 1, 0, 1, 0, 1]))
    ids = np.asarray(out.token_ids)
    np.testing.assert_array_equal(ids[::2], logits[::2].argmax(-1))


def test_a_row_depends_only_on_its_seed_and_position():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(8, V)).astype(np.float32)
    a = sample_jit(logits, meta(8, seeds=seed_words(np.arange(8) + 100), output_index=np.arange(8)))
    perm = np.array([3, 0, 7, 1, 6, 2, 5, 4])
    b = sample_jit(logits[perm], meta(8, seeds=seed_words(np.arange(8) + 100)[perm], output_index=np.arange(8)[perm]))
    np.testing.assert_array_equal(np.asarray(a.token_ids)[perm], np.asarray(b.token_ids))


def test_banned_tokens_are_never_drawn():
    logits = np.zeros((200, V), np.float32)
    logits[:, 3] = 10.0  # the favourite is banned
    banned = np.tile(np.array([3, 5, 3, 3], np.int32), (200, 1))
    out = sample_jit(logits, meta(200, ban=True, banned_token_ids=banned))
    ids = np.asarray(out.token_ids)
    assert not np.isin(ids, [3, 5]).any()


def test_penalties_match_their_definition():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    history = np.array([[1, 2, 2, 4, 4, 4, 0], [5, 5, 6, 0, 0, 0, 0]], np.int32)
    lens, prompt_lens = np.array([6, 3]), np.array([2, 1])  # row 0: prompt [1, 2], output [2, 4, 4, 4]
    m = meta(
        2,
        presence_penalty=[0.5, 1.0],
        frequency_penalty=[0.3, 0.1],
        repetition_penalty=[1.5, 2.0],
        history=history,
        history_lens=lens,
        prompt_lens=prompt_lens,
    )
    got = np.asarray(apply_penalties(logits, m))
    want = logits.astype(np.float64).copy()
    for r in range(2):
        tokens = history[r, : lens[r]]
        output = tokens[prompt_lens[r] :]
        rep = m.repetition_penalty[r]
        for t in set(tokens.tolist()):  # repetition: prompt and output
            want[r, t] = want[r, t] / rep if want[r, t] > 0 else want[r, t] * rep
        for t in set(output.tolist()):  # presence and frequency: output only
            count = int((output == t).sum())
            want[r, t] -= m.frequency_penalty[r] * count + m.presence_penalty[r]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_logprobs_are_the_raw_log_softmax():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(3, 40)).astype(np.float32)
    out = sample_jit(logits, meta(3, temperature=0, want_logprobs=np.bool_(True)))
    raw = np.log(softmax(logits.astype(np.float64)))
    ids = np.asarray(out.token_ids)
    np.testing.assert_allclose(np.asarray(out.logprobs), raw[np.arange(3), ids], atol=1e-5)
    top = np.argsort(-raw, axis=1)[:, :MAX_LOGPROBS]
    assert top.shape == (3, MAX_LOGPROBS)
    np.testing.assert_array_equal(np.asarray(out.top_logprob_ids), top)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(raw, top, 1), atol=1e-5)


@pytest.mark.parametrize("kind", ["peaked", "flat"])
def test_filters_on_a_large_vocabulary_equal_the_numpy_statement(kind):
    """Peaked rows are cut inside the top-256 candidates; flat ones need the full sort."""
    from jaxserve.sample.sampler import FILTER_CANDIDATES, _filter

    vocab = 3000
    rng = np.random.default_rng(5)
    scale = 6.0 if kind == "peaked" else 0.05
    logits = (rng.normal(size=(4, vocab)) * scale).astype(np.float32)
    settings = [dict(top_p=0.9), dict(top_k=50, top_p=0.7), dict(top_k=1000), dict(top_k=400, top_p=0.95)]
    m = meta(
        4, temperature=1.0, top_p=[s.get("top_p", 1.0) for s in settings], top_k=[s.get("top_k", 0) for s in settings]
    )
    got = np.isfinite(np.asarray(jax.jit(_filter)(logits, m)))
    for row, s in enumerate(settings):
        z = logits[row].astype(np.float64)
        order = np.argsort(-z, kind="stable")
        k = s.get("top_k") or vocab
        p = softmax(z[order[:k]])
        want = np.zeros(vocab, bool)
        want[order[:k][(np.cumsum(p) - p) < s.get("top_p", 1.0)]] = True
        assert (got[row] == want).all(), (kind, s, got[row].sum(), want.sum())
    if kind == "flat":
        assert got[0].sum() > FILTER_CANDIDATES  # the full-sort path was needed and taken


def test_cutoff_knows_when_the_candidates_suffice():
    from jaxserve.sample.sampler import _cutoff

    rng = np.random.default_rng(6)
    peaked = (rng.normal(size=3000) * 6).astype(np.float32)
    flat = (rng.normal(size=3000) * 0.05).astype(np.float32)
    logits = np.stack([peaked, peaked, peaked, flat, flat])
    m = meta(5, top_p=[0.9, 1.0, 1.0, 0.9, 1.0], top_k=[0, 50, 1000, 0, 0])
    head = -np.sort(-logits, axis=1)[:, :256]
    threshold, resolved = map(np.asarray, jax.jit(_cutoff)(head, logits, m))
    assert resolved.tolist() == [True, True, False, False, True]
    full_threshold, full_resolved = map(np.asarray, jax.jit(_cutoff)(-np.sort(-logits, axis=1), logits, m))
    assert full_resolved.all()
    np.testing.assert_array_equal(threshold[resolved], full_threshold[resolved])


def test_samples_of_one_seed_are_not_other_seeds_samples():
    """Sample i of seed s draws from fold_in(key(s), i): it is not sample i-1 of seed s+1
    (the old `seed + i` scheme made request A's sample 1 equal request B's sample 0)."""
    from jaxserve.sample.sampler import sample_key

    keys = {}
    for seed in range(3):
        for index in range(3):
            data = jax.random.key_data(sample_key(seed_words(seed), np.int32(index), np.int32(0)))
            keys[(seed, index)] = tuple(np.asarray(data).tolist())
    assert len(set(keys.values())) == len(keys)
    # Below 2**32 the seed's words are those of jax.random.key(seed) itself.
    want = jax.random.fold_in(jax.random.fold_in(jax.random.key(7), 2), 5)
    np.testing.assert_array_equal(
        jax.random.key_data(sample_key(seed_words(7), np.int32(2), np.int32(5))), jax.random.key_data(want)
    )
    # The full 64 bits count: seeds that differ only in the high word draw differently.
    hi = sample_key(seed_words(7 + (1 << 40)), np.int32(2), np.int32(5))
    assert not np.array_equal(jax.random.key_data(hi), jax.random.key_data(want))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_filters_keep_exactly_the_documented_set_when_logits_tie(dtype):
    """Logits with many ties (coarse float32 values; bfloat16's 8-bit mantissa), cut-offs
    that fall inside tie groups, inside and beyond the 256 candidates the sampler looks at first."""
    import jax.numpy as jnp

    from jaxserve.sample.sampler import _filter

    vocab = 3000
    rng = np.random.default_rng(7)
    settings = [
        dict(top_k=1),
        dict(top_k=5),
        dict(top_k=256),
        dict(top_k=700),
        dict(top_p=0.3),
        dict(top_p=0.9),
        dict(top_k=40, top_p=0.5),
        dict(top_k=256, top_p=0.97),
        dict(min_p=0.3),
        dict(top_k=30, min_p=0.1),
        dict(top_p=0.999),
    ]
    rows = []
    for i in range(len(settings)):
        x = rng.normal(size=vocab) * (3.0 if i % 2 else 0.7)
        if dtype == "float32":
            x = np.round(x * 4) / 4  # quarter steps: hundreds of ties per value
        x = np.array(jnp.asarray(x, jnp.dtype(dtype)).astype(jnp.float32))
        k = settings[i].get("top_k")
        if k:  # make sure the k-th largest ties with the next one
            order = np.argsort(-x, kind="stable")
            x[order[k]] = x[order[k - 1]]
        rows.append(x)
    logits = np.stack(rows)
    m = meta(
        len(settings),
        top_k=[s.get("top_k", 0) for s in settings],
        top_p=[s.get("top_p", 1.0) for s in settings],
        min_p=[s.get("min_p", 0.0) for s in settings],
    )
    got = np.isfinite(np.asarray(jax.jit(_filter)(logits, m)))
    for row, s in enumerate(settings):
        want = kept_by_documentation(logits[row], s.get("top_k", 0), s.get("top_p", 1.0), s.get("min_p", 0.0))
        assert (got[row] == want).all(), (dtype, s, got[row].sum(), want.sum())
        if s.get("top_k"):
            kth = np.sort(logits[row])[::-1][s["top_k"] - 1]
            assert (logits[row] == kth).sum() > 1


@pytest.mark.parametrize("path", ["xla", "cpu_kernel"])
@pytest.mark.parametrize("vocab", [7, 37, 49152])
def test_greedy_argmax_is_numpys_argmax_with_ties_infinities_and_nans(vocab, path):
    """Both forms: the fused reductions (`_greedy_argmax`, what a GPU runs) and the CPU
    kernel, which `greedy_argmax` takes on the CPU once the kernels are built (checked in the
    lowering)."""
    from jaxserve.sample.sampler import _greedy_argmax
    from jaxserve.weights.load import default_cache_dir
    from pallas_kernels import cpu_kernels

    if path == "cpu_kernel":
        assert cpu_kernels.build(default_cache_dir()) is None
        assert (
            cpu_kernels.GREEDY_ARGMAX_TARGET in jax.jit(greedy_argmax).lower(np.zeros((2, vocab), np.float32)).as_text()
        )
    fn = cpu_kernels.greedy_argmax if path == "cpu_kernel" else _greedy_argmax
    rng = np.random.default_rng(vocab)
    logits = rng.integers(-3, 3, size=(12, vocab)).astype(np.float32)  # many ties for the max
    logits[1] = -np.inf  # every token banned: the first
    logits[2, vocab // 2] = np.inf
    logits[3, [1, vocab - 1]] = np.nan  # NumPy (and jnp.argmax): the first NaN wins
    logits[4, vocab - 1] = np.nan
    logits[5, 0] = np.nan
    logits[6, [0, 3]] = np.inf
    logits[7] = 0.0  # all tied
    logits[8, 2:5] = 1e38
    logits[9] = -np.abs(logits[9])
    logits[9, vocab // 3] = -0.0  # a negative zero first: it ties with the zeros after it
    logits[9, -1] = 0.0
    logits[10, vocab - 1] = 100.0  # the maximum in a row's ragged tail
    got = np.asarray(jax.jit(fn)(logits))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(got, np.asarray(jax.numpy.argmax(logits, axis=-1)))


def test_banned_ids_past_the_vocabulary_and_unbanned_rows_leave_the_logits_bit_for_bit():
    logits = np.random.default_rng(0).standard_normal((3, V)).astype(np.float32)
    m = meta(3, banned_token_ids=np.array([[2, V], [5, 7], [0, 1]]), ban=np.array([True, False, True]))
    out = np.asarray(jax.jit(adjust_logits)(logits, m))
    expected = logits.copy()
    expected[0, 2] = expected[2, [0, 1]] = -np.inf
    np.testing.assert_array_equal(out, expected)
