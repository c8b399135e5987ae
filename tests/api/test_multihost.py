"""Two nodes on loopback (jaxserve.parallel.multihost): two processes with two CPU devices each, one
model split over all four, gloo collectives between them.

Oracle: the one-device engine in this process on the same weights. Greedy text agrees
wherever its top-2 margin is clear (the cross-host all-reduces reorder sums, which may flip
a true near-tie; the rule of tests/jaxserve/parallel/test_tensor_parallel.py). A lost node must stop
the others with a message naming it, within a bounded time.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.api.conftest import REPO, assert_same_where_clear, greedy_where_clear, run_server

PROMPTS = ["the cat sat on the mat", "hello world", "one two three four five six seven eight nine ten"]
MAX_TOKENS = 8
ENGINE_FLAGS = [
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "32",
    "--max-model-len",
    "64",
    "--num-blocks",
    "64",
    "--block-size",
    "4",
]
HEARTBEAT_TIMEOUT = 4  # seconds (--dist-timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_flags(rank: int, port: int) -> list[str]:
    return [
        "-tp",
        "4",
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--dist-init-addr",
        f"127.0.0.1:{port}",
        "--dist-timeout",
        str(HEARTBEAT_TIMEOUT),
    ]


def node_env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("JAX_NUM_CPU_DEVICES", None)  # each node asks for its own share
    return env


@contextlib.contextmanager
def started(cmd: list[str], log):
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=node_env())
    try:
        yield process
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
        process.wait()


def wait_exit(process: subprocess.Popen, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    return process.wait(timeout), time.monotonic() - start


@pytest.mark.slow
def test_server_over_two_nodes_answers_as_one_device_and_stops_when_a_node_dies(tiny_folder, tiny_engine, tmp_path):
    port = free_port()
    follower_cmd = [sys.executable, "-m", "api", "--model", str(tiny_folder), *ENGINE_FLAGS, *node_flags(1, port)]
    with (
        started(follower_cmd, tmp_path / "node1.log") as follower,
        run_server(tmp_path, "--model", str(tiny_folder), *ENGINE_FLAGS, *node_flags(0, port)) as leader,
    ):
        client = leader.client()
        model = client.models.list().data[0].id
        got = [
            client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
            for p in PROMPTS
        ]
        unseeded = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=1.0)
        assert unseeded.choices[0].text  # sampled identically on both nodes, or the nodes' steps would diverge
        assert "follows node 0" in (tmp_path / "node1.log").read_text()

        follower.kill()
        code, waited = wait_exit(leader.process, timeout=60)
        log = leader.log.read_text()
    assert code != 0 and waited < 30, log[-3000:]
    assert "node 1 of 2 closed its control connection (it stopped or crashed)" in log, log[-3000:]
    assert_same_where_clear(got, greedy_where_clear(tiny_engine.loaded, PROMPTS, MAX_TOKENS))


@pytest.mark.slow
def test_a_hung_node_misses_its_heartbeats_and_the_leader_stops_naming_it(tiny_folder, tmp_path):
    port = free_port()
    follower_cmd = [sys.executable, "-m", "api", "--model", str(tiny_folder), *ENGINE_FLAGS, *node_flags(1, port)]
    with (
        started(follower_cmd, tmp_path / "node1.log") as follower,
        run_server(tmp_path, "--model", str(tiny_folder), *ENGINE_FLAGS, *node_flags(0, port)) as leader,
    ):
        os.kill(follower.pid, signal.SIGSTOP)
        code, waited = wait_exit(leader.process, timeout=60)
        log = leader.log.read_text()
        assert code != 0 and waited < HEARTBEAT_TIMEOUT + 20, log[-3000:]
        assert f"node 1 of 2 sent no heartbeat for {HEARTBEAT_TIMEOUT} s" in log, log[-3000:]
        # Woken, the follower finds the leader gone and stops too, saying so: our control
        # connection or jax's coordination client (node 0 held the coordinator), whichever
        # notices first.
        os.kill(follower.pid, signal.SIGCONT)
        code, waited = wait_exit(follower, timeout=60)
    follower_log = (tmp_path / "node1.log").read_text()
    assert code != 0 and waited < 30, follower_log[-3000:]
    assert (
        "the leader (node 0) closed the control connection" in follower_log
        or "the leader task was preempted/died" in follower_log
    ), follower_log[-3000:]


@pytest.mark.slow
def test_generate_over_two_nodes_prints_what_one_device_generates(tiny_folder, tiny_engine, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    port = free_port()

    def cmd(rank):
        return [
            sys.executable,
            "-m",
            "jaxserve.generate",
            "--model",
            str(tiny_folder),
            "--prompts-file",
            str(prompts_file),
            "--max-tokens",
            str(MAX_TOKENS),
            "--cache-dir",
            str(tmp_path / "cache"),
            *node_flags(rank, port),
        ]

    with started(cmd(1), tmp_path / "node1.log") as follower, started(cmd(0), tmp_path / "node0.log") as leader:
        assert wait_exit(leader, 300)[0] == 0, (tmp_path / "node0.log").read_text()[-3000:]
        assert wait_exit(follower, 60)[0] == 0, (tmp_path / "node1.log").read_text()[-3000:]
    printed = (tmp_path / "node0.log").read_text()
    got = []
    for i, p in enumerate(PROMPTS):
        header = f"--- [{i}] {p!r}\n"
        assert header in printed, printed[-3000:]
        got.append(printed.split(header, 1)[1].split("\n", 1)[0])
    assert_same_where_clear(got, greedy_where_clear(tiny_engine.loaded, PROMPTS, MAX_TOKENS))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:1"], "--node-rank must be in [0, 2)"),
        (["--nnodes", "2", "--node-rank", "1"], "--nnodes 2 needs --dist-init-addr HOST:PORT"),
        (["--nnodes", "2", "-tp", "3", "--dist-init-addr", "127.0.0.1:1"], "must split evenly over --nnodes 2"),
        (["--nnodes", "2", "-dp", "2", "--dist-init-addr", "127.0.0.1:1"], "does not combine with --nnodes"),
    ],
)
def test_bad_node_flags_are_refused_before_anything_starts(tiny_folder, flags, message):
    run = subprocess.run(
        [sys.executable, "-m", "api", "--model", str(tiny_folder), *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=node_env(),
        timeout=120,
    )
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
