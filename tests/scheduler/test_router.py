"""The prefix-aware data-parallel router: spreading, stickiness, the load bound, eviction."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.router import NoReplicaAvailable, PrefixRouter, Route, chain_digests

BS = 4  # block size used by most tests


def prompt(*blocks: int, tail: tuple[int, ...] = ()) -> list[int]:
    """A prompt of full blocks, block b being [b, b, b, b], plus a partial tail."""
    return [t for b in blocks for t in [b] * BS] + list(tail)


def test_distinct_prompts_with_equal_loads_go_round_robin():
    router = PrefixRouter(num_replicas=3, block_size=BS, load_bound=4)
    routes = [router.pick(prompt(100 + k), [0, 0, 0]) for k in range(6)]
    assert [r.replica for r in routes] == [0, 1, 2, 0, 1, 2]
    assert all(r == Route(r.replica, 0, "least_loaded") for r in routes)


def test_distinct_prompts_go_to_the_least_loaded():
    router = PrefixRouter(num_replicas=4, block_size=BS, load_bound=4)
    assert router.pick(prompt(1), [5, 2, 7, 3]).replica == 1
    # Two replicas tie for least loaded: they alternate.
    assert [router.pick(prompt(10 + k), [3, 1, 2, 1]).replica for k in range(4)] == [3, 1, 3, 1]


def test_a_shared_prefix_goes_back_to_the_same_replica():
    router = PrefixRouter(num_replicas=3, block_size=BS, load_bound=4)
    first = router.pick(prompt(1, 2, 3), [0, 0, 0])
    router.pick(prompt(50), [0, 0, 0])  # moves the round-robin cursor past `first`
    again = router.pick(prompt(1, 2, 9, 9, tail=(7,)), [0, 0, 0])
    assert again == Route(first.replica, 2, "prefix")
    assert router.pick(prompt(1, 2, 3, 4), [0, 0, 0]) == Route(first.replica, 3, "prefix")


def test_the_whole_prefix_counts_not_only_its_first_blocks():
    # Two replicas saw the same 20-block head (a long system prompt); only one saw the turn after it.
    router = PrefixRouter(num_replicas=2, block_size=BS, load_bound=0)
    head = list(range(1, 21))
    assert router.pick(prompt(*head, 30), [0, 1]).replica == 0
    assert router.pick(prompt(*head, 40), [1, 0]).replica == 1
    assert router.pick(prompt(*head, 40, 41), [0, 0]) == Route(1, 21, "prefix")
    assert router.pick(prompt(*head, 30, 31), [0, 0]) == Route(0, 21, "prefix")


def test_chain_digests_chain_every_chunk_and_start_from_the_salt():
    chunks = [b"system prompt", b"first turn", b"second turn"]
    digests = chain_digests(chunks)
    assert chain_digests(chunks[:2]) == digests[:2] and len(set(digests)) == 3
    assert chain_digests([b"other", *chunks[1:]])[1:] != digests[1:]  # a chunk's digest covers its parents
    assert not set(chain_digests(chunks, cache_salt="a")) & set(digests)
    router = PrefixRouter(num_replicas=2, block_size=1, load_bound=0)
    assert router.pick_digests(digests[:2], [1, 0]).replica == 1
    assert router.pick_digests(digests, [0, 0]) == Route(1, 2, "prefix")


def test_the_longer_match_wins_then_the_lower_load_then_the_lower_index():
    router = PrefixRouter(num_replicas=3, block_size=BS, load_bound=10)
    assert router.pick(prompt(1, 2), [5, 0, 5]).replica == 1
    assert router.pick(prompt(1, 3), [0, 20, 20]) == Route(0, 0, "least_loaded")  # 1 is over the bound
    # Replica 0 saw block 1, replica 1 saw blocks 1, 2: the longer match wins over a lower load.
    assert router.pick(prompt(1, 2, 5), [0, 5, 0]) == Route(1, 2, "prefix")
    assert router.pick(prompt(1, 7), [3, 2, 0]) == Route(1, 1, "prefix")
    assert router.pick(prompt(1, 8), [2, 2, 0]) == Route(0, 1, "prefix")


def test_a_shared_prefix_sticks_within_the_load_bound_then_overflows():
    router = PrefixRouter(num_replicas=2, block_size=BS, load_bound=2)
    p = prompt(1, 2)
    assert router.pick(p, [0, 0]).replica == 0
    assert router.pick(p, [2, 0]) == Route(0, 2, "prefix")  # 2 <= 0 + 2
    assert router.pick(p, [5, 3]) == Route(0, 2, "prefix")  # 5 <= 3 + 2
    assert router.pick(p, [3, 0]) == Route(1, 0, "least_loaded")  # 3 > 0 + 2
    # Now both replicas saw it: the less loaded one is the best match.
    assert router.pick(p, [3, 0]) == Route(1, 2, "prefix")


def test_a_zero_load_bound_sticks_only_to_a_least_loaded_replica():
    router = PrefixRouter(num_replicas=2, block_size=BS, load_bound=0)
    p = prompt(1)
    assert router.pick(p, [0, 0]).replica == 0
    assert router.pick(p, [1, 1]) == Route(0, 1, "prefix")
    assert router.pick(p, [2, 1]) == Route(1, 0, "least_loaded")


def test_a_different_cache_salt_never_matches():
    router = PrefixRouter(num_replicas=2, block_size=BS, load_bound=4)
    p = prompt(1, 2)
    assert router.pick(p, [0, 0], cache_salt="a").replica == 0
    assert router.pick(p, [0, 0], cache_salt="b") == Route(1, 0, "least_loaded")
    assert router.pick(p, [0, 0]) == Route(0, 0, "least_loaded")  # no salt is a salt of its own
    assert router.pick(p, [0, 0], cache_salt="a") == Route(0, 2, "prefix")
    assert router.pick(p, [0, 0], cache_salt="b") == Route(1, 2, "prefix")


def test_a_prompt_shorter_than_a_block_matches_nothing():
    router = PrefixRouter(num_replicas=2, block_size=BS, load_bound=4)
    short = [1, 2, 3]
    assert router.pick(short, [0, 0]) == Route(0, 0, "least_loaded")
    assert router.pick(short, [0, 0]) == Route(1, 0, "least_loaded")
    assert router.pick([], [0, 0]) == Route(0, 0, "least_loaded")


def test_a_partial_last_block_does_not_count():
    router = PrefixRouter(num_replicas=2, block_size=BS, load_bound=4)
    assert router.pick(prompt(1, tail=(5, 6, 7)), [0, 0]).replica == 0
    # The same prompt again: one full block, the tail is not a block.
    assert router.pick(prompt(1, tail=(5, 6, 7)), [0, 0]) == Route(0, 1, "prefix")
    # Completing the tail into a second block: only the first block was ever seen.
    assert router.pick(prompt(1, tail=(5, 6, 7, 8)), [0, 0]) == Route(0, 1, "prefix")
    assert router.pick(prompt(1, tail=(5, 6, 7, 9)), [0, 0]) == Route(0, 1, "prefix")
    assert router.pick(prompt(1, tail=(5, 6, 7, 8, 0)), [0, 0]) == Route(0, 2, "prefix")


def test_only_the_first_max_prefix_blocks_are_tracked():
    router = PrefixRouter(num_replicas=2, block_size=BS, load_bound=4, max_prefix_blocks=2)
    assert router.pick(prompt(1, 2, 3, 4), [0, 0]).replica == 0
    assert router.pick(prompt(1, 2, 3, 4), [0, 0]) == Route(0, 2, "prefix")
    assert router.pick(prompt(1, 2, 8), [0, 0]) == Route(0, 2, "prefix")


def test_a_dead_replica_is_never_picked_even_with_the_best_match():
    router = PrefixRouter(num_replicas=3, block_size=BS, load_bound=100)
    p = prompt(1, 2)
    assert router.pick(p, [0, 0, 0]).replica == 0
    assert router.pick(p, [None, 5, 0]) == Route(2, 0, "least_loaded")
    assert router.pick(p, [None, 0, 0]) == Route(2, 2, "prefix")


def test_all_dead_raises():
    router = PrefixRouter(num_replicas=2, block_size=BS, load_bound=1)
    with pytest.raises(NoReplicaAvailable, match="dead"):
        router.pick(prompt(1), [None, None])
    assert issubclass(NoReplicaAvailable, RuntimeError)


def test_forget_drops_a_replicas_prefixes():
    router = PrefixRouter(num_replicas=2, block_size=BS, load_bound=4)
    p, q = prompt(1, 2), prompt(3)
    assert router.pick(p, [0, 0]).replica == 0
    assert router.pick(q, [0, 0]).replica == 1
    router.forget(0)
    assert router.pick(p, [0, 0]) == Route(0, 0, "least_loaded")
    assert router.pick(q, [0, 0]) == Route(1, 1, "prefix")  # the other replica is untouched
    with pytest.raises(ValueError):
        router.forget(2)


def test_old_prefixes_are_evicted_least_recently_used_first():
    router = PrefixRouter(num_replicas=1, block_size=1, load_bound=0, max_digests=2, max_prefix_blocks=1)
    router.pick([1], [0])
    router.pick([2], [0])
    assert router.pick([1], [0]).matched_blocks == 1  # touches [1]: [2] is now the oldest
    router.pick([3], [0])
    assert router.pick([2], [0]) == Route(0, 0, "least_loaded")  # evicted
    assert router.pick([3], [0]) == Route(0, 1, "prefix")


def test_eviction_keeps_a_prompts_leading_blocks():
    router = PrefixRouter(num_replicas=1, block_size=1, load_bound=0, max_digests=2, max_prefix_blocks=4)
    router.pick([1, 2, 3, 4], [0])
    assert router.pick([1, 2, 3, 4], [0]).matched_blocks == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_replicas=0, block_size=4, load_bound=0),
        dict(num_replicas=1, block_size=0, load_bound=0),
        dict(num_replicas=1, block_size=4, load_bound=-1),
        dict(num_replicas=1, block_size=4, load_bound=0, max_digests=0),
        dict(num_replicas=1, block_size=4, load_bound=0, max_prefix_blocks=0),
    ],
)
def test_bad_arguments_are_rejected(kwargs):
    with pytest.raises(ValueError):
        PrefixRouter(**kwargs)


def test_loads_must_cover_every_replica():
    with pytest.raises(ValueError):
        PrefixRouter(num_replicas=2, block_size=BS, load_bound=0).pick(prompt(1), [0])


# Prompts from a few short shared prefixes, so matches are common.
prompts = st.lists(st.integers(0, 2), min_size=0, max_size=10)
loads_st = st.lists(st.one_of(st.none(), st.integers(0, 6)), min_size=3, max_size=3)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.tuples(prompts, loads_st, st.sampled_from([None, "s"])), min_size=1, max_size=30),
    block_size=st.integers(1, 3),
    load_bound=st.integers(0, 3),
    max_digests=st.integers(1, 6),
)
def test_routes_respect_liveness_and_the_load_bound(steps, block_size, load_bound, max_digests):
    router = PrefixRouter(3, block_size, load_bound, max_digests=max_digests, max_prefix_blocks=3)
    for prompt_ids, loads, salt in steps:
        alive = [i for i, load in enumerate(loads) if load is not None]
        if not alive:
            with pytest.raises(NoReplicaAvailable):
                router.pick(prompt_ids, loads, salt)
            continue
        min_load = min(loads[i] for i in alive)
        route = router.pick(prompt_ids, loads, salt)
        assert loads[route.replica] is not None
        num_blocks = min(3, len(prompt_ids) // block_size)
        assert 0 <= route.matched_blocks <= num_blocks
        if route.reason == "prefix":
            assert route.matched_blocks > 0 and loads[route.replica] <= min_load + load_bound
        else:
            assert route.reason == "least_loaded" and loads[route.replica] == min_load
        # Sent straight back with nothing changed, the prompt sticks to a replica that has it.
        again = router.pick(prompt_ids, loads, salt)
        assert again.matched_blocks == min(num_blocks, max_digests)
        assert again.reason == ("prefix" if again.matched_blocks else "least_loaded")
