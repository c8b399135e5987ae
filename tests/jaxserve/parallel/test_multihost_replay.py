"""The contract that keeps several nodes in step (jaxserve.parallel.multihost): node 0's runner
hands each step's plan to the others, which run the same programs on it. A runner that
runs the leader's plans, carried through frames (encoded and decoded as between hosts),
holds exactly the leader's device state after every step: the same sampled tokens,
unseeded sampling, n > 1, penalties, prompt logprobs and aborts included, though it has
no scheduler of its own.

Oracle: the leader engine's own sampled tokens on the device, step by step. (Across real
processes and hosts: tests/api/test_multihost.py.)
"""

import numpy as np

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.parallel.frames import Codec
from jaxserve.runner.model_runner import PLAN_TYPES
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


def test_a_runner_fed_the_leaders_plans_samples_what_the_leader_does(tiny_llama):
    leader = LLMEngine(tiny_llama, CONFIG)
    follower = LLMEngine(tiny_llama, CONFIG).runner  # its engine's scheduler is never used
    codec = Codec(PLAN_TYPES)
    frames = []

    def broadcast(plan):
        frames.append(codec.encode("step", tree=plan))
        follower.execute(codec.decode(frames[-1]).tree)

    leader.runner.broadcast = broadcast
    leader.add_request("a", [1, 5, 9, 13], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    leader.add_request(
        "b", [1, 3, 3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    )
    steps = 0
    while leader.has_unfinished():
        if steps == 3:
            params = SamplingParams(temperature=0.8, n=2, max_tokens=6, ignore_eos=True, presence_penalty=0.5)
            leader.add_request("c", [1, 44, 55, 66, 77], params)
            leader.abort_request("b")
        leader.step()
        np.testing.assert_array_equal(np.asarray(follower.last_tokens), np.asarray(leader.runner.last_tokens))
        steps += 1
    assert len(frames) > 5  # (with the overlapped loop, some calls only collect a step)
    np.testing.assert_array_equal(np.asarray(follower.kv.k), np.asarray(leader.runner.kv.k))
