"""The sampler's filters restated by brute force in NumPy: the oracle for the sampler tests."""

import numpy as np


def kept_by_documentation(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The filters' documented sets, by brute force in float64 (jaxserve.sampler's docstring):
    top-k keeps every logit >= the k-th largest; top-p keeps every token of that set whose
    strictly more likely tokens have mass < p; min-p keeps probabilities >= min_p * the largest."""
    z = z.astype(np.float64)
    vocab = len(z)
    keep = np.ones(vocab, bool)
    if 0 < top_k < vocab:
        keep = z >= np.sort(z)[::-1][top_k - 1]
    q = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    q /= q.sum()
    if top_p < 1:
        keep = keep & np.array([q[z > z[v]].sum() < top_p for v in range(vocab)])
    if min_p > 0:
        r = np.where(keep, q, 0.0)
        keep = keep & (r >= min_p * r.max())
    return keep


def target_distribution(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                        min_p: float = 0.0) -> np.ndarray:
    """The probabilities a draw must follow: softmax over the documented kept set."""
    z = logits.astype(np.float64) / temperature
    keep = kept_by_documentation(z, top_k, top_p, min_p)
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return p / p.sum()
