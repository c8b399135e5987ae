"""cpu_compute_cores: jax's threads on their own cores, the host on the others (vLLM's split).

Each engine runs in a child process: the split must be made before jax starts, and this
process's jax started long ago. The oracle is the same engine without the split, on the
default model's real weights: the same greedy tokens, whatever the cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxserve.parallel.devices import pin_cpu_compute
from tests.api.conftest import REPO

# Prompts of several lengths, 24 at once: the decode steps run the CPU kernels with 17-64
# rows (dense_matmuls) and the attention kernel's decode path; the first step is a prefill.
CHILD = r"""
import json, os, subprocess, sys
from jaxserve.engine.llm import LLM
from scheduler import SamplingParams
from benchmarks.cpu_time import on_every_core

cores = json.loads(sys.argv[1])
llm = LLM(
    None, cpu_compute_cores=cores, max_num_seqs=24, max_model_len=256, kv_cache_memory=64 << 20,
    warm_up=False, enable_prefix_caching=False,
)

def threads():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # user + system
        out[tid] = (cpu, sorted(os.sched_getaffinity(int(tid))))
    return out

prompts = [f"Question {i}: what is {i} times {i + 3}? " + "Think step by step. " * (i % 5) for i in range(24)]
params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
llm.generate(prompts, params)  # compiles the steps' programs (on the host thread): the same steps again below
before = threads()
outs = llm.generate(prompts, params)
after = threads()
work = [(cpu - before.get(tid, (0.0, None))[0], cores) for tid, (cpu, cores) in after.items()]
child = "import os; print(sorted(os.sched_getaffinity(0)))"
plain = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout
with on_every_core():
    every = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout
print(json.dumps({
    "tokens": [list(o.outputs[0].token_ids) for o in outs],
    "host": sorted(os.sched_getaffinity(0)),
    "work": work,
    "child": json.loads(plain),
    "child_on_every_core": json.loads(every),
}))
"""


def run_child(cores: int | None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cores)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_one_compute_core_runs_the_steps_on_it_with_the_same_tokens():
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("the split needs two cores; this process may use one")
    shared, split = run_child(None), run_child(1)
    assert split["tokens"] == shared["tokens"]
    assert len(split["tokens"]) == 24 and all(len(t) == 24 for t in split["tokens"])
    compute, host = allowed[:1], allowed[1:]
    assert split["host"] == host and shared["host"] == allowed
    total = sum(cpu for cpu, _ in split["work"])
    on_compute = sum(cpu for cpu, cores in split["work"] if cores == compute)
    on_host = sum(cpu for cpu, cores in split["work"] if cores == host)
    # The steps ran on the compute core; the host thread scheduled and detokenized. A thread
    # on every core (one XLA started later, from an unpinned thread) would be neither.
    assert on_compute > 0.5 * total, split["work"]
    assert on_compute + on_host > 0.95 * total, split["work"]
    # A child started from the host thread inherits its core; benchmarks start theirs on every core.
    assert split["child"] == host and split["child_on_every_core"] == allowed


def test_counts_it_refuses_and_too_late_a_split():
    n = len(os.sched_getaffinity(0))
    pin_cpu_compute(None)  # no split: nothing to do
    for count in (0, n, -1):
        with pytest.raises(ValueError, match=f"cpu_compute_cores must be 1 to {n - 1}"):
            pin_cpu_compute(count)
    if n >= 2:
        import jax

        jax.devices()  # this process's jax has started: too late to pin its threads
        with pytest.raises(RuntimeError, match="before jax starts its backends"):
            pin_cpu_compute(1)


def test_the_cli_says_what_is_wrong_with_the_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.generate", "--cpu-compute-cores", "0", "Hi"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "cpu_compute_cores must be 1 to" in proc.stderr


@pytest.mark.parametrize("flags", [[], ["--baseline", "none", "--tensor-parallel-size", "2"]])
def test_throughput_refuses_the_split_where_it_would_not_be_fair(flags, capsys):
    """The transformers baseline runs in the benchmark's process, where the split would leave it
    the host's cores; several engines or devices do not take the setting."""
    from benchmarks import throughput

    with pytest.raises(SystemExit) as e:
        throughput.main(["--cpu-compute-cores", "1", *flags])
    assert e.value.code == 2
    assert "--cpu-compute-cores goes with --baseline vllm or none" in capsys.readouterr().err
