"""Host cost of prompt lookup per decode step at long contexts: the per-request index
(jaxserve.spec_decode.ngram.NgramIndex, fed the step's new token) against a lookup that
scans the whole history every step (what NgramProposer did before: the token list turned
into an array, then every window compared with the suffix for each n).

The tokens are the words of benchmarks/quality_text.txt (ids by first appearance), repeated
to the context length: natural word frequencies, so the last bigram's earlier occurrences,
which the index reads, are as many as real text has. Per context: a prompt of that length,
then --steps decode steps of one token each, both lookups timed on the same sequence and
alternated step by step; their drafts are checked equal.

    python benchmarks/ngram_lookup.py [--contexts 1024,8192,32768] [--steps 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxserve.spec_decode.ngram import NgramIndex  # noqa: E402

K, MIN_N, MAX_N = 4, 2, 4  # SpeculativeConfig's defaults (prompt_lookup_min/max), 4 drafts


def scan_lookup(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The baseline: every earlier window against the suffix, for each n, every step."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start : start + num_tokens].tolist()
    return []


def word_tokens(count: int) -> list[int]:
    words = (ROOT / "benchmarks" / "quality_text.txt").read_text().split()
    ids: dict[str, int] = {}
    once = [ids.setdefault(w, len(ids)) for w in words]
    return (once * (count // len(once) + 1))[:count]


def measure(context: int, steps: int) -> dict:
    stream = word_tokens(context + steps)
    history = stream[:context]
    index = NgramIndex(min(MIN_N, 2))
    start = time.perf_counter()
    index.extend(history)
    prompt_ms = (time.perf_counter() - start) * 1e3
    scan_us, index_us, drafted = [], [], 0
    for token in stream[context : context + steps]:
        history.append(token)
        start = time.perf_counter()
        by_scan = scan_lookup(history, K, MIN_N, MAX_N)
        scan_us.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        index.extend([token])
        by_index = index.propose(K, MIN_N, MAX_N)
        index_us.append((time.perf_counter() - start) * 1e6)
        assert by_index == by_scan, (len(history), by_index, by_scan)
        drafted += bool(by_index)
    scan, idx = np.array(scan_us), np.array(index_us)
    return {
        "context": context,
        "steps": steps,
        "steps_with_drafts": drafted,
        "prompt_index_ms": round(prompt_ms, 2),
        "scan_median_us": round(float(np.median(scan)), 1),
        "index_median_us": round(float(np.median(idx)), 1),
        "index_p99_us": round(float(np.percentile(idx, 99)), 1),
        "speedup": round(float(np.median(scan) / np.median(idx)), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,8192,32768", help="comma-separated context lengths")
    parser.add_argument("--steps", type=int, default=200, help="decode steps per context")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args()
    rows = [measure(int(c), args.steps) for c in args.contexts.split(",")]
    if args.json:
        print(json.dumps(rows))
        return
    print(f"prompt lookup per decode step (k={K}, n={MIN_N}..{MAX_N}), one request; medians over {args.steps} steps")
    print("| context | scan µs/step | index µs/step | index p99 µs | scan/index | steps with drafts | index a prompt |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['context']} | {r['scan_median_us']} | {r['index_median_us']} | {r['index_p99_us']} | "
            f"{r['speedup']}× | {r['steps_with_drafts']}/{r['steps']} | {r['prompt_index_ms']} ms |"
        )


if __name__ == "__main__":
    main()
