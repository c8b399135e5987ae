"""On-device sampling with per-sequence parameters, vectorized over the batch.

Order of operations (vLLM's): the structured-output grammar's bitmask (tokens it forbids
at -inf), then the token bias on those logits (logit_bias added, allowed_token_ids and bad
words' banned tokens at -inf), then penalties, then the tokens banned until `min_tokens`,
then greedy argmax or temperature, top-k, top-p and min-p and a draw. Logprobs are those
of the model's output after the grammar's mask only (a row without a grammar: the raw
output), computed only when some row asks for them. Each row draws from its own random stream,
`fold_in(fold_in(key(seed), sample_index), output_index)`, so a request's samples never
depend on the batch, and the `n` samples of one seed are independent of each other and of
every other seed's samples.

The filters keep exactly these sets, ties included (on the temperature-scaled logits):

- top-k: every token whose logit is at least the k-th largest; a tie at the cut-off keeps
  all tied tokens, so more than k may survive.
- top-p (over what top-k kept, renormalized): every token whose strictly more likely
  tokens have total probability below p; that is the smallest set of most likely tokens
  whose mass reaches p, with every token tied with its least likely member.
- min-p: every token with probability at least min_p times the most likely one's.

A draw is one uniform number per row, inverted through the row's CDF: exact, and far
cheaper on a CPU than one Gumbel variate per vocabulary entry.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.model.fixed_order import in_fixed_row_blocks
from pallas_kernels import cpu_kernels
from scheduler.sampling_params import SamplingParams

MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS  # top logprobs are always computed this wide, then cut per request


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingMetadata:
    """Device copy of `scheduler.SamplingBatch`, padded to the sequence bucket S."""

    temperature: jax.Array  # f32 [S]
    top_p: jax.Array  # f32 [S]
    top_k: jax.Array  # i32 [S]
    min_p: jax.Array  # f32 [S]
    presence_penalty: jax.Array  # f32 [S]
    frequency_penalty: jax.Array  # f32 [S]
    repetition_penalty: jax.Array  # f32 [S]
    seeds: jax.Array  # u32 [S, 2]: a 64-bit seed as a threefry key's two words (high, low)
    sample_index: jax.Array  # i32 [S]: which of the request's n samples
    output_index: jax.Array  # i32 [S]
    banned_token_ids: jax.Array  # i32 [S, B]
    ban: jax.Array  # bool [S]
    want_logprobs: jax.Array  # bool []: some row asked for logprobs (else none are computed)
    # None when no sequence uses penalties or a token bias (a separately compiled variant,
    # so requests without them pay nothing for them).
    history: jax.Array | None = None  # i32 [S, W]
    history_lens: jax.Array | None = None  # i32 [S]
    prompt_lens: jax.Array | None = None  # i32 [S]
    token_bias: jax.Array | None = None  # f32 [S, V]: added to the raw logits (`step_batch.token_bias_matrix`)
    # Structured output: bit j of word i allows token 32 * i + j (llguidance's layout); rows
    # without a grammar are all ones. In the same variant as token_bias.
    token_bitmask: jax.Array | None = None  # i32 [S, ceil(V / 32)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerOutput:
    token_ids: jax.Array  # i32 [S]
    logprobs: jax.Array  # f32 [S]: log-probability of the sampled token (zeros unless want_logprobs)
    top_logprob_ids: jax.Array  # i32 [S, min(MAX_LOGPROBS, V)] (zeros unless want_logprobs)
    top_logprobs: jax.Array  # f32 [S, min(MAX_LOGPROBS, V)]


def sample(logits: jax.Array, meta: SamplingMetadata, *, row_block: int = 0) -> SamplerOutput:
    """logits: f32 [S, V] straight from the model. `row_block`: all of it in blocks of exactly
    that many rows, so that no row's sums depend on how many rows there are (batch invariance,
    jaxserve.model.fixed_order)."""
    if row_block:
        return _sample_in_row_blocks(logits, meta, row_block)
    logits = apply_grammar_mask(logits, meta)
    raw_logits = logits
    logits = adjust_logits(logits, meta)
    greedy = greedy_argmax(logits)
    token_ids = jax.lax.cond(
        jnp.all(meta.temperature == 0),
        lambda: greedy,
        lambda: jnp.where(meta.temperature == 0, greedy, _draw(logits, meta)),
    )
    # NOTE: a normalizer over the whole vocabulary, which costs about as much as the rest of
    # the sampler: only computed when some row asks for logprobs.
    chosen, top_ids, top_values = jax.lax.cond(
        meta.want_logprobs,
        lambda: logprob_tables(raw_logits, token_ids),
        lambda: no_logprob_tables(*logits.shape),
    )
    return SamplerOutput(token_ids, chosen, top_ids, top_values)


def _sample_in_row_blocks(logits: jax.Array, meta: SamplingMetadata, rows: int) -> SamplerOutput:
    """`sample` on blocks of `rows` rows: meta's per-row arrays are cut with the logits (padding
    rows are greedy), its scalars (want_logprobs) go whole to every block."""
    leaves, treedef = jax.tree.flatten(meta)
    per_row = [i for i, leaf in enumerate(leaves) if leaf.ndim and leaf.shape[0] == logits.shape[0]]

    def one_block(block_logits, *block_leaves):
        block = list(leaves)
        for i, leaf in zip(per_row, block_leaves):
            block[i] = leaf
        return sample(block_logits, jax.tree.unflatten(treedef, block))

    return in_fixed_row_blocks(one_block, logits, *(leaves[i] for i in per_row), rows=rows)


def logprob_tables(raw_logits: jax.Array, token_ids: jax.Array, *, row_block: int = 0):
    """Per row of raw_logits f32 [S, V]: log_softmax at token_ids i32 [S], and the top
    MAX_LOGPROBS ids and values. `row_block`: in blocks of exactly that many rows, so that a
    row's sums do not depend on how many rows there are (jaxserve.model.fixed_order)."""
    width = min(MAX_LOGPROBS, raw_logits.shape[-1])

    def tables(logits, tokens):
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        values, ids = jax.lax.top_k(logprobs, width)
        chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=1)[:, 0]
        return chosen, ids.astype(jnp.int32), values

    if row_block:
        return in_fixed_row_blocks(tables, raw_logits, token_ids, rows=row_block)
    return tables(raw_logits, token_ids)


def no_logprob_tables(rows: int, vocab: int):
    """`logprob_tables`' zeros, for steps where no row asks for logprobs."""
    width = min(MAX_LOGPROBS, vocab)
    return jnp.zeros(rows), jnp.zeros((rows, width), jnp.int32), jnp.zeros((rows, width))


def adjust_logits(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """The token bias, penalties, then the tokens banned until min_tokens: greedy is the
    argmax of these. (Rows without a bias or penalties add zeros and divide by one: their
    logits are unchanged, bit for bit.)"""
    if meta.token_bias is not None:
        logits = logits + meta.token_bias
    if meta.history is not None:
        logits = apply_penalties(logits, meta)
    # NOTE: a compare against the few banned ids, not a scatter: XLA fuses it into what reads
    # the logits next, where a scatter copied the whole [S, V] array every step.
    banned = jnp.where(meta.ban[:, None], meta.banned_token_ids, logits.shape[1])  # V: no token
    token = jnp.arange(logits.shape[1], dtype=banned.dtype)
    is_banned = (token[None, :, None] == banned[:, None, :]).any(axis=-1)
    return jnp.where(is_banned, -jnp.inf, logits)


def greedy_argmax(logits: jax.Array) -> jax.Array:
    """i32 [S]: `jnp.argmax(logits, axis=-1)`, bit for bit (the first maximum; the first NaN
    in a row that has one). On the CPU, where its kernels are built, the C++ kernel
    (`cpu_kernels.greedy_argmax`); elsewhere reductions and a compare that XLA fuses: its CPU
    argmax reduces (value, index) pairs, 3-6x slower on [64, 49152] (issue 39's profile), and
    beside the sampler's draw XLA's CPU compiles these reductions slowly too (4.8 against
    0.7 ms on [48, 49152] when alone)."""
    if cpu_kernels.is_built() and logits.ndim == 2 and logits.dtype == jnp.float32:
        return jax.lax.platform_dependent(logits, cpu=cpu_kernels.greedy_argmax, default=_greedy_argmax)
    return _greedy_argmax(logits)


def _greedy_argmax(logits: jax.Array) -> jax.Array:
    vocab = logits.shape[-1]
    nan = jnp.isnan(logits)
    # NOTE: the NaN rows apart: XLA's vectorized CPU max can miss a NaN in a row's tail.
    top = jnp.max(logits, axis=-1, keepdims=True)
    hit = jnp.where(nan.any(axis=-1, keepdims=True), nan, logits == top)
    return jnp.min(jnp.where(hit, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def apply_grammar_mask(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Tokens the row's grammar forbids at -inf. First of all, before the logprobs too (as
    vLLM: a constrained request's logprobs are the model's over what the grammar allows)."""
    if meta.token_bitmask is None:
        return logits
    return jnp.where(unpack_bitmask(meta.token_bitmask, logits.shape[1]), logits, -jnp.inf)


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """bool [S, V] from a packed i32 [S, W] mask: token t is allowed iff bit t % 32 of word t // 32 is set."""
    token = jnp.arange(vocab_size)
    words = bitmask[:, token // 32]
    return (jnp.right_shift(words, (token % 32).astype(jnp.int32)) & 1) != 0


def apply_penalties(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Repetition penalty over prompt and output; presence and frequency over output only."""
    num_seqs, vocab = logits.shape
    pos = jnp.arange(meta.history.shape[1])[None, :]
    in_history = pos < meta.history_lens[:, None]
    is_output = in_history & (pos >= meta.prompt_lens[:, None])
    rows = jnp.broadcast_to(jnp.arange(num_seqs)[:, None], meta.history.shape)
    tokens = jnp.where(in_history, meta.history, vocab)  # padding lands out of range: dropped
    seen = jnp.zeros((num_seqs, vocab), bool).at[rows, tokens].set(True, mode="drop")
    counts = jnp.zeros((num_seqs, vocab), jnp.float32).at[rows, tokens].add(is_output.astype(jnp.float32), mode="drop")

    rep = meta.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - meta.frequency_penalty[:, None] * counts
    return logits - meta.presence_penalty[:, None] * (counts > 0)


def _draw(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    return invert_cdf(probabilities(logits, meta), draw_uniforms(meta))


def probabilities(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """The distribution a row draws from: temperature, then top-k, top-p and min-p, on
    adjusted logits (`adjust_logits`). f32 [S, V]."""
    temperature = jnp.where(meta.temperature > 0, meta.temperature, 1.0)
    logits = logits / temperature[:, None]
    needs_filter = jnp.any((meta.top_k > 0) | (meta.top_p < 1) | (meta.min_p > 0))
    logits = jax.lax.cond(needs_filter, _filter, lambda logits, meta: logits, logits, meta)
    return jax.nn.softmax(logits, axis=-1)


def draw_uniforms(meta: SamplingMetadata, stream: int | None = None) -> jax.Array:
    """One uniform number in [0, 1) per row from its own stream; `stream` picks an
    independent one from the same key (speculative decoding's acceptance tests)."""
    keys = jax.vmap(sample_key)(meta.seeds, meta.sample_index, meta.output_index)
    if stream is not None:
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, stream)
    return jax.vmap(jax.random.uniform)(keys)


def invert_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """The token each row's uniform `u` picks from `probs` (rows need not be normalized)."""
    cdf = jnp.cumsum(probs, axis=-1)
    # The first token whose CDF passes u; zero-probability tokens span empty intervals.
    token = jax.vmap(lambda c, x: jnp.searchsorted(c, x, side="right"))(cdf, u * cdf[:, -1])
    return jnp.minimum(token, probs.shape[-1] - 1).astype(jnp.int32)


def sample_key(seed: jax.Array, sample_index: jax.Array, output_index: jax.Array) -> jax.Array:
    """The key of one draw. For a seed below 2**32, `key(seed)` has the data [0, seed]."""
    key = jax.random.wrap_key_data(seed.astype(jnp.uint32))
    return jax.random.fold_in(jax.random.fold_in(key, sample_index), output_index)


def _filter(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Mask out what top-k, then top-p, then min-p exclude (rows with them off keep all).

    Sorting a whole vocabulary row is slow (about 4 ms on a CPU core for 49k entries), so
    the cut-off is first looked for among the FILTER_CANDIDATES largest logits; only if
    some row's kept set reaches past them is the batch sorted in full. Exact either way.
    """
    vocab = logits.shape[1]
    candidates = jax.lax.top_k(logits, min(FILTER_CANDIDATES, vocab))[0]  # [S, n], descending
    threshold, resolved = _cutoff(candidates, logits, meta)
    threshold = jax.lax.cond(
        jnp.all(resolved), lambda: threshold, lambda: _cutoff(-jnp.sort(-logits, axis=-1), logits, meta)[0]
    )
    logits = jnp.where(logits >= threshold[:, None], logits, -jnp.inf)

    probs = jax.nn.softmax(logits, axis=-1)
    floor = meta.min_p[:, None] * probs.max(axis=-1, keepdims=True)
    return jnp.where(probs >= floor, logits, -jnp.inf)


FILTER_CANDIDATES = 256


def _cutoff(head: jax.Array, logits: jax.Array, meta: SamplingMetadata) -> tuple[jax.Array, jax.Array]:
    """The smallest logit top-k and top-p keep, from `head`, the n largest logits of each
    row in descending order; and whether that is certain (the kept set is known from the head).

    NOTE: ranks are positions in `head`, so tied logits have consecutive ranks; the
    threshold is a logit value and keeps every tie of the last kept rank.
    """
    n, vocab = head.shape[1], logits.shape[1]
    whole_row = n == vocab
    k = jnp.where(meta.top_k > 0, jnp.minimum(meta.top_k, vocab), vocab)
    has_top_k = k < vocab
    # The top-k set K: every logit >= the k-th largest (known when k <= n).
    t_k = jnp.where(has_top_k, jnp.take_along_axis(head, jnp.minimum(k, n)[:, None] - 1, axis=-1)[:, 0], -jnp.inf)
    in_top_k = head >= t_k[:, None]
    # Top-p renormalizes over K: known if K is the whole vocabulary, or if K lies in the head
    # (nothing outside the head ties with its smallest member).
    k_in_head = whole_row | ((k <= n) & (head[:, -1] < t_k))
    norm = jnp.where(
        has_top_k[:, None],
        jax.nn.logsumexp(jnp.where(in_top_k, head, -jnp.inf), axis=-1, keepdims=True),
        jax.nn.logsumexp(logits, axis=-1, keepdims=True),
    )
    probs = jnp.where(in_top_k, jnp.exp(head - norm), 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    top_p = meta.top_p[:, None]
    has_top_p = meta.top_p < 1
    # A rank is kept if the mass ranked before it is below p; the first of a tie group has
    # exactly its strictly-more-likely mass before it, so whole groups are kept or cut.
    keep = in_top_k & ((mass_before < top_p) | ~has_top_p[:, None])  # rank 0 is always kept
    num_kept = keep.sum(axis=-1)
    threshold = jnp.take_along_axis(head, num_kept[:, None] - 1, axis=-1)[:, 0]
    resolved = jnp.where(
        has_top_k,
        (k <= n) & (~has_top_p | k_in_head),
        ~has_top_p | whole_row | (num_kept < n),  # without top-k, the top-p cut must fall inside the head
    )
    no_filter = ~has_top_k & ~has_top_p
    return jnp.where(no_filter, -jnp.inf, threshold), resolved | no_filter
