"""Whether verifying drafts pays at the batch running now, by the engine's own step times.

A verify step computes the drafts beside each request's token and, with the n-gram
proposer, waits for the step before it (its tokens decide the drafts), where a plain
step runs overlapped. On a CPU both costs grow with the batch: a 5-token step costs about
1.5 times a 1-token one at batch 1, and far more at batch 8, where the step is no longer
bound by reading the weights. So no fixed batch size says where drafting stops paying;
the engine times its pure decode steps, by token bucket and kind, and drafts only where

    (rows + expected accepted drafts) / seconds(verify step of rows + drafts tokens)
        > rows / seconds(plain step of rows tokens)

with each request's expected accepted drafts from its own acceptance so far (a geometric
run, as scheduler.spec_stats.DraftLength takes it). Plain steps are timed apart by
whether they waited for their predecessor: before the wait the choice is an overlapped
plain step or a verify step (which waits), after a wait that something else forced (a
verification before, a grammar) a plain step that waited too. A kind not timed yet at a
bucket is tried (an overlapped plain step first), and after PROBE_EVERY declines in a row
drafting is tried again, so a batch whose text turns repetitive, or a machine that gets
busier, is followed.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler import Request

DECAY = 0.8  # the older measurements' weight in a bucket's time: a few steps follow a change
PROBE_EVERY = 16  # declined steps before drafting is tried again


class StepCosts:
    """Seconds per pure decode step by (verified drafts?, waited for its predecessor?,
    token bucket), and the decision whether a step's drafts pay, made once per step."""

    def __init__(self, bucket: Callable[[int], int]):
        self.bucket = bucket  # tokens -> the bucket of the program that runs them
        self.seconds: dict[tuple[bool, bool, int], float] = {}
        self.declined = 0  # decisions in a row that declined drafting
        self.decided: tuple[int, bool] = (-1, False)  # (step, answer)

    def observe(self, verified: bool, waited: bool, tokens: int, seconds: float) -> None:
        """A pure decode step of `tokens` tokens took `seconds`, from its predecessor's
        result (or its own scheduling, if later) to its own; `waited`: it was scheduled
        after its predecessor's tokens arrived (a verify step always is)."""
        key = (verified, waited or verified, self.bucket(tokens))
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def drafts_pay(self, step: int, rows: int, drafting: list[tuple[Request, int]], waited: bool) -> bool:
        """Whether step `step`, `rows` decoding requests of which `drafting` would verify
        so many drafts each, yields more tokens per second with the drafts than without;
        `waited`: the step waits for its predecessor's tokens whatever the answer. Asked
        again for the same step (before and after its last tokens arrive), the same
        answer."""
        if step == self.decided[0]:
            return self.decided[1]
        drafts = sum(n for _, n in drafting)
        plain = self.seconds.get((False, waited, self.bucket(rows)))
        verify = self.seconds.get((True, True, self.bucket(rows + drafts)))
        if plain is None:
            pays = waited  # time an overlapped plain step first; after a wait, the verify step
        elif verify is None:
            pays = True
        else:
            gained = sum(expected_accepted(req, n) for req, n in drafting)
            pays = (rows + gained) / verify > rows / plain
        self.declined = 0 if pays else self.declined + 1
        if self.declined >= PROBE_EVERY:
            pays, self.declined = True, 0
        self.decided = (step, pays)
        return pays


def expected_accepted(req: Request, drafts: int) -> float:
    """Drafts of a chain of `drafts` the request is expected to accept: p + p^2 + ... + p^drafts
    for its acceptance estimate p."""
    p = req.draft_length.acceptance
    return sum(p**i for i in range(1, drafts + 1))
