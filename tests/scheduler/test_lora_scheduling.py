"""LoRA on the host: the slot LRU, admission that waits for a slot, per-token slots, and a
prefix cache that rows of different adapters never share."""

import numpy as np
import pytest

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.lora_slots import LoRASlots

GREEDY = SamplingParams(temperature=0, max_tokens=2)


def make(max_loras=2, **kw):
    config = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(SchedulerConfig(**{**config, **kw}, max_loras=max_loras))


def step(s):
    batch = s.schedule()
    results = s.update(batch, [7] * batch.num_seqs) if batch is not None else s.update(None)
    s.check_integrity()
    return batch, results


def test_slots_are_reused_least_recently_used_first_and_never_while_pinned():
    slots = LoRASlots(2)
    assert (slots.acquire(10), slots.acquire(20)) == (1, 2)
    assert slots.take_loads() == [(1, 10), (2, 20)]
    assert slots.acquire(10) == 1 and slots.take_loads() == []  # resident: nothing to load
    assert not slots.can_acquire(30) and slots.acquire(30) is None  # both pinned
    slots.release(20)
    slots.release(10)
    slots.release(10)
    slots.acquire(10)  # 10 used again: 20 is now the least recently used
    slots.release(10)
    assert slots.acquire(30) == 2 and slots.take_loads() == [(2, 30)]
    assert slots.resident == {10: 1, 30: 2}
    slots.check_integrity()


def test_a_request_waits_for_a_slot_and_every_one_completes():
    """Three adapters, two slots: the third adapter's request waits (not admitted, not
    failed) until a slot has no running request, then runs; the loads say what to copy."""
    s = make(max_loras=2)
    for rid, lora in [("a", 1), ("b", 2), ("c", 3), ("d", None)]:
        s.add_request(Request(rid, [5, 6, 7], GREEDY, lora_id=lora))
    batch, _ = step(s)
    assert batch.request_ids == ["a", "b"]  # c waits for a slot, d (first come first served) behind it
    assert batch.lora_loads == [(1, 1), (2, 2)]
    assert batch.lora_slots.tolist() == [1, 1, 1, 2, 2, 2]
    assert [r.request_id for r in s.waiting] == ["c", "d"]
    done, loads = set(), []
    while s.has_unfinished:
        batch, results = step(s)
        if batch is not None:
            loads += batch.lora_loads
            for rid, lo, hi in zip(batch.request_ids, batch.query_start_loc[:-1], batch.query_start_loc[1:]):
                lora = {"a": 1, "b": 2, "c": 3, "d": None}[rid]
                want = 0 if lora is None else s.lora_slots.resident[lora]
                assert set(batch.lora_slots[lo:hi].tolist()) == {want}
        done |= {r.request.request_id for r in results if r.request.is_finished}
    assert done == {"a", "b", "c", "d"}
    assert loads == [(1, 3)]  # c took a's slot, the least recently used


def test_a_request_with_an_adapter_needs_lora_enabled():
    s = make(max_loras=0)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        s.add_request(Request("a", [1, 2], GREEDY, lora_id=1))


@pytest.mark.parametrize("digest", ["real", "constant"])
def test_rows_of_different_adapters_never_share_prefix_cache_blocks(monkeypatch, digest):
    """Same prompt under adapter 1, adapter 2, the base model and adapter 1 again: only the
    last finds cached blocks, even with every digest forced equal (the key decides a hit)."""
    if digest == "constant":
        monkeypatch.setattr("scheduler.kv_cache_manager.hash_block", lambda *args: b"same")
    s = make(max_loras=2)
    prompt = list(range(13))
    blocks = {}
    for rid, lora, salt in [("a", 1, None), ("b", 2, None), ("c", None, None), ("d", None, "x"), ("e", 1, None)]:
        s.add_request(Request(rid, prompt, GREEDY.replace(max_tokens=1), lora_id=lora, cache_salt=salt))
        batch = s.schedule()
        blocks[rid] = set(s.kv.block_ids(rid))
        s.update(batch, [7])
        s.check_integrity()
    assert not blocks["b"] & blocks["a"] and not blocks["c"] & (blocks["a"] | blocks["b"])
    assert not blocks["d"] & (blocks["a"] | blocks["b"] | blocks["c"])
    assert not blocks["e"] & (blocks["b"] | blocks["c"] | blocks["d"])
    if digest == "real":  # the same adapter again: a's three full blocks are a hit
        assert len(blocks["e"] & blocks["a"]) == 3 and s.prefix_cache_hits == 12


def test_lora_off_adds_nothing_to_the_batch():
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16))
    s.add_request(Request("a", [1, 2, 3], GREEDY))
    batch = s.schedule()
    assert batch.lora_slots is None and batch.lora_loads == [] and s.lora_slots is None
    assert np.array_equal(batch.input_ids, [1, 2, 3])
