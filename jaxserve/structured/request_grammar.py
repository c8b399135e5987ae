"""What a request carries when its output is constrained: its matcher, following its output.

The scheduler sees only this duck type (`Request.grammar`; the scheduler imports nothing
from jaxserve): `fill_bitmask` for each row it samples, `accept` for each token that
arrives. The matcher follows the output tokens, not the KV cache, so preemption (which
keeps the output and recomputes its KV) needs nothing; draft tokens are looked ahead
through and rolled back, never kept.

With `after_token_id` (a reasoning model's `</think>`) the grammar waits for that token:
the thinking before it is free and never reaches the matcher, nor does the token itself.
With `thinking_budget` as well, the thinking may run that many tokens, then the mask allows
the end token alone (vLLM's thinking_token_budget); `matcher` may then be None (no
constraint on the answer).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from jaxserve.structured.llguidance import Matcher

logger = logging.getLogger(__name__)


class RequestGrammar:
    def __init__(
        self,
        matcher: Matcher | None,
        bitmask_words: int,
        *,
        after_token_id: int | None = None,
        thinking_budget: int | None = None,
    ):
        self.matcher = matcher
        self.bitmask_words = bitmask_words
        self.after_token_id = after_token_id
        self.thinking_budget = thinking_budget
        self.thought = 0  # tokens of thinking so far
        self.started = after_token_id is None  # the output has reached the grammar's part
        # Why the matcher gave up (e.g. a regex whose lexer outgrew the engine's limits), or
        # None. The scheduler then ends the request (finish_reason "abort") rather than let
        # it go on unconstrained.
        self.error: str | None = None

    def fill_bitmask(self, row: np.ndarray, ahead: Sequence[int] = ()) -> None:
        """The tokens allowed after the output so far and then `ahead` (draft tokens before
        the row's position), packed into `row`. After a draft the grammar forbids, the row
        cannot be reached (verification rejects that draft): it gets the last valid state's mask.
        Before the grammar starts every token is allowed, unless a draft in `ahead` starts it."""
        if not self.started:
            if self.after_token_id not in ahead:
                budget = self.thinking_budget
                if budget is not None and self.thought + len(ahead) >= budget:
                    only(row, self.after_token_id)  # the thinking is over its budget: end it
                else:
                    row.fill(-1)
                return
            ahead = ahead[list(ahead).index(self.after_token_id) + 1 :]  # the grammar's part of the drafts
        if self.matcher is None:  # a budget alone: the answer is free
            row.fill(-1)
            return
        valid = self.matcher.num_valid_prefix(list(ahead)) if ahead else 0
        if valid:
            self.matcher.accept_tokens(list(ahead[:valid]))
        self.matcher.fill_bitmask(row)
        if valid:
            self.matcher.rollback(valid)
        self._check()

    def accept(self, token_id: int) -> None:
        """The sequence's next output token. After the grammar is complete only EOS can come
        (the mask allows nothing else): nothing to follow."""
        if not self.started:
            self.started = token_id == self.after_token_id
            self.thought += not self.started
            return
        if self.matcher is not None and self.error is None and not self.matcher.is_terminated():
            self.matcher.accept_tokens([token_id])
            self._check()

    def _check(self) -> None:  # only with a matcher
        if self.error is None and self.matcher.is_error():
            self.error = self.matcher.error()
            logger.error("structured output: the grammar engine failed; the request ends: %s", self.error)


def only(row: np.ndarray, token_id: int) -> None:
    """`row` as a bitmask that allows `token_id` alone."""
    row.fill(0)
    row.view(np.uint32)[token_id // 32] = np.uint32(1) << np.uint32(token_id % 32)
