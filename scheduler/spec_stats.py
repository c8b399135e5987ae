"""Speculative decoding's counters: drafts verified, draft tokens, accepted tokens."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecDecodingStats:
    """Speculative decoding counters: the scheduler's since start-up (vLLM's spec_decode
    metrics), and each request's own."""

    num_drafts: int = 0  # verifications of a request's draft tokens
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)  # [k]: accepted at draft position i

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields on average: the accepted drafts and one more."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @classmethod
    def total(cls, stats: list[SpecDecodingStats]) -> SpecDecodingStats:
        """The counters of several (a request's n samples) added up."""
        out = cls()
        for s in stats:
            out.num_drafts += s.num_drafts
            out.num_draft_tokens += s.num_draft_tokens
            out.num_accepted_tokens += s.num_accepted_tokens
            out.accepted_per_position += [0] * (len(s.accepted_per_position) - len(out.accepted_per_position))
            for i, n in enumerate(s.accepted_per_position):
                out.accepted_per_position[i] += n
        return out


# A verification's weight in a request's acceptance estimate falls by this much with each
# later one (a half-life of about three): a request that turns from quoting to free text is
# followed within a few steps.
DECAY = 0.8
PRIOR = 0.5  # pseudo-counts of acceptances and of rejections before any verification
PROBE_EVERY = 16  # decoding steps without drafts before a request tries its full length again


@dataclasses.dataclass
class DraftLength:
    """How many of its drafts one request should verify, from its own verifications.

    A chain's drafts are taken to be accepted one after another with a probability p each
    (a geometric run), p estimated from the request's acceptances and rejections, older
    ones weighing less. Verifying k drafts costs `1 + cost * k` plain decoding steps and
    yields `1 + p + ... + p^k` tokens on average; the length is the k in 0..k_max with the
    most tokens per cost, 0 (decode plainly) when none beats a plain step. A request at 0
    tries its full length every PROBE_EVERY steps, so one whose text turns repetitive is
    noticed.
    """

    accepted: float = 0.0
    rejected: float = 0.0
    steps_without: int = 0  # decoding steps since it last drafted
    decided: tuple[int, int] = (-1, 0)  # (the step's token count, its length): asked twice, one answer

    @property
    def acceptance(self) -> float:
        """The estimate of p."""
        return (self.accepted + PRIOR) / (self.accepted + self.rejected + 2 * PRIOR)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """A verification of a chain of num_drafted drafts that accepted its first num_accepted."""
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejected = DECAY * self.rejected + (num_accepted < num_drafted)

    def length(self, k_max: int, cost: float, num_tokens: int | None = None) -> int:
        """The drafts to verify next step (called once per decoding step). With the request's
        `num_tokens`, a second call for the same step gives the first call's answer: the
        engine asks before the step's last token arrives (may the loop stay overlapped?)
        and again once it has."""
        if num_tokens is not None and num_tokens == self.decided[0]:
            return self.decided[1]
        k = self._length(k_max, cost)
        if num_tokens is not None:
            self.decided = (num_tokens, k)
        return k

    def _length(self, k_max: int, cost: float) -> int:
        p = self.acceptance
        best_k, best, tokens, run = 0, 1.0, 1.0, 1.0
        for k in range(1, k_max + 1):
            run *= p
            tokens += run
            if tokens / (1 + cost * k) > best:
                best_k, best = k, tokens / (1 + cost * k)
        self.steps_without = 0 if best_k else self.steps_without + 1
        if self.steps_without >= PROBE_EVERY:
            self.steps_without = 0
            return k_max
        return best_k
