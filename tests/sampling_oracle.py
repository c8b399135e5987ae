"""The sampler's filters restated by brute force in NumPy: the oracle for the sampler tests
(and `meta`, the sampler's per-row parameters for those tests)."""

import numpy as np

from jaxserve.sampler import SamplingMetadata


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


def meta(n, **fields):
    f, i = np.zeros(n, np.float32), np.zeros(n, np.int32)
    base = dict(temperature=f + 1, top_p=f + 1, top_k=i, min_p=f, presence_penalty=f, frequency_penalty=f,
                repetition_penalty=f + 1, seeds=seed_words(np.arange(n)), sample_index=i, output_index=i,
                banned_token_ids=np.zeros((n, 4), np.int32), ban=np.zeros(n, bool), want_logprobs=np.bool_(False))
    for key, value in fields.items():
        base[key] = np.broadcast_to(np.asarray(value, base[key].dtype), base[key].shape).copy() \
            if key not in ("history", "history_lens", "prompt_lens", "want_logprobs", "banned_token_ids", "seeds") \
            else np.asarray(value)
    return SamplingMetadata(**base)


def seed_words(seeds) -> np.ndarray:
    """64-bit seeds as the sampler's (high, low) uint32 words."""
    seeds = np.asarray(seeds, np.uint64)
    return np.stack([seeds >> np.uint64(32), seeds & np.uint64(0xFFFFFFFF)], axis=-1).astype(np.uint32)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)
