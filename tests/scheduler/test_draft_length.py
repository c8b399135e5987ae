"""The adaptive draft length: a request verifies as many drafts as pay off by its own
acceptance so far. The expected figures are worked out by hand from the rule in
scheduler.spec_stats.DraftLength (tokens 1 + p + ... + p^k per cost 1 + c k)."""

import pytest

from scheduler.spec_stats import DECAY, PRIOR, PROBE_EVERY, DraftLength

K, COST = 4, 0.15


def test_a_fresh_request_drafts_two():
    # p = 0.5: k=1 1.5/1.15 = 1.304, k=2 1.75/1.30 = 1.346, k=3 1.875/1.45 = 1.293
    assert DraftLength().length(K, COST) == 2


def test_accepted_runs_grow_to_the_full_length():
    d = DraftLength()
    for _ in range(6):
        d.observe(4, 4)
    assert d.acceptance > 0.9
    assert d.length(K, COST) == K


def test_rejected_drafts_stop_drafting_then_probe():
    d = DraftLength()
    for _ in range(4):
        d.observe(2, 0)
    assert d.acceptance < COST  # 1 + p < 1 + c: not even one draft pays
    lengths = [d.length(K, COST) for _ in range(2 * PROBE_EVERY)]
    assert lengths == ([0] * (PROBE_EVERY - 1) + [K]) * 2


def test_estimate_forgets_old_verifications():
    d = DraftLength()
    d.observe(4, 4)
    d.observe(4, 0)
    # one acceptance run of 4 (weight DECAY) and one rejection at the first draft (weight 1)
    accepted, rejected = 4 * DECAY, 1
    assert d.acceptance == pytest.approx((accepted + PRIOR) / (accepted + rejected + 2 * PRIOR))


def test_free_drafts_are_always_worth_the_full_length():
    d = DraftLength()
    for _ in range(4):
        d.observe(4, 1)
    assert d.length(K, 0.0) == K  # any p > 0 adds expected tokens at no cost
    assert d.length(K, 10.0) == 0


def test_a_step_asked_twice_gets_one_answer_and_counts_once():
    """The engine asks before the step's last token arrives (may it stay overlapped?) and
    again when proposing: with the request's token count both get the same length, and the
    probe every PROBE_EVERY steps counts steps, not questions."""
    d = DraftLength()
    for _ in range(4):
        d.observe(2, 0)
    lengths = []
    for num_tokens in range(100, 100 + 2 * PROBE_EVERY):
        first = d.length(K, COST, num_tokens)
        assert d.length(K, COST, num_tokens) == first
        lengths.append(first)
    assert lengths == ([0] * (PROBE_EVERY - 1) + [K]) * 2
