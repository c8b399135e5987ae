"""Prompt lookup: draft tokens copied from the request's own earlier tokens (on the host).

If the sequence ends in an n-gram that occurred before, what followed that earlier
occurrence is a good guess for what comes next: summaries, edits and code copy long runs
of their prompt. The longest n in [min_n, max_n] with a match wins; among its matches the
latest, which is the most likely to continue like the present.

    tokens:  the cat sat on the mat . the cat sat
                 ^^^^^^^              ^^^^^^^^^^^  suffix "the cat sat" (n=3) occurred at 0
    drafts:  on the mat                            what followed it there, k = 3

An n-gram match ends at an earlier occurrence of the sequence's last two tokens (its last
token where min_n is 1), so `NgramIndex` keeps, per such key, the positions it ended at,
fed as tokens arrive: a lookup reads only the key's earlier occurrences, never the whole
history (a 32k-token request costs what its last bigram's frequency costs, not 32k
comparisons per n).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class _Growing:
    """An int64 array appended to in place, doubling its buffer as it fills."""

    def __init__(self, capacity: int = 16):
        self.buffer = np.empty(capacity, dtype=np.int64)
        self.size = 0

    def extend(self, values: np.ndarray) -> None:
        end = self.size + len(values)
        if end > len(self.buffer):
            grown = np.empty(max(end, 2 * len(self.buffer)), dtype=np.int64)
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        self.buffer[self.size : end] = values
        self.size = end

    @property
    def values(self) -> np.ndarray:
        return self.buffer[: self.size]


class NgramIndex:
    """One sequence's tokens, fed in order with `extend`, and where each key ended: a key is
    the last `key_length` (1 or 2, at most the shortest n looked up) tokens up to a position."""

    def __init__(self, key_length: int = 2) -> None:
        assert key_length in (1, 2), key_length
        self.key_length = key_length
        self.tokens = _Growing()
        self.positions: dict[int, _Growing] = {}

    def __len__(self) -> int:
        return self.tokens.size

    def extend(self, token_ids: Sequence[int] | np.ndarray) -> None:
        start = len(self)
        self.tokens.extend(np.asarray(token_ids, dtype=np.int64))
        first = max(start, self.key_length - 1)  # the first position with a whole key
        keys = self._keys(first, len(self))
        if len(keys) <= 16:  # a decode step's token and accepted drafts: no sorting
            for offset, key in enumerate(keys.tolist()):
                self._positions_of(key).extend(np.array([first + offset]))
            return
        order = np.argsort(keys, kind="stable")  # a prompt: one append per distinct key
        distinct, firsts = np.unique(keys[order], return_index=True)
        for key, group in zip(distinct.tolist(), np.split(order + first, firsts[1:])):
            self._positions_of(key).extend(group)

    def _keys(self, start: int, end: int) -> np.ndarray:
        tokens = self.tokens.values
        if self.key_length == 1:
            return tokens[start:end]
        return (tokens[start - 1 : end - 1] << 32) | tokens[start:end]  # token ids < 2**32

    def _positions_of(self, key: int) -> _Growing:
        if (positions := self.positions.get(key)) is None:
            positions = self.positions[key] = _Growing(4)
        return positions

    def propose(self, num_tokens: int, min_n: int, max_n: int) -> list[int]:
        """Up to `num_tokens` draft tokens to follow the sequence; [] if no n-gram of
        min_n (at least key_length) to max_n tokens matches."""
        assert min_n >= self.key_length, (min_n, self.key_length)
        length = len(self)
        max_n = min(max_n, length - 1)
        if max_n < min_n:
            return []
        tokens = self.tokens.values
        last_key = int(self._keys(length - 1, length)[0])
        ends = self.positions[last_key].values[:-1]  # earlier occurrences: the last is length-1
        # How far back each occurrence matches the suffix, up to max_n tokens.
        matched = np.full(len(ends), self.key_length, dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for back in range(self.key_length, max_n):
            alive &= ends >= back
            alive[alive] = tokens[ends[alive] - back] == tokens[length - 1 - back]
            matched += alive
        if not len(ends) or (longest := int(matched.max())) < min_n:
            return []
        end = int(ends[np.flatnonzero(matched == longest)[-1]])  # the latest of the longest
        return tokens[end + 1 : end + 1 + num_tokens].tolist()


def propose_ngram(token_ids: Sequence[int] | np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` draft tokens for the sequence `token_ids`; [] if no n-gram matches.
    For one lookup; a request that grows keeps an `NgramIndex` instead."""
    index = NgramIndex(min(min_n, 2))
    index.extend(token_ids)
    return index.propose(num_tokens, min_n, max_n)
