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
