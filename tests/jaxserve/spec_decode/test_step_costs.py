"""The drafting decision by measured step times (jaxserve.spec_decode.step_costs), on made-up
times: drafts are verified where (rows + expected accepted) / verify seconds beats rows /
plain seconds, the expectation a geometric run of each request's acceptance estimate."""

import pytest

from jaxserve.spec_decode.step_costs import DECAY, PROBE_EVERY, StepCosts, expected_accepted
from scheduler import Request, SamplingParams


def request(accepted_runs: int = 0) -> Request:
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=100))
    for _ in range(accepted_runs):
        req.draft_length.observe(4, 4)
    return req


def costs(plain: float | None = None, verify: float | None = None, rows: int = 1, drafts: int = 4) -> StepCosts:
    """Times of an overlapped plain step of `rows` tokens and a verify step of rows + drafts."""
    c = StepCosts(bucket=lambda tokens: tokens)
    if plain is not None:
        c.observe(False, False, rows, plain)
    if verify is not None:
        c.observe(True, True, rows + drafts, verify)
    return c


def test_expected_accepted_is_a_geometric_run_of_the_estimate():
    req = request()
    assert req.draft_length.acceptance == 0.5  # the prior
    assert expected_accepted(req, 4) == pytest.approx(0.5 + 0.25 + 0.125 + 0.0625)
    assert expected_accepted(req, 0) == 0


def test_plain_steps_are_timed_first_then_a_verify_step():
    c = costs()
    assert not c.drafts_pay(1, 1, [(request(), 4)], waited=False)
    c.observe(False, False, 1, 0.010)
    assert c.drafts_pay(2, 1, [(request(), 4)], waited=False)
    assert costs().drafts_pay(1, 1, [(request(), 4)], waited=True)  # the wait is paid: time the verify step


def test_after_a_forced_wait_the_verify_step_is_weighed_against_a_plain_step_that_waited():
    c = costs(plain=0.010, verify=0.020)  # 1.9375 / 20 ms = 0.097 tokens per ms
    c.observe(False, True, 1, 0.013)  # a plain step after a wait: 0.077 per ms
    assert not c.drafts_pay(1, 1, [(request(), 4)], waited=False)  # an overlapped one: 0.1
    assert c.drafts_pay(2, 1, [(request(), 4)], waited=True)


@pytest.mark.parametrize(("verify", "pays"), [(0.015, True), (0.020, False)])
def test_drafts_pay_when_their_tokens_per_second_beat_plain_decoding(verify, pays):
    # 1.9375 expected tokens: 0.129 per ms at 15 ms, 0.097 at 20 ms, against 0.1 plain
    assert costs(plain=0.010, verify=verify).drafts_pay(1, 1, [(request(), 4)], waited=False) == pays


def test_a_batch_weighs_its_rows_against_the_drafting_requests():
    # 8 rows: plain 30 ms (0.267 tokens per ms); 2 requests verify 4 drafts each (16 tokens)
    c = costs(plain=0.030, verify=0.045, rows=8, drafts=8)
    sure = request(accepted_runs=10)  # acceptance near 1: about 3.6 drafts each
    assert c.drafts_pay(1, 8, [(sure, 4), (sure, 4)], waited=False)  # 15.5 / 45 ms = 0.344
    assert not c.drafts_pay(2, 8, [(request(), 4), (request(), 4)], waited=False)  # 9.9 / 45 ms = 0.219


def test_declined_steps_are_probed_again_and_a_step_is_decided_once():
    c = costs(plain=0.010, verify=0.030)
    answers = []
    for step in range(2 * PROBE_EVERY):
        first = c.drafts_pay(step, 1, [(request(), 4)], waited=False)
        assert c.drafts_pay(step, 1, [(request(), 1)], waited=True) == first  # asked again after the tokens arrived
        answers.append(first)
    assert answers == ([False] * (PROBE_EVERY - 1) + [True]) * 2


def test_a_bucket_s_time_follows_its_latest_steps():
    c = costs(plain=0.010)
    c.observe(False, False, 1, 0.020)
    assert c.seconds[False, False, 1] == pytest.approx(DECAY * 0.010 + (1 - DECAY) * 0.020)
    c.observe(False, False, 2, 0.5)  # another bucket
    c.observe(False, True, 1, 0.5)  # a plain step that waited
    c.observe(True, False, 5, 0.5)  # a verify step, which always waited
    assert c.seconds[False, False, 1] == pytest.approx(DECAY * 0.010 + (1 - DECAY) * 0.020)
    assert c.seconds[True, True, 5] == 0.5
