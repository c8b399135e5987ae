"""One model over several hosts: `--nnodes N --node-rank R --dist-init-addr HOST:PORT`.

jax's multi-controller runtime (`jax.distributed`) makes every node's devices one global
set, and the tensor-parallel mesh spans them all: every node runs the same jitted programs
on its own shards, and the collectives inside them cross hosts. Node 0 (the leader) alone
runs the API, tokenization, the scheduler and its block tables; for each step it sends the
step's padded inputs (the runner's `StepPlan`: what the programs read) to every other node
(the followers), and each runs the same programs on them (`ModelRunner.execute`). The
weights, the KV cache and the last step's tokens live on the devices, split the same way
on every node, so nothing else has to travel.

The control channel is one TCP connection per follower (`multiprocessing.connection`, only
its `send_bytes`/`recv_bytes`: frames of JSON and raw arrays, jaxserve.parallel.frames, never
pickle). It authenticates both ends with a shared key every node is given
(`JAXSERVE_DIST_KEY` or `--dist-key-file`), which is never published. On connecting, each
follower sends a fingerprint of what shapes its programs (model, weights, dtype, engine
settings, versions); one that differs from the leader's stops both, naming each setting.

A node cannot go on without the others (the collectives would wait forever), so the leader
watches every follower:

- a heartbeat every `heartbeat_timeout / 5` seconds (a thread): missing ones for
  `heartbeat_timeout` seconds, or a closed connection, is a lost node;
- an acknowledgement of every step once its programs finished on that node: a step not
  acknowledged within `step_timeout` seconds (ten times that for a step of a shape not seen
  before, which compiles) is a hung node.

Either stops the group: `Leader.on_failure` gets a message naming the node and the step
(the server fails the requests in flight and turns `/health` to 503; the CLI exits). A
follower stops when the leader's connection closes.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

from jaxserve.parallel.frames import Codec, FrameError

logger = logging.getLogger(__name__)

CONTROL_KEY = "jaxserve/control"  # where the leader publishes its control address (not the key)
KEY_ENV = "JAXSERVE_DIST_KEY"
COMPILE_FACTOR = 10  # a step of a new shape compiles on every node first
FAILURE_WAIT = 3.0  # seconds a failed step waits for the watchdog to name a lost node (Leader.wait_failure)


class DistError(RuntimeError):
    """The nodes cannot work together (a mismatch, a refused or broken connection)."""


@dataclasses.dataclass(frozen=True)
class DistConfig:
    nnodes: int = 1
    node_rank: int = 0
    init_addr: str | None = None  # HOST:PORT of jax's coordinator, on node 0
    heartbeat_timeout: float = 10.0  # seconds without a follower's heartbeat before the group stops
    step_timeout: float = 60.0  # seconds a follower may take to finish a step
    key: bytes = dataclasses.field(default=b"", repr=False)  # the control channel's shared secret

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
        if self.heartbeat_timeout <= 0 or self.step_timeout <= 0:
            raise ValueError(f"timeouts must be positive, got {self.heartbeat_timeout} and {self.step_timeout}")
        if self.nnodes > 1 and len(self.key) < 16:
            raise ValueError(
                f"--nnodes {self.nnodes} needs a shared key for the control channel, the same on every node, "
                f"of 16 bytes or more: set ${KEY_ENV} or pass --dist-key-file "
                "(e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
            )

    @property
    def enabled(self) -> bool:
        return self.nnodes > 1

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    @property
    def host(self) -> str:
        return self.init_addr.rsplit(":", 1)[0]

    def local_devices(self, tensor_parallel_size: int) -> int:
        """Each node's share of the mesh's devices."""
        if tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"--tensor-parallel-size {tensor_parallel_size} must split evenly over --nnodes "
                f"{self.nnodes}: every node holds the same number of the mesh's devices"
            )
        return tensor_parallel_size // self.nnodes


def start(config: DistConfig, tensor_parallel_size: int) -> None:
    """Join the other nodes in jax's runtime (blocks until all have). Call it before anything
    starts jax's backends. On the CPU each node gets its share of `tensor_parallel_size`
    devices and gloo collectives."""
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
        coordinator_bind_address=config.init_addr,  # not every interface
    )
    if jax.device_count() != tensor_parallel_size:
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size} must cover every node's devices: "
            f"{config.nnodes} nodes hold {jax.device_count()} ({jax.local_device_count()} here)"
        )


def connect(config: DistConfig, fingerprint: dict) -> Leader | Follower:
    """Open the control channel (after `start`) and check that every node's `fingerprint`
    matches the leader's; raises DistError naming the settings that differ."""
    from jax._src.distributed import global_state  # NOTE: the coordination service's key-value store

    if config.is_leader:
        return Leader(config, global_state.client, fingerprint)
    return Follower(config, global_state.client, fingerprint)


def differences(leader: dict, follower: dict, rank: int) -> list[str]:
    """'name: node 0 has A, node R has B' for every setting the two fingerprints disagree on."""
    return [
        f"{name}: node 0 has {leader.get(name)!r}, node {rank} has {follower.get(name)!r}"
        for name in sorted(set(leader) | set(follower))
        if leader.get(name) != follower.get(name)
    ]


def fatal(message: str) -> None:
    """Stop this node now: its collectives can never finish without the lost node."""
    print(f"jaxserve: {message}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(1)


class _Peer:
    """The leader's view of one follower: its connection and the steps it has not acknowledged."""

    def __init__(self, rank: int, conn: Connection):
        self.rank, self.conn = rank, conn
        self.unacked: collections.deque[tuple[int, float, bytes]] = collections.deque()  # (step, sent at, shape)
        self.heard = time.monotonic()


class Leader:
    """Node 0's end: sends each step's plan to every follower and watches them."""

    def __init__(self, config: DistConfig, kv_store, fingerprint: dict):
        self.config = config
        self.codec = Codec()
        self.on_failure: Callable[[str], None] = fatal  # the server replaces it (fail requests, /health 503)
        self.failure: str | None = None
        self._failed = threading.Event()
        self.steps = 0
        self._shapes_done: set[bytes] = set()  # step shapes every follower has run (compiled)
        self._lock = threading.Lock()
        listener = Listener((config.host, 0), authkey=config.key)
        address = ":".join(map(str, listener.address))
        kv_store.key_value_set(CONTROL_KEY, address)
        self.peers: dict[int, _Peer] = {}
        refusals: list[str] = []
        accepting = threading.Thread(target=self._accept, args=(listener, fingerprint, refusals), daemon=True)
        accepting.start()
        accepting.join(timeout=4 * config.heartbeat_timeout + 30)
        listener.close()
        if refusals:
            raise DistError("; ".join(refusals))
        if len(self.peers) != config.nnodes - 1:
            missing = sorted(set(range(1, config.nnodes)) - set(self.peers))
            raise DistError(f"node(s) {missing} did not connect to the leader's control address {address}")
        for peer in self.peers.values():
            threading.Thread(target=self._watch, args=(peer,), daemon=True, name=f"watch-node-{peer.rank}").start()
        logger.info("leader: %d follower(s) connected on %s", len(self.peers), address)

    def _accept(self, listener: Listener, fingerprint: dict, refusals: list[str]) -> None:
        while len(self.peers) + len(refusals) < self.config.nnodes - 1:
            try:
                conn = listener.accept()  # refuses a peer without the key
                if not conn.poll(30):
                    raise DistError("said nothing after connecting")
                hello = self.codec.decode(conn.recv_bytes(1 << 20))
                rank, theirs = hello.body.get("rank"), hello.body.get("fingerprint")
                if hello.kind != "hello" or not isinstance(theirs, dict):
                    raise FrameError(f"expected a hello, got a {hello.kind!r} frame")
            except (AuthenticationError, FrameError, DistError, EOFError, OSError) as e:
                logger.warning("leader: refused a control connection: %r", e)
                continue
            if rank not in range(1, self.config.nnodes) or rank in self.peers:
                logger.warning("leader: refused a control connection claiming rank %r", rank)
                conn.close()
                continue
            diff = differences(fingerprint, theirs, rank)
            if diff:
                message = f"node {rank} does not match node 0: " + "; ".join(diff)
                conn.send_bytes(self.codec.encode("refuse", {"message": message}))
                refusals.append(message)
                continue
            conn.send_bytes(self.codec.encode("welcome"))
            self.peers[rank] = _Peer(rank, conn)

    def send_step(self, plan) -> None:
        """Hand a step's plan to every follower (before running it here)."""
        frame = self.codec.encode("step", tree=plan)
        shape = self.codec.header(frame)  # the programs' shapes (a step frame's body is empty)
        with self._lock:
            self.steps += 1
            now = time.monotonic()
            for peer in self.peers.values():
                peer.unacked.append((self.steps, now, shape))
        for peer in self.peers.values():
            try:
                peer.conn.send_bytes(frame)
            except OSError as e:
                self._fail(f"node {peer.rank} of {self.config.nnodes} cannot be reached ({e})")

    def _watch(self, peer: _Peer) -> None:
        poll = min(1.0, self.config.heartbeat_timeout / 5, self.config.step_timeout / 5)
        while self.failure is None:
            try:
                # One frame a turn, then the deadlines: a peer that sends heartbeats faster than
                # `poll` must not keep the checks below from running (CI 2026-12-05: a hung
                # step was named after 5 s, not its 0.5 s bound).
                if peer.conn.poll(poll):
                    frame = self.codec.decode(peer.conn.recv_bytes(1 << 16))
                    peer.heard = time.monotonic()
                    if frame.kind == "ack":
                        self._acknowledged(peer, frame.body.get("step"))
                    elif frame.kind != "alive":
                        raise FrameError(f"unexpected {frame.kind!r} frame")
            except (EOFError, OSError):
                return self._fail(
                    f"node {peer.rank} of {self.config.nnodes} closed its control connection (it stopped or crashed)"
                )
            except FrameError as e:
                return self._fail(f"node {peer.rank} of {self.config.nnodes} sent a frame the leader refuses: {e}")
            now = time.monotonic()
            if now - peer.heard > self.config.heartbeat_timeout:
                return self._fail(
                    f"node {peer.rank} of {self.config.nnodes} sent no heartbeat for "
                    f"{self.config.heartbeat_timeout:g} s (hung, or its host is unreachable)"
                )
            with self._lock:
                oldest = peer.unacked[0] if peer.unacked else None
            if oldest is not None:
                step, sent, shape = oldest
                bound = self.config.step_timeout * (1 if shape in self._shapes_done else COMPILE_FACTOR)
                if now - sent > bound:
                    return self._fail(
                        f"node {peer.rank} of {self.config.nnodes} did not finish step {step} within {bound:g} s "
                        "(its step hangs, or its host is unreachable)"
                    )

    def _acknowledged(self, peer: _Peer, step) -> None:
        if type(step) is not int:
            raise FrameError(f"an acknowledgement of step {step!r}")
        with self._lock:
            while peer.unacked and peer.unacked[0][0] <= step:
                self._shapes_done.add(peer.unacked.popleft()[2])

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = f"{reason}; the model is split over every node, so none can go on"
        self._failed.set()
        logger.error("jaxserve: %s", self.failure)
        self.on_failure(self.failure)

    def wait_failure(self, timeout: float) -> str | None:
        """Why the group stopped, waiting up to `timeout` s for the watchdog to find out (a
        step that failed on a lost node's broken connection fails a moment before); None if
        no node was found lost."""
        self._failed.wait(timeout)
        return self.failure

    def lead(self, runner, plan_types) -> None:
        """Send `runner`'s step plans (a ModelRunner's; `plan_types`: the dataclasses a plan is
        made of) to the followers from now on."""
        self.codec = Codec(plan_types)
        runner.broadcast = self.send_step

    def stop(self) -> None:
        """Tell the followers the work is done (they return from follow())."""
        self.failure = self.failure or "stopped"
        for peer in self.peers.values():
            try:
                peer.conn.send_bytes(self.codec.encode("stop"))
            except OSError:
                pass


class Follower:
    """Node R's end: runs the leader's step plans; heartbeats and acknowledgements in threads."""

    def __init__(self, config: DistConfig, kv_store, fingerprint: dict):
        self.config = config
        self.codec = Codec()
        timeout_ms = int((4 * config.heartbeat_timeout + 30) * 1000)
        address = kv_store.blocking_key_value_get(CONTROL_KEY, timeout_ms)
        host, port = address.rsplit(":", 1)
        try:
            self.conn = Client((host, int(port)), authkey=config.key)
        except AuthenticationError:
            raise DistError(
                f"node {config.node_rank}: the leader refused this node's key (set the same on every node)"
            ) from None
        self.conn.send_bytes(self.codec.encode("hello", {"rank": config.node_rank, "fingerprint": fingerprint}))
        reply = self.codec.decode(self.conn.recv_bytes(1 << 20))
        if reply.kind == "refuse":
            raise DistError(str(reply.body.get("message")))
        if reply.kind != "welcome":
            raise DistError(f"node {config.node_rank}: the leader answered with a {reply.kind!r} frame")
        self._send_lock = threading.Lock()
        self.done = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()

    def _send(self, kind: str, body: dict | None = None) -> None:
        with self._send_lock:
            self.conn.send_bytes(self.codec.encode(kind, body))

    def _heartbeat(self) -> None:
        while not self.done.wait(self.config.heartbeat_timeout / 5):
            try:
                self._send("alive")
            except OSError as e:
                if not self.done.is_set():
                    fatal(f"node {self.config.node_rank}: the leader (node 0) is gone ({e}); stopping")

    def follow(self, runner, plan_types) -> None:
        """Run the leader's step plans on `runner` (a ModelRunner; `plan_types`: the dataclasses
        a plan is made of) until it says stop. Raises FrameError on a frame it will not read."""
        import jax

        codec = Codec(plan_types)
        finished: queue.SimpleQueue = queue.SimpleQueue()
        acking = threading.Thread(target=self._acknowledge, args=(finished, jax.block_until_ready), daemon=True)
        acking.start()
        rank, steps = self.config.node_rank, 0
        while True:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                fatal(
                    f"node {rank}: the leader (node 0) closed the control connection (it stopped or crashed); stopping"
                )
            try:
                frame = codec.decode(data)
                if frame.kind not in ("stop", "step"):
                    raise FrameError(f"unexpected {frame.kind!r} frame")
            except FrameError:
                self.done.set()  # no heartbeats from a node that stopped following
                self.conn.close()
                raise
            if frame.kind == "stop":
                finished.put(None)
                acking.join()
                self.done.set()
                return
            steps += 1
            # NOTE: the step's own outputs (the head's tokens, prompt logprobs), not the KV
            # cache: the next step takes that over (donates it) before this one is waited on.
            finished.put((steps, runner.execute(frame.tree)))

    def _acknowledge(self, finished: queue.SimpleQueue, wait) -> None:
        """Acknowledge each step once its programs have finished on this node's devices."""
        while (item := finished.get()) is not None:
            step, outputs = item
            try:
                wait(outputs)
            except Exception as e:  # the leader names this node when its acknowledgements stop
                fatal(f"node {self.config.node_rank}: step {step} failed on this node: {e!r}")
            try:
                self._send("ack", {"step": step})
            except OSError:
                return
