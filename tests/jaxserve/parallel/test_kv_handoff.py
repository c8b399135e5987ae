"""A prompt's KV handed from one engine to another (the core of prefill/decode
disaggregation): engine P runs the prompt, `export_prefix` reads its cached blocks, engine D
`import_prefix`es them into its own blocks and decodes.

Oracle: one engine doing both (colocated) on the same weights. With the same split, D's
tokens equal it exactly; D and P split over different numbers of devices agree wherever the colocated
top-2 margin is clear (tests/jaxserve/parallel/test_tensor_parallel.py's rule). D's prefix-cache
hits show it used the handed KV and did not compute the prompt again.
"""

import jax
import numpy as np
import pytest

from jaxserve.engine import EngineConfig, LLMEngine
from scheduler import SamplingParams

PROMPT = [1, *range(20, 61)]  # 41 tokens: five full blocks of 8 (the last token is always computed)
OTHER = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
CONFIG = dict(
    max_num_seqs=4, max_num_batched_tokens=64, block_size=8, max_model_len=128, token_buckets=(8, 64), warm_up=False
)


def engine(loaded, **kwargs) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(**{**CONFIG, "num_blocks": 64, **kwargs}))


def greedy(eng, prompt, max_tokens=10):
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2))
    (out,) = eng.generate_all()
    sample = out.outputs[0]
    return sample.token_ids, [float(np.subtract(*sorted(lp.values(), reverse=True)[:2])) for lp in sample.logprobs]


def handed_over(loaded, decode_kwargs, prefill_kwargs=None):
    """D's greedy tokens after taking P's KV for PROMPT, the tokens D wrote and its prefix hits."""
    prefill = engine(loaded, **(prefill_kwargs or {}))
    prefill.add_request("p", PROMPT, SamplingParams(temperature=0, max_tokens=1), export_kv=True)
    (done,) = prefill.generate_all()
    handoff = done.kv_handoff
    assert handoff.num_blocks == (len(PROMPT) - 1) // 8

    decode = engine(loaded, num_blocks=48, **decode_kwargs)
    decode.add_request("o", OTHER, SamplingParams(temperature=0, max_tokens=3))  # D's free blocks are not P's
    decode.generate_all()
    free = decode.scheduler.kv.num_free_blocks
    written = decode.import_prefix(PROMPT, handoff)
    decode.scheduler.check_integrity()
    assert decode.scheduler.kv.num_free_blocks == free  # cached, and free to evict, as a finished prompt's
    hits_before = decode.scheduler.stats().prefix_cache_hits
    tokens, _ = greedy(decode, PROMPT)
    return tokens, written, decode.scheduler.stats().prefix_cache_hits - hits_before


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_decode_engine_continues_the_handed_prompt_exactly_as_one_engine(tiny_llama, kv_cache_dtype):
    want, _ = greedy(engine(tiny_llama, kv_cache_dtype=kv_cache_dtype), PROMPT)
    got, written, hits = handed_over(
        tiny_llama, dict(kv_cache_dtype=kv_cache_dtype), dict(kv_cache_dtype=kv_cache_dtype)
    )
    assert written == 40 and hits == 40
    assert got == want


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (1, 4), (4, 1)])
def test_prefill_and_decode_split_differently(tiny_llama, prefill_tp, decode_tp):
    """At TP 4 an engine holds each of the model's 2 KV heads twice: the handed blocks are
    repeated or thinned to match."""
    want, margins = greedy(engine(tiny_llama), PROMPT)
    got, written, hits = handed_over(
        tiny_llama, dict(tensor_parallel_size=decode_tp), dict(tensor_parallel_size=prefill_tp)
    )
    assert written == 40 and hits == 40
    clear = next((i for i, m in enumerate(margins) if m < 1e-3), len(margins))
    assert got[: clear + 1] == want[: clear + 1]


def test_blocks_cached_already_are_not_written_again_and_a_bad_fit_is_refused(tiny_llama):
    prefill = engine(tiny_llama)
    prefill.add_request("p", PROMPT, SamplingParams(temperature=0, max_tokens=1))
    prefill.generate_all()
    handoff = prefill.export_prefix(PROMPT)
    assert handoff.num_blocks == 5 and all(x.shape[1] == 5 for x in jax.tree.leaves(handoff.kv))  # no padding
    decode = engine(tiny_llama)
    free = decode.scheduler.kv.num_free_blocks
    other = [1, *range(100, 140)]  # the KV of PROMPT is never written for another prompt, or salt
    for prompt, salt in [(other, None), (PROMPT[:-8], None), (PROMPT, "salt")]:
        with pytest.raises(ValueError, match="another prompt"):
            decode.import_prefix(prompt, handoff, salt)
    assert decode.scheduler.kv.num_free_blocks == free and decode.scheduler.stats().prefix_cache_hits == 0
    decode.add_request("q", PROMPT[:17], SamplingParams(temperature=0, max_tokens=1))  # caches two blocks
    decode.generate_all()
    assert decode.import_prefix(PROMPT, handoff) == 24  # blocks 3 to 5
    assert decode.import_prefix(PROMPT, handoff) == 0
    with pytest.raises(ValueError, match="block size"):
        engine(tiny_llama, block_size=16, token_buckets=(16, 64)).import_prefix(PROMPT, handoff)
    with pytest.raises(ValueError, match="KV dtype"):
        engine(tiny_llama, kv_cache_dtype="int8").import_prefix(PROMPT, handoff)


def test_add_request_takes_the_handoff_and_an_aborted_export_is_dropped(tiny_llama):
    prefill = engine(tiny_llama)
    prefill.add_request("p", PROMPT, SamplingParams(temperature=0, max_tokens=1), export_kv=True)
    prefill.add_request("gone", OTHER, SamplingParams(temperature=0, max_tokens=1), export_kv=True)
    prefill.abort_request("gone")
    (done,) = prefill.generate_all()
    assert done.request_id == "p" and not prefill._exports
    decode = engine(tiny_llama)
    decode.add_request(
        "d", PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), kv_handoff=done.kv_handoff
    )
    (out,) = decode.generate_all()
    assert out.num_cached_tokens == 40
    assert out.outputs[0].token_ids == greedy(engine(tiny_llama), PROMPT, max_tokens=4)[0]
