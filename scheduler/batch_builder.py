"""Turn the scheduler's decisions (which requests, how many tokens) into a `StepBatch`."""

from __future__ import annotations

import numpy as np

from scheduler.request import Request
from scheduler.step_batch import MAX_BANNED_TOKENS, SamplingBatch, StepBatch


def build_step_batch(
    rows: list[tuple[Request, int]], tables: list[list[int]], block_size: int, copies: list[tuple[int, int]]
) -> StepBatch:
    """`rows`: (request, number of its tokens to run) in row order; `tables`: their block ids."""
    counts = np.fromiter((n for _, n in rows), np.int32, len(rows))
    query_start_loc = np.zeros(len(rows) + 1, np.int32)
    np.cumsum(counts, out=query_start_loc[1:])
    starts = np.fromiter((r.num_computed_tokens for r, _ in rows), np.int32, len(rows))

    input_ids = np.empty(int(query_start_loc[-1]), np.int32)
    for (req, n), start, lo in zip(rows, starts, query_start_loc):
        input_ids[lo : lo + n] = token_slice(req, int(start), int(start) + n)
    # positions: start of each row, plus 0..n-1 within the row
    row_of_token = np.repeat(np.arange(len(rows)), counts)
    positions = starts[row_of_token] + (np.arange(len(input_ids)) - query_start_loc[row_of_token])

    width = max(len(t) for t in tables)
    block_tables = np.zeros((len(rows), width), np.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = t
    slot_mapping = block_tables[row_of_token, positions // block_size] * block_size + positions % block_size

    return StepBatch(
        request_ids=[r.request_id for r, _ in rows],
        num_scheduled_tokens=counts,
        input_ids=input_ids,
        positions=positions.astype(np.int32),
        slot_mapping=slot_mapping.astype(np.int32),
        query_start_loc=query_start_loc,
        seq_lens=starts + counts,
        block_tables=block_tables,
        logits_indices=query_start_loc[1:] - 1,
        sampling=build_sampling_batch([r for r, _ in rows]),
        block_copies=copies,
    )


def token_slice(req: Request, start: int, end: int) -> list[int]:
    """req.all_token_ids[start:end] without concatenating prompt and output."""
    p = req.num_prompt_tokens
    if start >= p:
        return req.output_token_ids[start - p : end - p]
    if end <= p:
        return req.prompt_token_ids[start:end]
    return req.prompt_token_ids[start:] + req.output_token_ids[: end - p]


def build_sampling_batch(requests: list[Request]) -> SamplingBatch:
    params = [r.sampling_params for r in requests]

    def column(name, dtype):
        return np.fromiter((getattr(p, name) for p in params), dtype, len(params))

    banned = np.zeros((len(requests), MAX_BANNED_TOKENS), np.int32)
    ban = np.zeros(len(requests), bool)
    for i, (r, p) in enumerate(zip(requests, params)):
        if r.num_output_tokens < p.min_tokens:
            ids = banned_token_ids(r)
            banned[i] = ids[0]  # repeats of a real id are harmless; the rest overwrite
            banned[i, : len(ids)] = ids
            ban[i] = bool(ids)
    batch = SamplingBatch(
        temperature=column("temperature", np.float32),
        top_p=column("top_p", np.float32),
        top_k=column("top_k", np.int32),
        min_p=column("min_p", np.float32),
        presence_penalty=column("presence_penalty", np.float32),
        frequency_penalty=column("frequency_penalty", np.float32),
        repetition_penalty=column("repetition_penalty", np.float32),
        seeds=np.fromiter((r.seed for r in requests), np.uint32, len(requests)),
        output_index=np.fromiter((r.num_output_tokens for r in requests), np.int32, len(requests)),
        banned_token_ids=banned,
        ban=ban,
        num_logprobs=max((p.logprobs or 0) for p in params),
    )
    if any(p.uses_penalties for p in params):
        width = max(r.num_tokens for r in requests)
        batch.history = np.zeros((len(requests), width), np.int32)
        for i, r in enumerate(requests):
            batch.history[i, : r.num_tokens] = r.all_token_ids
        batch.history_lens = np.fromiter((r.num_tokens for r in requests), np.int32, len(requests))
        batch.prompt_lens = np.fromiter((r.num_prompt_tokens for r in requests), np.int32, len(requests))
    return batch


def banned_token_ids(req: Request) -> list[int]:
    """Tokens that may not be sampled before min_tokens: the ones that would stop the request."""
    p = req.sampling_params
    eos = () if p.ignore_eos else req.eos_token_ids
    return list(dict.fromkeys([*eos, *p.stop_token_ids]))
