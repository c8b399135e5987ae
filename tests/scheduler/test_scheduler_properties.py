"""Property tests: random adds, steps, aborts and stops never break the scheduler's books."""

import contextlib
from unittest import mock

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import Request, RequestStatus, SamplingParams, Scheduler, SchedulerConfig

EOS = 3

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(1, 3), st.integers(0, 2), st.booleans()
        ),
        st.tuples(st.just("step"), st.integers(0, 2**31 - 1)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("stop"), st.integers(0, 1000)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    max_seqs=st.integers(1, 6),
    budget_extra=st.integers(0, 16),
    chunk=st.integers(0, 8),
    prefix_caching=st.booleans(),
)
def test_random_operations_keep_the_books(ops, num_blocks, block_size, max_seqs, budget_extra, chunk, prefix_caching):
    cfg = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_seqs + budget_extra,
        max_model_len=64,
        long_prefill_token_threshold=chunk,
        enable_prefix_caching=prefix_caching,
    )
    s = Scheduler(cfg)
    added, ended = [], set()
    shared_prefix = [5, 6, 7, 8, 9, 10, 11, 12]
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, n, priority, share = op
            prompt = (shared_prefix if share else []) + [20 + (len(added) + i) % 50 for i in range(length)]
            params = SamplingParams(temperature=0, max_tokens=max_tokens, n=n)
            parent = Request(f"r{len(added)}", prompt, params, eos_token_ids=(EOS,), priority=priority)
            group = [parent] + [
                Request(
                    f"{parent.request_id}#{i}", prompt, params, eos_token_ids=(EOS,), priority=priority, fork_of=parent
                )
                for i in range(1, n)
            ]
            for req in group:
                try:
                    s.add_request(req)
                    added.append(req)
                except ValueError:
                    assert s.kv.blocks_needed(len(prompt) + 1) > num_blocks - 1 or len(prompt) >= 64
                    ended.add(req.request_id)
        elif op[0] == "step":
            run_step(s, cfg, np.random.default_rng(op[1]))
        elif added:
            req = added[op[1] % len(added)]
            if op[0] == "abort":
                s.abort_request(req.request_id)
            else:
                s.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop_reason="x")
        s.check_integrity()

    # Drain: everything finishes, and every block comes back.
    for _ in range(2000):
        if not s.has_unfinished:
            break
        run_step(s, cfg, np.random.default_rng(0))
        s.check_integrity()
    assert not s.has_unfinished
    assert all(r.is_finished for r in added)
    assert s.kv.num_free_blocks == num_blocks - 1
    for r in added:
        if r.status == RequestStatus.FINISHED_LENGTH:
            outgrew_cache = r.num_tokens > (num_blocks - 1) * block_size
            assert r.num_output_tokens == r.sampling_params.max_tokens or r.num_tokens >= 64 or outgrew_cache


def run_step(s, cfg, rng):
    batch = s.schedule()
    if batch is None:
        assert not s.running, "running requests but nothing scheduled"
        return
    assert batch.num_tokens <= cfg.max_num_batched_tokens
    assert batch.num_seqs <= cfg.max_num_seqs
    assert len(set(batch.request_ids)) == batch.num_seqs
    # Every token lands in a block its sequence holds, in a distinct slot.
    for i, rid in enumerate(batch.request_ids):
        lo, hi = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        blocks = s.kv.block_ids(rid)
        assert set(batch.slot_mapping[lo:hi] // cfg.block_size) <= set(blocks)
        assert hi - lo <= (cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens)
    assert len(set(batch.slot_mapping.tolist())) == batch.num_tokens
    tokens = rng.integers(0, 8, batch.num_seqs)  # sometimes EOS
    s.update(batch, tokens)


DIGESTS = {
    "real": None,
    "constant": lambda parent, tokens, extra=(): b"x",  # every block collides with every other
    "last-token": lambda parent, tokens, extra=(): bytes([tokens[-1] % 4]),  # collisions across prefixes
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1, max_size=8),
    salts=st.lists(st.sampled_from([None, "s1", "s2"]), min_size=8, max_size=8),
    digest=st.sampled_from(sorted(DIGESTS)),
    block_size=st.sampled_from([1, 2, 3]),
    num_blocks=st.integers(6, 30),
    max_tokens=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_cache_hit_holds_the_whole_prefix(prompts, salts, digest, block_size, num_blocks, max_tokens, seed):
    """A shadow KV cache records, for every slot written, the whole token prefix ending at
    that slot (and the writer's salt). Each step, every context slot a sequence reads must
    hold exactly its own prefix: a hit on the last block alone would show as a mismatch."""
    patch = (
        mock.patch("scheduler.kv_cache_manager.hash_block", DIGESTS[digest])
        if DIGESTS[digest]
        else contextlib.nullcontext()
    )
    cfg = SchedulerConfig(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=3, max_num_batched_tokens=8, max_model_len=64
    )
    rng = np.random.default_rng(seed)
    with patch:
        s = Scheduler(cfg)
        shadow: dict[int, tuple] = {}
        pending = [
            Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens), cache_salt=salts[i])
            for i, p in enumerate(prompts)
        ]
        for _ in range(500):
            if pending and rng.random() < 0.5:
                req = pending.pop(0)
                try:
                    s.add_request(req)
                except ValueError:
                    pass  # longer than the whole cache
            batch = s.schedule()
            if batch is None:
                s.update(None)
                if not pending and not s.has_unfinished:
                    break
                continue
            for src, dst in batch.block_copies:
                for off in range(block_size):
                    shadow[dst * block_size + off] = shadow.get(src * block_size + off)
            for row, rid in enumerate(batch.request_ids):
                req = s.requests[rid]
                table = s.kv.block_ids(rid)
                start = int(batch.positions[batch.query_start_loc[row]])
                for pos in range(start):
                    slot = table[pos // block_size] * block_size + pos % block_size
                    assert shadow.get(slot) == (req.cache_salt, tuple(req.all_token_ids[: pos + 1])), (
                        f"{rid} reads position {pos} from a slot written for another prefix"
                    )
                for i in range(batch.query_start_loc[row], batch.query_start_loc[row + 1]):
                    pos = int(batch.positions[i])
                    shadow[int(batch.slot_mapping[i])] = (req.cache_salt, tuple(req.all_token_ids[: pos + 1]))
            s.update(batch, rng.integers(0, 4, batch.num_seqs))
            s.check_integrity()
