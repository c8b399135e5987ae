"""Block manager: exact block ids, reference counts, prefix hits and copy-on-write."""

import subprocess
import sys

import pytest

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.block_pool import BlockKey, BlockPool, hash_block
from scheduler.kv_cache_manager import handoff_digests

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def make(num_blocks=8, block_size=4, **kw):
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=64,
            **kw,
        )
    )


def step(s, token=7):
    batch = s.schedule()
    s.update(batch, [token] * batch.num_seqs)
    s.check_integrity()
    return batch


def refs(s):
    return {b.block_id: b.ref_count for b in s.kv.pool.blocks if b.ref_count}


def test_allocation_is_lazy_and_wastes_under_one_block():
    s = make()
    s.add_request(Request("a", list(range(10)), GREEDY))
    batch = step(s)
    assert s.kv.block_ids("a") == [1, 2, 3]  # 10 tokens: two full blocks and one partial
    assert batch.slot_mapping.tolist() == [4 + i for i in range(4)] + [8 + i for i in range(4)] + [12, 13]
    step(s)  # token 11 goes into block 3, still no new block
    assert s.kv.block_ids("a") == [1, 2, 3]


def test_prefix_hit_reuses_cached_blocks_after_the_owner_finished():
    s = make()
    s.add_request(Request("a", list(range(10)), GREEDY.replace(max_tokens=1)))
    step(s)
    assert not s.has_unfinished and s.kv.num_free_blocks == 7
    # Free order is least recently freed first; a's blocks went back last block first.
    assert list(s.kv.pool.free) == [4, 5, 6, 7, 3, 2, 1]
    s.add_request(Request("b", list(range(8)) + [50, 51, 52], GREEDY))
    batch = s.schedule()
    assert s.kv.block_ids("b") == [1, 2, 4]  # two cached blocks, one fresh
    assert batch.input_ids.tolist() == [50, 51, 52]  # only the uncached tokens run
    assert batch.positions.tolist() == [8, 9, 10]
    assert s.requests["b"].num_cached_tokens == 8


def test_a_full_cached_prompt_still_computes_its_last_token():
    s = make()
    s.add_request(Request("a", list(range(8)), GREEDY.replace(max_tokens=1)))
    step(s)
    s.add_request(Request("b", list(range(8)), GREEDY))
    batch = s.schedule()
    assert batch.input_ids.tolist() == [4, 5, 6, 7]  # block 2 is recomputed, so a logit exists
    assert s.kv.block_ids("b")[0] == 1


def test_digest_collision_is_not_a_hit():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.register(block, b"d", BlockKey(None, (1, 2)))
    assert pool.lookup(b"d", BlockKey(None, (1, 2))) is block
    assert pool.lookup(b"d", BlockKey(None, (9, 9))) is None
    assert pool.lookup(b"d", BlockKey(block.prefix_id + 1, (1, 2))) is None  # same tokens, other prefix
    assert pool.lookup(b"d", BlockKey(None, (1, 2), ("salt",))) is None


def test_digests_are_chained_and_keyed():
    a = hash_block(None, (1, 2, 3))
    assert a == hash_block(None, (1, 2, 3)) and len(a) == 32
    assert hash_block(a, (4,)) != hash_block(hash_block(None, (9, 2, 3)), (4,))
    assert hash_block(None, (1, 2, 3), ("x",)) != a
    assert hash_block(None, (1, 2, 3)) != hash_block(None, (1, 2, 3 + 2**32))  # ids are not truncated


def run_alone(tokens, block_size=4, salt=None):
    s = make(num_blocks=32, block_size=block_size)
    s.add_request(Request("x", tokens, GREEDY.replace(max_tokens=1), cache_salt=salt))
    step(s)
    return s


@pytest.mark.parametrize("digest", ["real", "constant"])
def test_a_shared_last_block_never_shares_kv_across_different_prefixes(monkeypatch, digest):
    """The CVE-2025-25183 shape: prompts equal in their last full block but not before.
    Even with every digest forced equal, the second prompt finds no cached block."""
    if digest == "constant":
        monkeypatch.setattr("scheduler.kv_cache_manager.hash_block", lambda *args: b"same")
    s = make(num_blocks=32)
    tail = [40, 41, 42, 43]
    s.add_request(Request("a", [1, 2, 3, 4] + tail + [9], GREEDY.replace(max_tokens=1)))
    step(s)
    s.add_request(Request("b", [5, 6, 7, 8] + tail + [9], GREEDY.replace(max_tokens=1)))
    batch = s.schedule()
    assert s.requests["b"].num_cached_tokens == 0
    assert batch.input_ids.tolist() == [5, 6, 7, 8] + tail + [9]
    assert not set(s.kv.block_ids("b")) & {1, 2}, "b must not hold a's blocks"
    s.update(batch, [7])
    # The same prefix again is still a hit (through a collision-ridden index when constant).
    s.add_request(Request("a2", [1, 2, 3, 4] + tail + [11], GREEDY.replace(max_tokens=1)))
    s.schedule()
    if digest == "real":
        assert s.requests["a2"].num_cached_tokens == 8


def test_cache_salt_separates_otherwise_equal_prompts():
    s = make(num_blocks=32)
    prompt = list(range(9))
    for rid, salt in [("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1"), ("d", None)]:
        s.add_request(Request(rid, prompt, GREEDY.replace(max_tokens=1), cache_salt=salt))
        step(s)
    # Only c shares a's salt; b and d (unsalted) recompute everything.
    assert s.prefix_cache_hits == 8
    assert s.prefix_cache_queries == 4 * 9


def test_prefix_cache_counts_each_admission_once():
    """A queue head that waits for blocks is looked up every step, but counted once."""
    s = make(num_blocks=6)  # 5 usable blocks of 4 tokens
    s.add_request(Request("a", list(range(12)), GREEDY.replace(max_tokens=6)))
    step(s)
    s.add_request(Request("b", list(range(12)) + [50, 51, 52, 53, 54], GREEDY.replace(max_tokens=1)))
    for _ in range(3):
        step(s)  # b waits: it needs 2 blocks besides the 3 it shares with a, and a holds 4 of 5
        assert s.waiting[0].request_id == "b"
        assert s.prefix_cache_queries == 12
    while s.has_unfinished:
        step(s)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (12 + 17, 12)


def test_forked_samples_share_the_prompt_and_copy_on_write():
    s = make()
    parent = Request("p", list(range(6)), GREEDY.replace(n=3))
    s.add_request(parent)
    for i in (1, 2):
        s.add_request(Request(f"p#{i}", list(range(6)), GREEDY, fork_of=parent))
    step(s)  # the parent's prompt: blocks 1, 2; then both samples fork onto them
    assert s.kv.block_ids("p") == s.kv.block_ids("p#1") == s.kv.block_ids("p#2") == [1, 2]
    assert refs(s) == {1: 3, 2: 3}
    batch = s.schedule()
    # The parent writes token 6 into shared block 2 -> copy to 3; sample 1 re-runs token 5
    # in block 2 -> copy to 4; sample 2 is then block 2's only holder and writes in place.
    assert batch.block_copies == [(2, 3), (2, 4)]
    assert [s.kv.block_ids(r) for r in ("p", "p#1", "p#2")] == [[1, 3], [1, 4], [1, 2]]
    assert refs(s) == {1: 3, 2: 1, 3: 1, 4: 1}
    assert batch.positions.tolist() == [6, 5, 5]
    s.update(batch, [1, 2, 3])
    s.check_integrity()
    assert [r.output_token_ids for r in (parent, s.requests["p#1"], s.requests["p#2"])] == [[7, 1], [2], [3]]


def test_samples_of_an_aborted_parent_start_from_scratch():
    s = make()
    parent = Request("p", list(range(6)), GREEDY.replace(n=2))
    s.add_request(parent)
    s.add_request(Request("p#1", list(range(6)), GREEDY, fork_of=parent))
    s.abort_request("p")
    batch = s.schedule()
    assert batch.request_ids == ["p#1"] and batch.positions.tolist() == list(range(6))


def test_preemption_takes_the_latest_admitted_and_it_resumes_identically():
    s = make(num_blocks=5)  # 4 usable blocks of 4 tokens
    s.add_request(Request("a", list(range(7)), GREEDY.replace(max_tokens=6)))
    s.add_request(Request("b", list(range(20, 27)), GREEDY.replace(max_tokens=6)))
    step(s)
    assert s.kv.block_ids("a") == [1, 2] and s.kv.block_ids("b") == [3, 4]
    batch = step(s)  # both write position 7, still inside their second block
    assert s.num_preemptions == 0
    batch = s.schedule()  # position 8 needs a third block each: b (latest) is preempted
    assert batch.request_ids == ["a"] and s.num_preemptions == 1
    b = s.waiting[0]
    assert b.request_id == "b" and b.num_computed_tokens == 0 and b.output_token_ids == [7, 7]


def test_pool_too_small_for_the_prompt_is_refused_up_front():
    s = make(num_blocks=3)
    with pytest.raises(ValueError, match="KV cache holds at most 8 tokens"):
        s.add_request(Request("a", list(range(8)), GREEDY))
    with pytest.raises(ValueError, match="context is 64 tokens"):
        make(num_blocks=32).add_request(Request("a", list(range(64)), GREEDY))
    assert make().has_unfinished is False


def test_priority_then_first_come_first_served():
    s = Scheduler(
        SchedulerConfig(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    )
    for rid, priority, t in [("late-low", 1, 3.0), ("early-low", 1, 1.0), ("urgent", 0, 5.0), ("early-low-2", 1, 1.0)]:
        s.add_request(Request(rid, [5, 6], GREEDY, priority=priority, arrival_time=t))
    assert s.schedule().request_ids == ["urgent", "early-low"]  # two slots: priority first, then arrival
    assert [r.request_id for r in s.waiting] == ["early-low-2", "late-low"]  # ties keep insertion order


def test_preemption_spares_the_more_important_request():
    s = make(num_blocks=5)  # 4 usable blocks of 4 tokens
    s.add_request(Request("vip", list(range(7)), GREEDY.replace(max_tokens=6), priority=0, arrival_time=2.0))
    s.add_request(Request("bulk", list(range(20, 27)), GREEDY.replace(max_tokens=6), priority=5, arrival_time=1.0))
    step(s)
    step(s)
    batch = s.schedule()  # both need a third block: the less important one goes, though it came first
    assert batch.request_ids == ["vip"] and s.waiting[0].request_id == "bulk"


def test_handoff_digests_bind_blocks_to_their_prompt_and_salt_in_any_process():
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks of 4 (the last token is always computed)
    digests = handoff_digests(prompt, 4, None, 9)
    assert len(digests) == 3 and handoff_digests(prompt, 4, None, 2) == digests[:2]
    assert handoff_digests(prompt, 4, "salt", 3)[0] != digests[0]
    changed = handoff_digests([*prompt[:5], 99, *prompt[6:]], 4, None, 3)  # block 1 differs: it and all after
    assert changed[0] == digests[0] and changed[1] != digests[1] and changed[2] != digests[2]
    code = f"from scheduler.kv_cache_manager import handoff_digests; print(handoff_digests({prompt}, 4, None, 3))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(digests)  # another process (its own cache key) computes the same
