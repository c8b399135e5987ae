"""The sampler's filters restated by brute force in NumPy: the oracle for the sampler tests
(and `meta`, the sampler's per-row parameters for those tests); and a synthetic target
model whose token distribution the speculative decoding tests compare with (chain and tree
verification alike)."""

import dataclasses

import numpy as np
from scipy import stats

from jaxserve.sample.sampler import SamplingMetadata


def kept_by_documentation(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The filters' documented sets, by brute force in float64 (jaxserve.sample.sampler's docstring):
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


def target_distribution(
    logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """The probabilities a draw must follow: softmax over the documented kept set."""
    z = logits.astype(np.float64) / temperature
    keep = kept_by_documentation(z, top_k, top_p, min_p)
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return p / p.sum()


def meta(n, **fields):
    f, i = np.zeros(n, np.float32), np.zeros(n, np.int32)
    base = dict(
        temperature=f + 1,
        top_p=f + 1,
        top_k=i,
        min_p=f,
        presence_penalty=f,
        frequency_penalty=f,
        repetition_penalty=f + 1,
        seeds=seed_words(np.arange(n)),
        sample_index=i,
        output_index=i,
        banned_token_ids=np.zeros((n, 4), np.int32),
        ban=np.zeros(n, bool),
        want_logprobs=np.bool_(False),
    )
    for key, value in fields.items():
        base[key] = (
            np.broadcast_to(np.asarray(value, base[key].dtype), base[key].shape).copy()
            if key not in ("history", "history_lens", "prompt_lens", "want_logprobs", "banned_token_ids", "seeds")
            else np.asarray(value)
        )
    return SamplingMetadata(**base)


def seed_words(seeds) -> np.ndarray:
    """64-bit seeds as the sampler's (high, low) uint32 words."""
    seeds = np.asarray(seeds, np.uint64)
    return np.stack([seeds >> np.uint64(32), seeds & np.uint64(0xFFFFFFFF)], axis=-1).astype(np.uint32)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# --------------------------------------------------------------------------------------
# A synthetic target and draft model, and the distribution of what generation emits
# --------------------------------------------------------------------------------------


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def penalized(z, history, num_prompt, presence, frequency, repetition):
    """The penalties by their definition (sampler.apply_penalties' docstring), one row."""
    z = z.astype(np.float64).copy()
    output = list(history[num_prompt:])
    for t in set(history):  # repetition: prompt and output
        z[t] = z[t] / repetition if z[t] > 0 else z[t] * repetition
    for t in set(output):  # presence and frequency: output only
        z[t] -= frequency * output.count(t) + presence
    return z


def draw(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of `probs` (float64, rows sum to about 1), by inverting the CDF."""
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(len(probs)) * cdf[:, -1]
    return (u[:, None] >= cdf).sum(-1)  # zero-mass tokens have empty intervals


V = 6
LENGTH = 3  # tokens generated per stream: the joint law of (x1, x2) and of (x1, x2, x3) is tested
PROMPT = [4, 1]  # only penalties see it: the model tables do not depend on the prompt
STOP = 2  # banned while min_tokens is not reached


def _model_tables():
    """Target logits for x1, x2 | x1, x_t | x_{t-2}, x_{t-1}, and the draft model's
    probabilities in the same shape. Some tokens the target never produces (-inf logits),
    the draft proposes; some the draft never proposes, the target produces."""
    rng = np.random.default_rng(20240601)
    a = np.arange(V)
    t1 = rng.normal(0, 1.2, V)
    t1[5] = -np.inf
    t2 = rng.normal(0, 1.2, (V, V))
    t2[a, (a + 1) % V] = -np.inf
    t3 = rng.normal(0, 1.2, (V, V, V))
    t3[a[:, None], a[None, :], (a[:, None] + 2 * a[None, :] + 1) % V] = -np.inf
    q1 = softmax(rng.normal(0, 1.5, V))
    q1[0] = 0.0
    q2 = softmax(rng.normal(0, 1.5, (V, V)))
    q2[a, (a + 2) % V] = 0.0
    q3 = softmax(rng.normal(0, 1.5, (V, V, V)))
    q3[a[:, None], a[None, :], (a[:, None] + a[None, :]) % V] = 0.0
    target = tuple(t.astype(np.float32) for t in (t1, t2, t3))
    draft = tuple(q / q.sum(-1, keepdims=True) for q in (q1, q2, q3))
    return target, draft


TARGET, DRAFT = _model_tables()
# Logits at positions past a row's drafts (or outside its pruned tree): nothing may be drawn from them.
IGNORED_POSITION = np.where(np.arange(V) == 5, 40.0, 0.0).astype(np.float32)


def table_rows(tables, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Each row's next-token row of `tables` given its first `lengths` tokens."""
    rows = np.arange(len(tokens))
    last = tokens[rows, np.maximum(lengths - 1, 0)]
    before = tokens[rows, np.maximum(lengths - 2, 0)]
    first, second, later = tables
    return np.where(
        (lengths == 0)[:, None], first[None, :], np.where((lengths == 1)[:, None], second[last], later[before, last])
    )


@dataclasses.dataclass(frozen=True)
class Setting:
    temperature: float = 1.0
    top_k: int = 0
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_tokens: int = 0

    @property
    def penalties(self) -> bool:
        return (self.presence, self.frequency, self.repetition) != (0.0, 0.0, 1.0)

    def target(self, context: tuple[int, ...]) -> np.ndarray:
        """p(. | context), in float64 NumPy: table logits, penalties, the min_tokens ban,
        then temperature and top-k (`target_distribution`)."""
        tokens = np.array([list(context) + [0, 0]])
        z = table_rows(TARGET, tokens, np.array([len(context)]))[0].astype(np.float64)
        if self.penalties:
            z = penalized(z, PROMPT + list(context), len(PROMPT), self.presence, self.frequency, self.repetition)
        if len(context) < self.min_tokens:
            z[STOP] = -np.inf
        return target_distribution(z, self.temperature, self.top_k)


def joint_target(setting: Setting) -> np.ndarray:
    """P(x1, x2, x3) = p(x1) p(x2 | x1) p(x3 | x1, x2). [V, V, V]"""
    joint = np.zeros((V, V, V))
    p1 = setting.target(())
    for x1 in range(V):
        p2 = setting.target((x1,))
        for x2 in range(V):
            joint[x1, x2] = p1[x1] * p2[x2] * setting.target((x1, x2))
    return joint


def chi_square(observed: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """p-value of `observed` counts against len * probs, cells expected fewer than 5 times
    pooled; and how many samples fell in zero-probability cells (skipped by the test)."""
    observed, probs = observed.ravel(), probs.ravel()
    impossible = int(observed[probs == 0].sum())
    expected = probs[probs > 0] * observed.sum() / probs[probs > 0].sum()
    observed = observed[probs > 0]
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    return float(stats.chisquare(observed, expected).pvalue), impossible


@dataclasses.dataclass
class Fit:
    p_pairs: float  # (x1, x2) against p(x1) p(x2 | x1)
    p_triples: float  # (x1, x2, x3)
    impossible: int  # streams with a zero-probability (x1, x2, x3)


def goodness_of_fit(generated: np.ndarray, setting: Setting) -> Fit:
    """How well each stream's first LENGTH tokens ([streams, LENGTH]) follow the target."""
    joint = joint_target(setting)
    counts = np.zeros((V, V, V), np.int64)
    np.add.at(counts, tuple(generated.T), 1)
    p_pairs, impossible_pairs = chi_square(counts.sum(-1), joint.sum(-1))
    p_triples, impossible = chi_square(counts, joint)
    assert impossible >= impossible_pairs
    return Fit(p_pairs, p_triples, impossible)


SETTINGS = {
    "plain": Setting(),
    "temperature-top-k": Setting(temperature=0.7, top_k=4),
    "penalties-min-tokens": Setting(temperature=0.9, presence=0.8, frequency=0.4, repetition=1.5, min_tokens=2),
}
