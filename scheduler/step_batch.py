"""What the scheduler hands the model runner for one step: plain NumPy, no padding.

The runner pads T (tokens) and S (sequences) up to its compiled buckets. Layout of the
flat token axis for three sequences, a prefill chunk of 3 and two decodes:

    input_ids        [ a0 a1 a2 | b7 | c4 ]
    positions        [  0  1  2 |  7 |  4 ]
    query_start_loc  [0,         3,   4,   5]
    seq_lens         [  3,        8,   5   ]   context after this step
    logits_indices   [  2,        3,   4   ]   each sequence's last new token
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from scheduler.sampling_params import SamplingParams

MAX_BANNED_TOKENS = 16  # eos + stop_token_ids suppressed while min_tokens is not reached


@dataclasses.dataclass
class SamplingBatch:
    """Per-sequence sampling parameters, one row per scheduled sequence."""

    temperature: np.ndarray  # float32 [S]; 0 = greedy
    top_p: np.ndarray  # float32 [S]
    top_k: np.ndarray  # int32 [S]; 0 = off
    min_p: np.ndarray  # float32 [S]
    presence_penalty: np.ndarray  # float32 [S]
    frequency_penalty: np.ndarray  # float32 [S]
    repetition_penalty: np.ndarray  # float32 [S]
    seeds: np.ndarray  # uint32 [S, 2]: each 64-bit seed as (high, low) words
    sample_index: np.ndarray  # int32 [S]: which of its request's n samples a row is
    output_index: np.ndarray  # int32 [S]: index of the token being sampled (RNG stream position)
    banned_token_ids: np.ndarray  # int32 [S, MAX_BANNED_TOKENS]: masked out where `ban` is set
    ban: np.ndarray  # bool [S]
    want_logprobs: bool  # some sequence asked for logprobs
    num_logprobs: int  # the most top logprobs any sequence asked for (0: none)
    # Token history for penalties, only when some sequence uses them.
    history: np.ndarray | None = None  # int32 [S, W]: prompt then output tokens, zero padded
    history_lens: np.ndarray | None = None  # int32 [S]
    prompt_lens: np.ndarray | None = None  # int32 [S]
    # logit_bias, allowed_token_ids and bad_words, one entry per row (None: the row has none),
    # only when some sequence uses them; the runner makes it a dense bias over the vocabulary.
    token_bias: list[TokenBias | None] | None = None
    # Structured output: the tokens each row's grammar allows, packed (bit j of word i:
    # token 32 * i + j; rows without a grammar: all ones), only when some row has a grammar.
    token_bitmask: np.ndarray | None = None  # int32 [S, bitmask_words(vocab)]

    @property
    def all_greedy(self) -> bool:
        return bool(np.all(self.temperature == 0))


@dataclasses.dataclass(frozen=True)
class TokenBias:
    """One row's changes to its raw logits for one step: `values` added at `ids`
    (logit_bias); with `allowed`, every other id is banned (allowed_token_ids); `banned`
    ids too (the last tokens of bad words whose other tokens the output ends with)."""

    ids: tuple[int, ...]
    values: tuple[float, ...]
    allowed: tuple[int, ...] | None
    banned: tuple[int, ...]

    @classmethod
    def for_row(cls, params: SamplingParams, output_ids: Sequence[int]) -> TokenBias | None:
        """`params`: the request's SamplingParams; `output_ids`: its output so far (with any
        draft tokens before the position sampled). None when it uses none of these."""
        if not params.uses_token_bias:
            return None
        bias = params.logit_bias or {}
        return cls(
            tuple(bias),
            tuple(bias.values()),
            params.allowed_token_ids,
            tuple(banned_by_bad_words(params.bad_words_token_ids, output_ids)),
        )


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a packed mask over the vocabulary."""
    return (vocab_size + 31) // 32


def banned_by_bad_words(words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """vLLM's rule: a word's last token is banned when the output ends with the rest of it
    (a one-token word: always), so the output never holds a whole word."""
    banned = []
    for word in words:
        prefix = len(word) - 1
        if prefix <= len(output_ids) and (
            prefix == 0 or list(output_ids[len(output_ids) - prefix :]) == list(word[:-1])
        ):
            banned.append(word[-1])
    return banned


def token_bias_matrix(rows: Sequence[TokenBias | None], num_rows: int, vocab_size: int) -> np.ndarray:
    """float32 [num_rows, vocab_size]: what each row adds to its logits (-inf: banned; rows
    past `rows` and rows without a TokenBias: zeros). Ids outside the vocabulary are dropped."""
    matrix = np.zeros((num_rows, vocab_size), np.float32)
    for i, row in enumerate(rows):
        if row is None:
            continue
        if row.allowed is not None:
            matrix[i] = -np.inf
            matrix[i, _inside(row.allowed, vocab_size)] = 0
        ids = np.asarray(row.ids, np.int64)
        inside = ids < vocab_size
        matrix[i, ids[inside]] += np.asarray(row.values, np.float32)[inside]  # ids are distinct (dict keys)
        matrix[i, _inside(row.banned, vocab_size)] = -np.inf
    return matrix


def _inside(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    array = np.asarray(ids, np.int64)
    return array[array < vocab_size]


@dataclasses.dataclass
class StepBatch:
    step_id: int  # increasing; update() finds the step's requests by it
    request_ids: list[str]  # [S] in row order
    num_scheduled_tokens: np.ndarray  # int32 [S]
    input_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    slot_mapping: np.ndarray  # int32 [T]: block_id * block_size + offset
    query_start_loc: np.ndarray  # int32 [S + 1]
    seq_lens: np.ndarray  # int32 [S]
    block_tables: np.ndarray  # int32 [S, max_blocks in this step]
    logits_indices: np.ndarray  # int32 [S]
    samples: np.ndarray  # bool [S]: the row reaches the end of its request, so its sampled token is real
    # Tokens sampled by the step still in flight (overlapped loop): input_ids[pending_tokens[i]]
    # is that step's sampled token of row pending_rows[i], taken on the device.
    pending_tokens: np.ndarray  # int32 [P]: positions on the flat token axis
    pending_rows: np.ndarray  # int32 [P]: rows of the step in flight
    sampling: SamplingBatch
    block_copies: list[tuple[int, int]]  # (src, dst) copy-on-write copies, done before the step
    # Speculative decoding: a row's last num_spec_tokens[i] tokens are draft tokens to verify.
    num_spec_tokens: np.ndarray  # int32 [S]
    spec_token_ids: np.ndarray  # int32 [S, N]: the drafts in the tree's BFS order, zero padded (N: its nodes)
    verify: SamplingBatch | None = None  # [S * (N + 1)] rows, one per tree position (a chain: k + 1); None: no drafts
    # Speculating with a tree (not a chain): each token's attention word (see
    # ragged_paged_attention_reference's tree_mask): -1, or for a tree's tokens their ancestors.
    tree_mask: np.ndarray | None = None  # int32 [T, W]: W words a token (DraftTree.mask_words)
    # Prompt logprobs: per token, the prompt token that follows it, whose logprob the step
    # reports (-1: none wanted); None when no row wants any.
    prompt_logprob_targets: np.ndarray | None = None  # int32 [T]
    num_prompt_logprobs: int = 0  # the most top alternatives any of them asked for
    # LoRA (only when enabled): each token's adapter slot (0: the base model), and the slots
    # filled for this step, (slot, adapter id), whose weights go to the device before it runs.
    lora_slots: np.ndarray | None = None  # int32 [T]
    lora_loads: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)
