"""The control connection between nodes (jaxserve.parallel.multihost), in one process: a peer without
the leader's key is refused, and the leader still takes its followers. (A dict stands in for
jax's coordination service here; tests/api/test_multihost.py runs the real one.)"""

import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest

from jaxserve.parallel.multihost import DistConfig, Follower, Leader


class KeyValueStore:
    def __init__(self):
        self.values = {}
        self.published = threading.Event()

    def key_value_set(self, key, value):
        self.values[key] = value
        self.published.set()

    def blocking_key_value_get(self, key, timeout_ms):
        assert self.published.wait(timeout_ms / 1000)
        return self.values[key]


class Recorder:
    """Stands where the follower's engine does."""

    def __init__(self):
        self.calls = []

    def step(self):
        self.calls.append("step")


def node(rank: int) -> DistConfig:
    return DistConfig(nnodes=2, node_rank=rank, init_addr="127.0.0.1:1", heartbeat_timeout=5)


def test_a_peer_without_the_key_is_refused_and_the_follower_still_joins():
    store = KeyValueStore()
    results = {}

    def peers():
        address, _ = store.blocking_key_value_get("jaxserve/control", 10_000).split()
        host, port = address.rsplit(":", 1)
        with pytest.raises(AuthenticationError):
            Client((host, int(port)), authkey=b"a guess")
        results["refused"] = True
        results["follower"] = Follower(node(1), store)

    thread = threading.Thread(target=peers)
    thread.start()
    leader = Leader(node(0), store)
    thread.join(30)
    assert results["refused"] and list(leader.followers) == [1]
    leader.send("step")
    leader.stop()
    engine = Recorder()
    results["follower"].follow(engine)  # replays the step, then returns on the leader's stop
    assert engine.calls == ["step"]
