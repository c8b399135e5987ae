"""Turn the scheduler's decisions (which requests, how many tokens) into a `StepBatch`."""

from __future__ import annotations

import numpy as np

from scheduler.draft_tree import DraftTree
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.step_batch import MAX_BANNED_TOKENS, SamplingBatch, StepBatch, TokenBias


def build_step_batch(
    step_id: int,
    rows: list[tuple[Request, int]],
    tables: list[list[int]],
    block_size: int,
    copies: list[tuple[int, int]],
    tree: DraftTree | None = None,
) -> StepBatch:
    """`rows`: (request, number of its tokens to run) in row order; `tables`: their block ids.

    Built before the rows' counters advance: a row starts at its `num_computed_tokens`,
    and its last `len(request.spec_token_ids)` tokens are draft tokens to verify: the first
    nodes of `tree` in BFS order (a chain unless speculating with a tree). With drafts in
    the step, the sampling rows are per tree position (`SamplingBatch.verify`). A draft's
    K/V go to the next slot, but its position (RoPE) is its depth past the row's decode
    token, and a tree's drafts see only their ancestors (`tree_mask`).
    """
    num_seqs = len(rows)
    counts = np.fromiter((n for _, n in rows), np.int32, num_seqs)
    starts = np.fromiter((r.num_computed_tokens for r, _ in rows), np.int32, num_seqs)
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    np.cumsum(counts, out=query_start_loc[1:])

    ids: list[int] = []
    pending_tokens, pending_rows = [], []
    for req, n in rows:
        start = req.num_computed_tokens
        n -= len(req.spec_token_ids)
        known = req.all_token_ids[start : start + n]
        ids += known
        if len(known) < n:  # its last token was sampled by the step in flight: the device has it
            assert n - len(known) == 1, "at most one step is in flight"
            pending_tokens.append(len(ids))
            pending_rows.append(req.pending_row)
            ids.append(0)
        ids += req.spec_token_ids
    input_ids = np.array(ids, np.int32)
    # positions: start of each row, plus 0..n-1 within the row
    row_of_token = np.repeat(np.arange(num_seqs), counts)
    positions = starts[row_of_token] + (np.arange(len(input_ids), dtype=np.int32) - query_start_loc[row_of_token])

    width = max(len(t) for t in tables)
    block_tables = np.zeros((num_seqs, width), np.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = t
    slot_mapping = block_tables[row_of_token, positions // block_size] * block_size + positions % block_size
    num_spec = np.fromiter((len(r.spec_token_ids) for r, _ in rows), np.int32, num_seqs)
    spec_token_ids = np.zeros((num_seqs, tree.num_nodes if tree else 0), np.int32)
    tree_mask = None if tree is None or tree.is_chain else np.full((len(input_ids), tree.mask_words), -1, np.int32)
    for i, (r, _) in enumerate(rows):
        m = len(r.spec_token_ids)
        if m:
            assert tree is not None, "draft tokens come with a tree (a chain at least)"
            spec_token_ids[i, :m] = r.spec_token_ids
            end = query_start_loc[i + 1]
            positions[end - m : end] -= np.arange(1, m + 1) - tree.depth[1 : m + 1]  # slot offset -> depth
            if tree_mask is not None:
                tree_mask[end - m - 1 : end] = tree.ancestor_mask[: m + 1]
    requests = [r for r, _ in rows]
    targets = None
    if any(r.needs_prompt_logprobs for r in requests):
        targets = np.full(len(input_ids), -1, np.int32)
        for i, r in enumerate(requests):
            if r.needs_prompt_logprobs:  # tokens at positions p < P - 1 predict prompt[p + 1]
                start, end = int(starts[i]), min(int(starts[i] + counts[i]), r.num_prompt_tokens - 1)
                at = query_start_loc[i]
                targets[at : at + max(end - start, 0)] = r.prompt_token_ids[start + 1 : end + 1]

    return StepBatch(
        step_id=step_id,
        request_ids=[r.request_id for r, _ in rows],
        num_scheduled_tokens=counts,
        input_ids=input_ids,
        positions=positions.astype(np.int32),
        slot_mapping=slot_mapping.astype(np.int32),
        query_start_loc=query_start_loc,
        seq_lens=starts + counts,
        block_tables=block_tables,
        logits_indices=query_start_loc[1:] - 1,
        samples=starts + counts - num_spec == np.fromiter((r.num_tokens for r, _ in rows), np.int32, num_seqs),
        pending_tokens=np.array(pending_tokens, np.int32),
        pending_rows=np.array(pending_rows, np.int32),
        sampling=build_sampling_batch(requests),
        block_copies=copies,
        num_spec_tokens=num_spec,
        spec_token_ids=spec_token_ids,
        verify=build_verify_sampling(requests, tree) if tree is not None and num_spec.any() else None,
        tree_mask=tree_mask,
        prompt_logprob_targets=targets,
        num_prompt_logprobs=max((r.sampling_params.prompt_logprobs or 0) for r in requests if r.needs_prompt_logprobs)
        if targets is not None
        else 0,
    )


def build_sampling_batch(
    requests: list[Request], offsets: list[int] | None = None, extra_history: list[list[int]] | None = None
) -> SamplingBatch:
    """One row per request. `offsets`: the token each row samples is that many after the
    request's next one; `extra_history`: tokens that come before it (draft tokens)."""
    offsets = offsets or [0] * len(requests)
    params = [r.sampling_params for r in requests]
    num = len(requests)
    table = np.array([p.row for p in params], np.float32).reshape(num, len(SamplingParams.ROW_FIELDS))
    columns = dict(zip(SamplingParams.ROW_FIELDS, table.T))

    banned = np.zeros((num, MAX_BANNED_TOKENS), np.int32)
    ban = np.zeros(num, bool)
    for i, (r, p) in enumerate(zip(requests, params)):
        if p.min_tokens and r.num_output_tokens + offsets[i] < p.min_tokens:
            ids = banned_token_ids(r)
            if not ids:  # ignore_eos and no stop_token_ids: nothing to hold back
                continue
            banned[i] = ids[0]  # repeats of a real id are harmless; the rest overwrite
            banned[i, : len(ids)] = ids
            ban[i] = bool(ids)
    batch = SamplingBatch(
        temperature=columns["temperature"],
        top_p=columns["top_p"],
        top_k=columns["top_k"].astype(np.int32),
        min_p=columns["min_p"],
        presence_penalty=columns["presence_penalty"],
        frequency_penalty=columns["frequency_penalty"],
        repetition_penalty=columns["repetition_penalty"],
        seeds=np.array([(r.seed >> 32, r.seed & 0xFFFFFFFF) for r in requests], np.uint32).reshape(num, 2),
        sample_index=np.fromiter((r.sample_index for r in requests), np.int32, num),
        output_index=np.fromiter((r.num_output_tokens + o for r, o in zip(requests, offsets)), np.int32, num),
        banned_token_ids=banned,
        ban=ban,
        want_logprobs=any(p.logprobs is not None for p in params),
        num_logprobs=max((p.logprobs or 0) for p in params),
    )
    if any(p.uses_token_bias for p in params):
        # NOTE: bad words read the output from the host, as penalties do (the engine waits
        # for a pending token of such a request before scheduling it).
        assert all(r.num_pending == 0 for r, p in zip(requests, params) if p.bad_words)
        outputs = [
            r.all_token_ids[r.num_prompt_tokens :] + (extra_history[i] if extra_history else []) if p.bad_words else []
            for i, (r, p) in enumerate(zip(requests, params))
        ]
        batch.token_bias = [TokenBias.for_row(p, out) for p, out in zip(params, outputs)]
    if any(r.grammar is not None for r in requests):
        # NOTE: the grammar follows the output on the host, as penalties do.
        assert all(r.num_pending == 0 for r in requests if r.grammar is not None)
        words = next(r.grammar.bitmask_words for r in requests if r.grammar is not None)
        batch.token_bitmask = np.full((num, words), -1, np.int32)  # rows without a grammar: every token
        for i, r in enumerate(requests):
            if r.grammar is not None:
                r.grammar.fill_bitmask(batch.token_bitmask[i], extra_history[i] if extra_history else ())
    if any(p.uses_penalties for p in params):
        # NOTE: penalties read the whole history from the host, so the engine never
        # schedules a request that uses them while one of its tokens is still pending.
        assert all(r.num_pending == 0 for r, p in zip(requests, params) if p.uses_penalties)
        known = [r.all_token_ids + (extra_history[i] if extra_history else []) for i, r in enumerate(requests)]
        width = max(len(t) for t in known)
        batch.history = np.zeros((num, width), np.int32)
        for i, tokens in enumerate(known):
            batch.history[i, : len(tokens)] = tokens
        batch.history_lens = np.fromiter((len(t) for t in known), np.int32, num)
        batch.prompt_lens = np.fromiter((r.num_prompt_tokens for r in requests), np.int32, num)
    return batch


def build_verify_sampling(requests: list[Request], tree: DraftTree) -> SamplingBatch:
    """Sampling rows for verifying draft tokens: row i * (N + 1) + j samples the token after
    the request's next one and the drafts on the tree's path to position j, exactly as if
    those drafts were its tokens (its RNG stream position, min_tokens, penalty history).
    Positions past a request's drafts repeat its last one."""
    expanded, offsets, history = [], [], []
    paths = tree.path_table
    for r in requests:
        for j in range(tree.num_nodes + 1):
            j = min(j, len(r.spec_token_ids))
            depth = tree.depth[j]
            expanded.append(r)
            offsets.append(int(depth))
            history.append([r.spec_token_ids[node - 1] for node in paths[j, 1 : depth + 1]])
    return build_sampling_batch(expanded, offsets, history)


def banned_token_ids(req: Request) -> list[int]:
    """Tokens that may not be sampled before min_tokens: the ones that would stop the request."""
    p = req.sampling_params
    eos = () if p.ignore_eos else req.eos_token_ids
    return list(dict.fromkeys([*eos, *p.stop_token_ids]))
