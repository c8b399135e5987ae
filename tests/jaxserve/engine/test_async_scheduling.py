"""The overlapped step loop changes when the host learns a token, never which token.

Oracle: the serial loop (`async_scheduling=False`) on the same workload. Both runs see
the same requests, added at the same points of the client's view (after so many outputs),
and aborted when the client has seen so many tokens; every request's tokens, text,
finish and stop reasons and logprobs must be equal, through EOS and stop tokens mid-batch,
stop strings, aborts, preemption under a small KV cache, prefix hits, n > 1 and penalties.
"""

import numpy as np
import pytest

from jaxserve.engine import EngineConfig, LLMEngine
from scheduler import SamplingParams
from tests.tiny_models import WORDS

CONFIG = dict(max_num_seqs=6, max_num_batched_tokens=32, token_buckets=(8, 16, 32), block_size=4, max_model_len=96)


def workload(seed: int):
    """(prompt, params, abort_after) per request; abort_after: tokens seen before the client aborts."""
    rng = np.random.default_rng(seed)
    shared = "the cat sat on the mat and the dog ran to the house"  # 14 tokens with BOS: 3 full blocks
    requests = []
    for i in range(18):
        words = " ".join(rng.choice(WORDS[:60], int(rng.integers(1, 12))))
        prompt = f"{shared} {words}" if i % 3 == 0 else words
        kind = i % 6
        params = dict(max_tokens=int(rng.integers(1, 20)), temperature=0.0, logprobs=2 if i % 4 == 0 else None)
        if kind == 1:
            params.update(temperature=1.0, seed=int(rng.integers(1 << 30)), top_k=20)
        elif kind == 2:
            params.update(stop_token_ids=[int(t) for t in rng.integers(3, 97, 12)], max_tokens=30)  # stops early
        elif kind == 3:
            params.update(stop=[str(w) for w in rng.choice(WORDS[:40], 6)], max_tokens=30)
        elif kind == 4:
            params.update(n=3, temperature=0.8, seed=int(rng.integers(1 << 30)))
        elif kind == 5 and i % 4 == 1:
            params.update(repetition_penalty=1.3, presence_penalty=0.5)
        abort_after = 3 if i in (4, 11) else None
        requests.append((prompt, SamplingParams(**params), abort_after))
    return requests


def run(loaded, requests, **config) -> dict:
    """Add half the requests, the rest one per output batch; return what the client saw."""
    engine = LLMEngine(loaded, EngineConfig(**{**CONFIG, **config}))
    seen: dict[str, dict] = {}
    queue = list(enumerate(requests))
    for i, (prompt, params, _) in queue[: len(queue) // 2]:
        engine.add_request(str(i), prompt, params)
    queue = queue[len(queue) // 2 :]
    while engine.has_unfinished() or queue:
        outputs = engine.step()
        if outputs and queue:
            i, (prompt, params, _) = queue.pop(0)
            engine.add_request(str(i), prompt, params)
        for out in outputs:
            record = seen.setdefault(out.request_id, {})
            record["samples"] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]
            record["logprobs"] = [c.logprobs for c in out.outputs]
            abort_after = requests[int(out.request_id)][2]
            if abort_after and len(out.outputs[0].token_ids) >= abort_after and not out.finished:
                assert engine.abort_request(out.request_id)
                record["aborted"] = True
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.config.num_blocks - 1, "blocks leaked"
    return seen


def assert_same(serial: dict, overlapped: dict):
    assert serial.keys() == overlapped.keys()
    for rid in serial:
        assert serial[rid].get("aborted") == overlapped[rid].get("aborted"), rid
        if serial[rid].get("aborted"):
            # Aborted when sample 0 had shown 3 tokens: it matches; the other samples got as
            # far as each loop's timing let them, so one's tokens begin the other's.
            assert serial[rid]["samples"][0] == overlapped[rid]["samples"][0], rid
            for (a, *_), (b, *_) in zip(serial[rid]["samples"], overlapped[rid]["samples"]):
                assert a[: len(b)] == b[: len(a)], rid
            continue
        assert serial[rid]["samples"] == overlapped[rid]["samples"], rid
        for a, b in zip(serial[rid]["logprobs"], overlapped[rid]["logprobs"]):
            if a is not None:
                assert [sorted(x) for x in a] == [sorted(x) for x in b], rid
                np.testing.assert_allclose(
                    [v for x in a for v in x.values()], [v for x in b for v in x.values()], atol=1e-5
                )


@pytest.mark.parametrize("seed,num_blocks", [(0, 256), (1, 256), (2, 40)])
def test_overlapped_loop_equals_serial_loop(tiny_llama_tok, seed, num_blocks):
    requests = workload(seed)
    serial = run(tiny_llama_tok, requests, num_blocks=num_blocks, async_scheduling=False)
    overlapped = run(tiny_llama_tok, requests, num_blocks=num_blocks)
    assert_same(serial, overlapped)
    finish = {s[2] for r in serial.values() for s in r["samples"]}
    assert {"stop", "length"} <= finish, finish
    assert sum(bool(r.get("aborted")) for r in serial.values()) == 2


def test_small_cache_preempts_in_both_loops(tiny_llama_tok):
    requests = [(p, params.replace(max_tokens=20, stop_token_ids=()), None) for p, params, _ in workload(3)]
    engines = {}
    for mode in (False, True):
        engine = LLMEngine(tiny_llama_tok, EngineConfig(**CONFIG, num_blocks=30, async_scheduling=mode))
        for i, (prompt, params, _) in enumerate(requests):
            engine.add_request(str(i), prompt, params)
        outs = {o.request_id: [c.token_ids for c in o.outputs] for o in engine.generate_all()}
        engines[mode] = (engine.scheduler.num_preemptions, outs)
    assert engines[False][1] == engines[True][1]
    assert engines[False][0] > 0 and engines[True][0] > 0


def test_a_request_stopped_by_eos_gets_no_extra_token(tiny_llama_tok):
    """The step after an EOS may compute one more token for the request; it is never shown."""
    engine = LLMEngine(tiny_llama_tok, EngineConfig(**CONFIG, num_blocks=64))
    engine.add_request("free", "the cat", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    (free,) = engine.generate_all()
    tokens = free.outputs[0].token_ids
    stop = tokens[4]
    engine.add_request("stops", "the cat", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))
    (out,) = engine.generate_all()
    assert out.outputs[0].token_ids == tokens[: tokens.index(stop) + 1]
    assert out.outputs[0].stop_reason == stop


def test_no_compilation_after_warm_up(tiny_llama_tok):
    engine = LLMEngine(tiny_llama_tok, EngineConfig(**CONFIG, num_blocks=256))
    compiled = engine.compilations
    for i, (prompt, params, _) in enumerate(workload(4)):
        engine.add_request(str(i), prompt, params)
    engine.generate_all()
    assert engine.compilations == compiled
