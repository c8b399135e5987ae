"""One model over several hosts: `--nnodes N --node-rank R --dist-init-addr HOST:PORT`.

jax's multi-controller runtime (`jax.distributed`) makes every node's devices one global
set, and the tensor-parallel mesh spans them all: every node runs the same jitted step on
its own shards, and the collectives inside it cross hosts. Each node therefore has to
dispatch exactly the same steps in the same order. As in SGLang, every node builds the same
engine; node 0 (the leader) owns the requests (the API, the CLI's output) and sends each
engine call that changes state (`add_request`, `abort_request`, `step`) to the others (the
followers), which replay them in order. The schedulers stay identical, so so do the steps.
A request without a seed gets one on the leader: every node must draw the same tokens.

The calls travel over one control connection per follower (`multiprocessing.connection`,
authenticated with a key the leader hands out through jax's coordination service, on the
coordinator's interface). A node cannot go on without the others (the mesh's collectives
would wait forever), so a lost node stops them all with a message naming it:

- each follower sends a heartbeat every `heartbeat_timeout / 5` seconds; the leader stops
  when one closes its connection or misses its heartbeats for `heartbeat_timeout` seconds;
- a follower stops when the leader's connection closes (or jax's coordination client stops
  it first: the coordinator lives in node 0's process, and its client aborts when it goes).

jax's own coordination service notices a lost node too, but only after its 100 s heartbeat
timeout, and then aborts with a C++ stack trace; ours is shorter and says what happened.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import sys
import threading
import traceback
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

logger = logging.getLogger(__name__)

CONTROL_KEY = "jaxserve/control"  # where the leader publishes its control address and key
STOP = "stop"
HEARTBEAT = "alive"


@dataclasses.dataclass(frozen=True)
class DistConfig:
    nnodes: int = 1
    node_rank: int = 0
    init_addr: str | None = None  # HOST:PORT of jax's coordinator, on node 0
    heartbeat_timeout: float = 10.0  # seconds without a follower's heartbeat before the leader stops

    def __post_init__(self):
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and (not self.init_addr or ":" not in self.init_addr):
            raise ValueError(
                f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (node 0's coordinator "
                f"address), got {self.init_addr!r}"
            )
        if self.heartbeat_timeout <= 0:
            raise ValueError(f"the heartbeat timeout must be positive, got {self.heartbeat_timeout}")

    @property
    def enabled(self) -> bool:
        return self.nnodes > 1

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    def local_devices(self, tensor_parallel_size: int) -> int:
        """Each node's share of the mesh's devices."""
        if tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"--tensor-parallel-size {tensor_parallel_size} must split evenly over --nnodes "
                f"{self.nnodes}: every node holds the same number of the mesh's devices"
            )
        return tensor_parallel_size // self.nnodes


def start(config: DistConfig, tensor_parallel_size: int) -> Leader | Follower:
    """Join the other nodes (blocks until all have) and open the control connections.
    Call it before anything starts jax's backends. On the CPU each node gets its share of
    `tensor_parallel_size` devices and gloo collectives."""
    import jax

    # On the CPU exactly this node's share (never $JAX_NUM_CPU_DEVICES); a GPU host has its own.
    jax.config.update("jax_num_cpu_devices", config.local_devices(tensor_parallel_size))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info("node %d of %d: joining %s", config.node_rank, config.nnodes, config.init_addr)
    # jax's own heartbeat stays longer than ours, so ours is the one that reports a lost node.
    jax.distributed.initialize(
        config.init_addr,
        num_processes=config.nnodes,
        process_id=config.node_rank,
        heartbeat_timeout_seconds=max(100, int(4 * config.heartbeat_timeout)),
    )
    if jax.device_count() != tensor_parallel_size:
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size} must cover every node's devices: "
            f"{config.nnodes} nodes hold {jax.device_count()} ({jax.local_device_count()} here)"
        )
    from jax._src.distributed import global_state  # NOTE: the coordination service's key-value store

    if config.is_leader:
        return Leader(config, global_state.client)
    return Follower(config, global_state.client)


def fatal(message: str) -> None:
    """Stop this node now: its collectives can never finish without the lost node."""
    print(f"jaxserve: {message}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(1)


class Leader:
    """Node 0's end: sends the engine calls to every follower and watches their heartbeats."""

    def __init__(self, config: DistConfig, kv_store):
        self.config = config
        self.stopping = False
        host = config.init_addr.rsplit(":", 1)[0]
        key = secrets.token_bytes(32)
        listener = Listener((host, 0), authkey=key)
        address = ":".join(map(str, listener.address))
        kv_store.key_value_set(CONTROL_KEY, f"{address} {key.hex()}")
        self.followers: dict[int, Connection] = {}
        accepting = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        accepting.start()
        accepting.join(timeout=4 * config.heartbeat_timeout + 30)
        if len(self.followers) != config.nnodes - 1:
            missing = sorted(set(range(1, config.nnodes)) - set(self.followers))
            fatal(f"node(s) {missing} did not connect to the leader's control address {address}")
        listener.close()
        for rank, conn in self.followers.items():
            threading.Thread(target=self._watch, args=(rank, conn), daemon=True, name=f"watch-node-{rank}").start()
        logger.info("leader: %d follower(s) connected on %s", len(self.followers), address)

    def _accept(self, listener: Listener) -> None:
        while len(self.followers) < self.config.nnodes - 1:
            try:
                conn = listener.accept()  # refuses a peer without the key
                rank = conn.recv()  # a follower first says its rank
            except (AuthenticationError, EOFError, OSError) as e:
                logger.warning("leader: refused a control connection: %r", e)
                continue
            if rank not in range(1, self.config.nnodes) or rank in self.followers:
                logger.warning("leader: refused a control connection claiming rank %r", rank)
                conn.close()
                continue
            self.followers[rank] = conn

    def _watch(self, rank: int, conn: Connection) -> None:
        timeout = self.config.heartbeat_timeout
        while True:
            try:
                if not conn.poll(timeout):
                    reason = f"sent no heartbeat for {timeout:g} s (hung, or its host is unreachable)"
                    break
                conn.recv()
            except (EOFError, OSError):
                reason = "closed its control connection (it stopped or crashed)"
                break
        if not self.stopping:
            fatal(
                f"node {rank} of {self.config.nnodes} {reason}; the model is split over every node, "
                "so none can go on. Stopping."
            )

    def send(self, method: str, *args, **kwargs) -> None:
        for rank, conn in self.followers.items():
            try:
                conn.send((method, args, kwargs))
            except OSError as e:
                fatal(f"node {rank} of {self.config.nnodes} cannot be reached ({e}); stopping")

    def stop(self) -> None:
        """Tell the followers the work is done (they return from follow())."""
        self.stopping = True
        for conn in self.followers.values():
            try:
                conn.send((STOP, (), {}))
            except OSError:
                pass


class Follower:
    """Node R's end: replays the leader's engine calls; heartbeats in a thread."""

    def __init__(self, config: DistConfig, kv_store):
        self.config = config
        timeout_ms = int((4 * config.heartbeat_timeout + 30) * 1000)
        address, key = kv_store.blocking_key_value_get(CONTROL_KEY, timeout_ms).split()
        host, port = address.rsplit(":", 1)
        self.conn = Client((host, int(port)), authkey=bytes.fromhex(key))
        self.conn.send(config.node_rank)
        self.done = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()

    def _heartbeat(self) -> None:
        while not self.done.wait(self.config.heartbeat_timeout / 5):
            try:
                self.conn.send((HEARTBEAT, (), {}))
            except OSError as e:
                if not self.done.is_set():
                    fatal(f"node {self.config.node_rank}: the leader (node 0) is gone ({e}); stopping")

    def follow(self, engine) -> None:
        """Replay the leader's calls on `engine` until it says stop."""
        rank = self.config.node_rank
        while True:
            try:
                method, args, kwargs = self.conn.recv()
            except (EOFError, OSError):
                fatal(
                    f"node {rank}: the leader (node 0) closed the control connection (it stopped or crashed); stopping"
                )
            if method == STOP:
                self.done.set()
                return
            try:
                getattr(engine, method)(*args, **kwargs)
            except Exception:  # the leader's same call succeeded: this node no longer matches it
                fatal(
                    f"node {rank}: replaying the leader's {method} failed, so this node's engine no longer "
                    f"matches the leader's:\n{traceback.format_exc()}"
                )
