"""Prompt lookup: draft tokens copied from the request's own earlier tokens (on the host).

If the sequence ends in an n-gram that occurred before, what followed that earlier
occurrence is a good guess for what comes next: summaries, edits and code copy long runs
of their prompt. The longest n in [min_n, max_n] with a match wins; among its matches the
latest, which is the most likely to continue like the present.

    tokens:  the cat sat on the mat . the cat sat
                 ^^^^^^^              ^^^^^^^^^^^  suffix "the cat sat" (n=3) occurred at 0
    drafts:  on the mat                            what followed it there, k = 3
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int] | np.ndarray, num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` draft tokens for the sequence `token_ids`; [] if no n-gram matches."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at 0 .. length-n-1: every earlier occurrence, not the suffix itself.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start : start + num_tokens].tolist()
    return []
