"""The contract that keeps several nodes in step (jaxserve.parallel.multihost): the leader's engine
sends every call that changes state, and an engine replaying those calls in order schedules
and samples exactly what the leader did, sampling without a seed and aborts included.

Oracle: the leader engine's own outputs, step by step. (Across real processes and hosts:
tests/api/test_multihost.py.)
"""

from jaxserve.engine import EngineConfig, LLMEngine
from scheduler import SamplingParams

CONFIG = EngineConfig(
    max_num_seqs=4,
    max_num_batched_tokens=32,
    num_blocks=64,
    block_size=8,
    max_model_len=128,
    token_buckets=(8, 32),
    warm_up=False,
)


class Recorder:
    """Stands where jaxserve.parallel.multihost.Leader does: keeps the calls it is sent."""

    def __init__(self):
        self.calls = []

    def send(self, method, *args, **kwargs):
        self.calls.append((method, args, kwargs))


def summary(outputs):
    return [(o.request_id, [list(s.token_ids) for s in o.outputs], o.finished) for o in outputs]


def test_a_replaying_engine_steps_and_samples_as_the_leader(tiny_llama):
    leader = LLMEngine(tiny_llama, CONFIG)
    leader.followers = recorder = Recorder()
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)  # no seed
    leader.add_request("a", [1, 5, 9, 13], sampled)
    leader.add_request("b", [1, 3, 3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    want = [summary(leader.step()) for _ in range(3)]
    leader.add_request("c", [1, 44, 55, 66, 77], SamplingParams(temperature=0.8, n=2, max_tokens=6, ignore_eos=True))
    leader.abort_request("b")
    while leader.has_unfinished():
        want.append(summary(leader.step()))
    assert [m for m, _, _ in recorder.calls].count("step") == len(want)

    follower = LLMEngine(tiny_llama, CONFIG)
    got = []
    for method, args, kwargs in recorder.calls:  # what Follower.follow does with each call
        result = getattr(follower, method)(*args, **kwargs)
        if method == "step":
            got.append(summary(result))
    assert got == want
    assert not follower.has_unfinished()
