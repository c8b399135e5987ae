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

import numpy as np

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

    @property
    def all_greedy(self) -> bool:
        return bool(np.all(self.temperature == 0))


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
    tree_mask: np.ndarray | None = None  # int32 [T]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)
