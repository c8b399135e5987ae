"""The control channel between nodes (jaxserve.parallel.multihost), in one process: a peer
without the shared key is refused; a follower whose fingerprint differs is refused at
connect, both ends naming the setting; a frame that is not plain data stops a follower
before anything of it runs; a step a follower does not finish in time stops the group,
naming the node and the step. (A dict stands in for jax's coordination service here;
tests/api/test_multihost.py runs the real one.)"""

import dataclasses
import pickle
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener

import numpy as np
import pytest

from jaxserve.parallel.frames import Codec, FrameError
from jaxserve.parallel.multihost import CONTROL_KEY, DistConfig, DistError, Follower, Leader

KEY = b"k" * 32
FINGERPRINT = {"weights": "abc", "max_num_batched_tokens": 32, "jax": "0.12"}


@dataclasses.dataclass
class Plan:
    ids: np.ndarray


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


class Runner:
    """Stands where the follower's ModelRunner does."""

    def __init__(self):
        self.plans, self.kv, self.broadcast = [], None, None

    def execute(self, plan):
        self.plans.append(plan)
        return None, None


def node(rank: int, **kw) -> DistConfig:
    return DistConfig(nnodes=2, node_rank=rank, init_addr="127.0.0.1:1", key=KEY, **{"heartbeat_timeout": 5, **kw})


def in_thread(fn):
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def control_address(store) -> tuple[str, int]:
    host, port = store.blocking_key_value_get(CONTROL_KEY, 10_000).rsplit(":", 1)
    return host, int(port)


def test_a_peer_without_the_key_is_refused_and_the_follower_still_joins_and_runs_the_plans():
    store = KeyValueStore()

    def peers():
        with pytest.raises(AuthenticationError):
            Client(control_address(store), authkey=b"a guess, not the key")
        return Follower(node(1), store, FINGERPRINT)

    thread, result = in_thread(peers)
    leader = Leader(node(0), store, FINGERPRINT)
    thread.join(30)
    assert "error" not in result and list(leader.peers) == [1]
    assert CONTROL_KEY in store.values and KEY.decode() not in str(store.values)  # the key is never published
    runner = Runner()
    leader.lead(runner, [Plan])
    runner.broadcast(Plan(np.arange(3, dtype=np.int32)))
    leader.stop()
    follower_runner = Runner()
    result["value"].follow(follower_runner, [Plan])  # runs the plan, then returns on the leader's stop
    assert [p.ids.tolist() for p in follower_runner.plans] == [[0, 1, 2]]


def test_a_follower_with_another_setting_is_refused_at_connect_and_both_name_it():
    store = KeyValueStore()
    theirs = {**FINGERPRINT, "max_num_batched_tokens": 64}
    thread, result = in_thread(lambda: Follower(node(1), store, theirs))
    with pytest.raises(DistError) as leader_error:
        Leader(node(0), store, FINGERPRINT)
    thread.join(30)
    message = "max_num_batched_tokens: node 0 has 32, node 1 has 64"
    assert message in str(leader_error.value)
    assert isinstance(result.get("error"), DistError) and message in str(result["error"])


def test_a_frame_that_is_not_plain_data_stops_the_follower_before_any_of_it_runs(tmp_path):
    store = KeyValueStore()
    listener = Listener(("127.0.0.1", 0), authkey=KEY)
    store.key_value_set(CONTROL_KEY, f"127.0.0.1:{listener.address[1]}")
    thread, result = in_thread(lambda: Follower(node(1), store, FINGERPRINT))
    conn = listener.accept()  # an authenticated leader gone bad
    assert Codec().decode(conn.recv_bytes()).kind == "hello"
    conn.send_bytes(Codec().encode("welcome"))
    thread.join(30)
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    conn.send_bytes(pickle.dumps(Exploit()))
    runner = Runner()
    with pytest.raises(FrameError):
        result["value"].follow(runner, [Plan])
    assert not marker.exists() and runner.plans == []
    conn.close()
    listener.close()


def test_a_step_a_follower_does_not_finish_in_time_stops_the_group_naming_node_and_step():
    store = KeyValueStore()
    codec = Codec()

    def hung_follower():  # heartbeats, acknowledges step 1, never step 2
        conn = Client(control_address(store), authkey=KEY)
        conn.send_bytes(codec.encode("hello", {"rank": 1, "fingerprint": FINGERPRINT}))
        assert codec.decode(conn.recv_bytes()).kind == "welcome"
        conn.recv_bytes()  # step 1
        conn.send_bytes(codec.encode("ack", {"step": 1}))
        for _ in range(100):
            conn.send_bytes(codec.encode("alive"))
            time.sleep(0.1)

    thread, _ = in_thread(hung_follower)
    leader = Leader(node(0, step_timeout=0.5), store, FINGERPRINT)
    failures = []
    leader.on_failure = failures.append
    runner = Runner()
    leader.lead(runner, [Plan])
    runner.broadcast(Plan(np.zeros(2, np.int32)))  # a new shape: ten times the bound, while it compiles
    deadline = time.monotonic() + 10
    while leader.peers[1].unacked and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not failures and not leader.peers[1].unacked
    sent = time.monotonic()
    runner.broadcast(Plan(np.ones(2, np.int32)))  # the same shape: the step bound
    while not failures and time.monotonic() < sent + 10:
        time.sleep(0.05)
    waited = time.monotonic() - sent
    assert failures and "node 1 of 2 did not finish step 2 within 0.5 s" in failures[0], failures
    assert 0.5 <= waited < 3
