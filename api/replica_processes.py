"""`python -m api --data-parallel-size M`: M engine processes behind the router (api.router).

Each replica is a `python -m api` child of its own (one GIL, one jax runtime each, as vLLM
runs a process per data-parallel rank) on a free loopback port, with its device group:
CUDA_VISIBLE_DEVICES lists devices i*tp .. (i+1)*tp-1 (of the parent's own list, if it has
one); on a CPU it just gets the CPU. The parent imports no jax: it starts the children,
waits until each answers /health, then serves the router on the user's --host/--port.

A child that exits is started again on its port, after a pause that doubles from 1 s to
30 s while it keeps dying (logged); the router takes it out of rotation meanwhile and back
when it answers /health. On exit the parent stops its children (SIGTERM, then SIGKILL);
a child also gets SIGTERM when the parent dies without a word (Linux's parent-death signal),
so none is left behind.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

logger = logging.getLogger(__name__)

REPLICA_ENV = "JAXSERVE_REPLICA"  # set in a child: its index, named in its start line and stats lines
PARENT_ENV = "JAXSERVE_REPLICA_PARENT"  # the parent's pid, for the parent-death signal
MAX_BACKOFF = 30.0
STABLE_AFTER = 60.0  # a child up this long has its backoff reset


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_groups(data_parallel_size: int, tensor_parallel_size: int) -> list[str]:
    """Each replica's CUDA_VISIBLE_DEVICES: consecutive groups of tp from the parent's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(data_parallel_size * tensor_parallel_size)]
    need = data_parallel_size * tensor_parallel_size
    if len(devices) < need:
        raise ValueError(
            f"{data_parallel_size} replicas of {tensor_parallel_size} devices need {need} devices, "
            f"CUDA_VISIBLE_DEVICES has {visible}"
        )
    tp = tensor_parallel_size
    return [",".join(devices[i * tp : (i + 1) * tp]) for i in range(data_parallel_size)]


class Replica:
    """One child `python -m api` process and what it takes to start it again."""

    def __init__(self, index: int, argv: list[str], devices: str):
        self.index = index
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Later flags win in argparse: the child serves one engine on its own loopback port.
        self.argv = [*argv, "--data-parallel-size", "1", "--host", "127.0.0.1", "--port", str(self.port)]
        self.env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": devices,
            REPLICA_ENV: str(index),
            PARENT_ENV: str(os.getpid()),
        }
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.started_at = 0.0

    def start(self) -> None:
        # Its own session: a ctrl-C in the terminal reaches the parent only, which stops the
        # children itself (rather than watching them exit and restarting them).
        self.process = subprocess.Popen([sys.executable, "-m", "api", *self.argv], env=self.env, start_new_session=True)
        self.started_at = time.monotonic()
        logger.info("replica %d: pid %d on %s", self.index, self.process.pid, self.url)

    def describe(self) -> dict:
        return {"replica": self.index, "pid": self.process.pid if self.process else None, "restarts": self.restarts}


class ReplicaProcesses:
    """Start, watch, restart and stop the children."""

    def __init__(self, argv: list[str], data_parallel_size: int, tensor_parallel_size: int):
        groups = device_groups(data_parallel_size, tensor_parallel_size)
        self.replicas = [Replica(i, argv, groups[i]) for i in range(data_parallel_size)]
        self._stopping = threading.Event()
        self._serving = threading.Event()  # every child answered once: from now on, restart those that exit
        self._watcher: threading.Thread | None = None

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def describe(self, url: str) -> dict:
        return next(r.describe() for r in self.replicas if r.url == url)

    def start(self, api_key: str | None) -> str:
        """Start every child and wait until all answer /health; return the served model's name.
        Raises RuntimeError (after stopping the others) if one exits first."""
        # NOTE: one thread starts and restarts the children: the parent-death signal fires
        # when the thread that started a child ends.
        ready = threading.Event()
        self._watcher = threading.Thread(target=self._watch, args=(ready,), name="replica-watcher", daemon=True)
        self._watcher.start()
        ready.wait()
        for replica in self.replicas:
            while not _healthy(replica.url):
                if replica.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"replica {replica.index} exited with {replica.process.returncode}")
                time.sleep(0.2)
        self._serving.set()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.get(f"{self.replicas[0].url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]

    def _watch(self, ready: threading.Event) -> None:
        for replica in self.replicas:
            replica.start()
        ready.set()
        backoff = {r.index: 1.0 for r in self.replicas}
        while not self._stopping.wait(0.5):
            for replica in self.replicas:
                code = replica.process.poll()
                if code is None or not self._serving.is_set():
                    continue
                if time.monotonic() - replica.started_at > STABLE_AFTER:
                    backoff[replica.index] = 1.0
                pause = backoff[replica.index]
                logger.error(
                    "replica %d (pid %d) exited with %s; restarting in %.0f s",
                    replica.index,
                    replica.process.pid,
                    code,
                    pause,
                )
                if self._stopping.wait(pause):
                    return
                replica.restarts += 1
                replica.start()
                backoff[replica.index] = min(2 * pause, MAX_BACKOFF)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM every child, SIGKILL those still there after `timeout`."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join()
        alive = [r.process for r in self.replicas if r.process is not None and r.process.poll() is None]
        for process in alive:
            process.send_signal(signal.SIGCONT)  # a stopped child could not act on SIGTERM
            process.terminate()
        deadline = time.monotonic() + timeout
        for process in alive:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def die_with_parent() -> None:
    """In a child: SIGTERM when the parent that started it dies (Linux), and exit now if it
    already has."""
    parent = os.environ.get(PARENT_ENV)
    if parent is None:
        return
    with_libc = sys.platform.startswith("linux")
    if with_libc:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        sys.exit(1)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def serve_replicas(args, argv: list[str]) -> int:
    """The parent's main: children, then the router until SIGTERM or ctrl-C, then no children."""
    from api.router import create_router, serve

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll
    processes = ReplicaProcesses(argv, args.data_parallel_size, args.tensor_parallel_size)
    try:
        try:
            model = processes.start(args.api_key)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        app = create_router(
            processes.urls,
            load_bound=args.router_load_bound,
            health_interval=args.health_interval,
            health_timeout=args.health_timeout,
            max_tries=args.max_tries,
            describe=processes.describe,
        )
        serve(app, args.host, args.port, f"jaxserve: serving {model} on {{url}}", log_level=args.log_level)
    except KeyboardInterrupt:  # uvicorn raises it again once it has shut down on ctrl-C
        pass
    finally:
        processes.stop()
    return 0
