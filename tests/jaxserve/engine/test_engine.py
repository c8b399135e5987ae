"""Continuous batching must not change what a request produces.

The oracle is each request run alone through the same engine; batched, prefix-cached,
chunked and preempted runs must give identical greedy tokens and identical seeded samples.
"""

import time

import numpy as np
import pytest

from jaxserve.engine import EngineConfig, LLMEngine
from scheduler import Request, SamplingParams

VOCAB = 97  # tests/tiny_models.py


def workload(seed=0, count=32, shared_prefix=()):
    rng = np.random.default_rng(seed)
    prompts = [list(shared_prefix) + rng.integers(3, VOCAB, rng.integers(1, 40)).tolist() for _ in range(count)]
    params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 24)), ignore_eos=True) for _ in range(count)]
    return prompts, params


def engine(loaded, **kw):
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_blocks=256, max_model_len=128)
    return LLMEngine(loaded, EngineConfig(**{**cfg, **kw}))


def run_batched(eng, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    outs = {o.request_id: o for o in eng.generate_all()}
    eng.scheduler.check_integrity()
    assert eng.scheduler.kv.num_free_blocks == eng.scheduler.config.num_blocks - 1, "blocks leaked"
    return [[c.token_ids for c in outs[str(i)].outputs] for i in range(len(prompts))]


def run_alone(eng, prompts, params):
    results = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"alone-{i}", p, sp)
        (out,) = eng.generate_all()
        results.append([c.token_ids for c in out.outputs])
    return results


@pytest.fixture(scope="module")
def alone(tiny_llama):
    """Each request of the workload, run with nothing else in the engine."""
    prompts, params = workload()
    return run_alone(engine(tiny_llama, enable_prefix_caching=False), prompts, params)


def test_batched_equals_alone(tiny_llama, alone):
    eng = engine(tiny_llama)
    compiles_after_warm_up = eng.compilations
    prompts, params = workload()
    assert run_batched(eng, prompts, params) == alone
    assert [len(t[0]) for t in alone] == [p.max_tokens for p in params]
    assert eng.compilations == compiles_after_warm_up, "a program was compiled after warm-up"


def test_chunked_prefill_equals_alone(tiny_llama, alone):
    eng = engine(tiny_llama, long_prefill_token_threshold=5, max_num_batched_tokens=16)
    prompts, params = workload()
    assert run_batched(eng, prompts, params) == alone


def test_preemption_equals_alone(tiny_llama, alone):
    eng = engine(tiny_llama, num_blocks=24)  # 23 blocks of 4 tokens for 8 running sequences
    prompts, params = workload()
    assert run_batched(eng, prompts, params) == alone
    assert eng.scheduler.num_preemptions > 0


def test_prefix_caching_equals_alone(tiny_llama):
    system = list(range(10, 30))  # a 20-token shared system prompt: 5 full blocks
    prompts, params = workload(seed=1, count=12, shared_prefix=system)
    want = run_alone(engine(tiny_llama, enable_prefix_caching=False), prompts, params)
    eng = engine(tiny_llama)
    assert run_batched(eng, prompts, params) == want
    assert eng.scheduler.prefix_cache_hits >= 5 * 4 * 8, "later requests should reuse the system prompt's blocks"


def test_seeded_sampling_is_batch_independent(tiny_llama):
    prompts, _ = workload(seed=2, count=10)
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=i, max_tokens=12, ignore_eos=True) for i in range(10)
    ]
    want = run_alone(engine(tiny_llama), prompts, params)
    got = run_batched(engine(tiny_llama, max_num_seqs=4), prompts, params)
    assert got == want
    assert len({tuple(t[0]) for t in got}) == 10


def test_n_samples_share_prompt_blocks(tiny_llama):
    eng = engine(tiny_llama, async_scheduling=False)  # the serial loop: each step() is one whole step
    prompt = list(range(3, 3 + 18))  # 4 full blocks and a partial one
    eng.add_request("x", prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True))
    eng.step()  # the prompt, once
    tables = [eng.scheduler.kv.block_ids(r.request_id) for r in eng.outputs.groups["x"].samples]
    assert all(t == tables[0] for t in tables), "the samples share the prompt's blocks"
    assert [eng.scheduler.kv.pool.blocks[b].ref_count for b in tables[0]] == [4] * 5
    eng.step()  # each sample writes into the partial block: copy-on-write
    tables = [eng.scheduler.kv.block_ids(r.request_id) for r in eng.outputs.groups["x"].samples]
    assert len({t[4] for t in tables}) == 4 and all(t[:4] == tables[0][:4] for t in tables)
    (out,) = [o for o in eng.generate_all() if o.request_id == "x"]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    alone = [run_sample_alone(engine(tiny_llama), prompt, params, i) for i in range(4)]
    assert [c.token_ids for c in out.outputs] == alone
    assert len({tuple(t) for t in alone}) == 4


def run_sample_alone(eng, prompt, params, sample_index):
    """Sample `sample_index` of a seeded request, run as the only sequence (no fork, no sharing)."""
    req = Request("solo", prompt, params, eos_token_ids=eng.eos_token_ids, sample_index=sample_index)
    eng.outputs.add("solo", None, prompt, [req], time.monotonic())
    eng.scheduler.add_request(req)
    (out,) = eng.generate_all()
    return out.outputs[0].token_ids


@pytest.mark.parametrize("digest", ["real", "constant"])
def test_prompts_sharing_only_a_later_block_each_equal_their_solo_run(tiny_llama, monkeypatch, digest):
    """Two prompts equal in their last full block but not before: even with every digest
    forced to collide, the second never attends to the first one's KV."""
    if digest == "constant":
        monkeypatch.setattr("scheduler.kv_cache_manager.hash_block", lambda *args: b"same")
    tail = list(range(60, 68))
    prompts = [list(range(10, 18)) + tail + [5], list(range(30, 38)) + tail + [5], list(range(10, 18)) + tail + [6]]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3
    want = run_alone(engine(tiny_llama, enable_prefix_caching=False), prompts, params)
    eng = engine(tiny_llama)
    got, cached = [], []
    for i, (p, sp) in enumerate(zip(prompts, params)):  # one after another, so each could hit the cache
        eng.add_request(str(i), p, sp)
        (out,) = eng.generate_all()
        got.append([c.token_ids for c in out.outputs])
        cached.append(out.num_cached_tokens)
    assert got == want
    assert cached[1] == 0
    # With every digest equal, the index holds one block (the first registered, prompt 0's
    # first): the third prompt still finds that one, by its exact key, and nothing more.
    assert cached[2] == (16 if digest == "real" else 4)


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([5] * 200, {}, "context is 128 tokens"),
        ([5, 6], {"max_tokens": 0}, "max_tokens must be >= 1"),
        ([5, 6], {"temperature": -0.5}, "temperature must be >= 0"),
        ([5, 6], {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ([5, 6], {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ([5, 6], {"best_of": 2}, "unknown sampling parameter"),
        ([5, 500], {}, r"prompt token ids must be in \[0, 97\)"),
        ("text", {}, "no tokenizer"),
    ],
)
def test_bad_input_is_refused_and_others_keep_going(tiny_llama, prompt, params, message):
    eng = engine(tiny_llama, warm_up=False)
    eng.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match=message):
        eng.add_request("bad", prompt, params)
    (out,) = eng.generate_all()
    assert out.request_id == "good" and len(out.outputs[0].token_ids) == 3


def test_kv_pool_that_can_never_hold_the_prompt(tiny_llama):
    eng = engine(tiny_llama, num_blocks=4, warm_up=False)  # 12 tokens in all
    with pytest.raises(ValueError, match="KV cache holds at most 12 tokens"):
        eng.add_request("big", list(range(3, 20)), SamplingParams())
