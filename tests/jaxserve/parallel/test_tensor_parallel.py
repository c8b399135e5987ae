"""Tensor parallelism on several CPU devices (tests/conftest.py asks jax for four): the same
model split over 2, 3 or 4 devices computes what it computes on one.

Oracles: TP 1 (the engine every other test checks against Hugging Face) on the same
weights. Logits agree to float tolerance (the row-parallel all-reduces reorder sums);
greedy tokens agree wherever TP 1's top-2 margin is clear, since a reordered sum may flip
a true near-tie.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.parallel.sharding import check_tensor_parallel, make_mesh
from jaxserve.weights import load_model
from scheduler import SamplingParams
from tests.tiny_models import make_tiny_model

PROMPTS = [[1, 5, 9, 13, 2, 7], [1, 3, 3, 3], [1, 44, 55, 66, 77, 88, 12, 13, 14, 15, 16, 17, 20, 21]]
LATE_PROMPT = [1, *range(30, 70)]  # a prefill chunk next to the decode rows


def engine(loaded, tp: int, **kwargs) -> LLMEngine:
    config = dict(
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_blocks=64,
        block_size=8,
        max_model_len=128,
        tensor_parallel_size=tp,
    )
    return LLMEngine(loaded, EngineConfig(**{**config, **kwargs}))


def mixed_step_logits(loaded, tp: int, **kwargs):
    """Logits of every token of a ragged step (two decode rows and a prefill chunk), after a
    first step prefilled the decode rows, and the compiled body's HLO (`kwargs`: more EngineConfig fields)."""
    eng = engine(loaded, tp, warm_up=False, async_scheduling=False, enable_prefix_caching=False, **kwargs)
    for i, prompt in enumerate(PROMPTS[:2]):
        eng.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=4))
    eng.step()
    eng.add_request("late", LATE_PROMPT, SamplingParams(temperature=0, max_tokens=4))
    batch = eng.scheduler.schedule()
    assert batch.num_seqs == 3 and batch.num_tokens > batch.num_seqs  # decode rows and a chunk
    r = eng.runner
    inputs, pending = r.pad_inputs(batch, *r.bucket_for(batch.num_tokens))
    hlo = r._body.lower(r.params, r.kv, inputs, pending, r.last_tokens).compile().as_text()
    _, r.kv, hidden, _ = r._body_keeping_hidden(r.params, r.kv, inputs, pending, r.last_tokens)
    logits = jax.jit(lambda params, h: nnx.merge(r.graphdef, params).logits(h))(r.params, hidden)
    return np.asarray(logits)[: batch.num_tokens], hlo


@pytest.fixture(scope="module")
def tiny_6_heads(tmp_path_factory):
    """The tiny Llama with 6 query heads and 3 KV heads: it splits over 3 devices."""
    folder = tmp_path_factory.mktemp("tiny-llama-6-heads")
    make_tiny_model("llama", folder, hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    return load_model(str(folder), use_cache=False, progress=False)


@pytest.fixture(scope="module")
def tiny_llama_tp1(tiny_llama):
    return mixed_step_logits(tiny_llama, 1)[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_logits_split_over_devices_equal_one_device(tiny_llama, tiny_llama_tp1, tp):
    """4 heads and 2 KV heads: TP 2 splits both, TP 4 repeats each KV head twice."""
    logits, hlo = mixed_step_logits(tiny_llama, tp)
    np.testing.assert_allclose(logits, tiny_llama_tp1, atol=1e-4, rtol=0)
    assert "all-reduce" in hlo  # the row-parallel matmuls really were split


def test_three_devices_split_six_heads(tiny_6_heads):
    one, hlo_one = mixed_step_logits(tiny_6_heads, 1)
    three, hlo_three = mixed_step_logits(tiny_6_heads, 3)
    np.testing.assert_allclose(three, one, atol=1e-4, rtol=0)
    assert "all-reduce" not in hlo_one and "all-reduce" in hlo_three


def test_weights_and_cache_are_split_not_copied(tiny_llama):
    eng = engine(tiny_llama, 2, warm_up=False)
    q = eng.runner.params["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
    down = eng.runner.params["layers"][0]["mlp"]["down_proj"]["kernel"][...]
    assert {s.data.shape for s in q.addressable_shards} == {(64, 32)}  # [D, H * Dh] split on heads
    assert {s.data.shape for s in down.addressable_shards} == {(48, 64)}  # [F, D] split on F
    k = eng.runner.kv.k  # [L, blocks, block_size, KV, Dh]
    assert {s.data.shape[3] for s in k.addressable_shards} == {1} and k.shape[3] == 2
    assert len({s.device for s in k.addressable_shards}) == 2


def greedy_with_margins(loaded, tp: int, **kwargs):
    """Each prompt's greedy tokens and, per token, its top-2 logprob margin; and the
    compilations after warm-up."""
    eng = engine(loaded, tp, **kwargs)
    compiled = eng.runner.compilations.count
    for i, prompt in enumerate(PROMPTS + [LATE_PROMPT]):
        eng.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                sample = out.outputs[0]
                margins = [float(np.subtract(*sorted(lp.values(), reverse=True)[:2])) for lp in sample.logprobs]
                done[out.request_id] = (sample.token_ids, margins)
    return done, eng.runner.compilations.count - compiled


def assert_same_greedy_where_clear(got, want):
    for rid, (tokens, _) in got.items():
        want_tokens, margins = want[rid]
        clear = next((i for i, m in enumerate(margins) if m < 1e-3), len(margins))
        assert tokens[: clear + 1] == want_tokens[: clear + 1], rid


@pytest.mark.parametrize("tp, kv_cache_dtype", [(2, "auto"), (4, "auto"), (2, "int8")])
def test_greedy_tokens_equal_one_device_and_nothing_compiles_after_warm_up(tiny_llama, tp, kv_cache_dtype):
    want, _ = greedy_with_margins(tiny_llama, 1, kv_cache_dtype=kv_cache_dtype)
    got, compiled_after_warm_up = greedy_with_margins(tiny_llama, tp, kv_cache_dtype=kv_cache_dtype)
    assert_same_greedy_where_clear(got, want)
    assert compiled_after_warm_up == 0


@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
def test_quantized_weights_split_with_their_scales(tiny_llama_dir, method):
    """TP 2 splits the KV heads; TP 4 repeats each (a quantized K/V projection then holds
    twice its outputs)."""
    loaded = load_model(str(tiny_llama_dir), use_cache=False, progress=False, quantization=method)
    one, _ = mixed_step_logits(loaded, 1)
    for tp in (2, 4):
        split, hlo = mixed_step_logits(loaded, tp)
        np.testing.assert_allclose(split, one, atol=1e-4, rtol=0)
        assert "all-reduce" in hlo


def test_heads_that_do_not_divide_are_refused_clearly(tiny_6_heads):
    with pytest.raises(ValueError, match="does not divide the model's 6 attention heads; it can be one of"):
        check_tensor_parallel(tiny_6_heads.config, 4)
    with pytest.raises(ValueError, match="KV heads"):  # 6 heads split in 2 would need 3 KV heads split in 2
        check_tensor_parallel(tiny_6_heads.config, 2)
    with pytest.raises(ValueError, match=r"need 6 devices, and jax sees 4 cpu device"):
        make_mesh(6)
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(tensor_parallel_size=2, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
