"""The 8-bit KV cache (--kv-cache-dtype fp8 / int8): the quantizer's error bounds, the
write path, the capacity it buys, and the engine with it against the engine itself run
other ways (alone vs batched, prefix caching, chunked prefill, preemption, forks)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_cache import (
    allocate_kv_cache,
    copy_blocks,
    kv_bytes_per_token,
    num_blocks_for_memory,
    resolve_kv_cache_dtype,
    write_kv,
)
from pallas_kernels.quantized_kv import codes_to_float, dequantize_kv, quantize_kv
from scheduler import SamplingParams

E4M3 = jnp.float8_e4m3fn


def vectors(rng, n=200, d=64):
    x = rng.normal(size=(n, d)).astype(np.float32) * np.exp(rng.normal(scale=2.0, size=(n, 1))).astype(np.float32)
    x[0] = 0.0  # an all-zero vector
    x[1, 5] = 1e4  # an outlier dominates only its own token's scale
    x[2] = 1e-30  # tiny values
    return x


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, E4M3])
def test_round_trip_error_bounds(dtype):
    x = vectors(np.random.default_rng(0))
    q, scale = quantize_kv(jnp.asarray(x), dtype)
    assert q.dtype == jnp.dtype(dtype) and scale.shape == x.shape[:1] and scale.dtype == jnp.float32
    back = np.asarray(codes_to_float(q)) * np.asarray(scale)[:, None]
    amax = np.abs(x).max(-1)
    err = np.abs(back - x)
    assert np.all(back[0] == 0) and np.asarray(scale)[0] == 1.0
    if jnp.dtype(dtype) == jnp.int8:  # uniform: half a step of amax / 127
        assert np.all(err <= amax[:, None] / 127 * 0.5 * (1 + 1e-5) + 1e-37)
    else:  # e4m3: 3 mantissa bits (half-ulp 2^-4 relative), subnormal spacing 2^-9 of the scale
        scale_np = np.asarray(scale)[:, None]
        assert np.all(err <= np.maximum(np.abs(x) * 2.0**-4, scale_np * 2.0**-10) * (1 + 1e-5) + 1e-37)
    # Each token's largest value comes back (almost) exactly: the scale is its own.
    top = np.abs(x).argmax(-1)
    np.testing.assert_allclose(np.abs(back[np.arange(len(x)), top]), amax, rtol=1e-6)


def test_fp8_codes_are_e4m3_bit_patterns():
    x = jnp.asarray(vectors(np.random.default_rng(1), n=8))
    bits, s1 = quantize_kv(x, jnp.uint8)
    values, s2 = quantize_kv(x, E4M3)
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(values).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))
    np.testing.assert_array_equal(np.asarray(codes_to_float(bits)), np.asarray(values).astype(np.float32))


def tiny_config(**kw):
    return ModelConfig(
        **{
            "architecture": "LlamaForCausalLM",
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 128,
            **kw,
        }
    )


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_write_then_read_back(name):
    cfg = tiny_config()
    dtype = resolve_kv_cache_dtype(name, jnp.float32)
    kv = allocate_kv_cache(cfg, num_blocks=6, block_size=4, dtype=dtype)
    assert kv.k.dtype == dtype and kv.k_scale.shape == (2, 6, 2, 4)
    rng = np.random.default_rng(2)
    k, v = (rng.normal(size=(5, 2, 16)).astype(np.float32) for _ in range(2))
    slots = np.array([4 * 1 + 1, 4 * 1 + 2, 4 * 4 + 0, 4 * 3 + 3, 4 * 5 + 3])  # blocks 1, 1, 4, 3, 5
    kv = write_kv(kv, jnp.int32(1), jnp.asarray(slots), jnp.asarray(k), jnp.asarray(v))  # layer 1
    for codes, scales, want in [(kv.k, kv.k_scale, k), (kv.v, kv.v_scale, v)]:
        got = np.asarray(dequantize_kv(codes, scales))[1].reshape(-1, 2, 16)[slots]
        np.testing.assert_allclose(got, want, atol=np.abs(want).max() * 2.0**-4)
        # The scales sit at [layer, block, head, offset]; every other slot's is still zero.
        s = np.asarray(scales)[1]
        for slot, row in zip(slots, want):
            np.testing.assert_allclose(
                s[slot // 4, :, slot % 4], np.abs(row).max(-1) / (127 if name == "int8" else 448), rtol=1e-6
            )
        assert np.count_nonzero(scales) == len(slots) * 2


def test_copy_on_write_copies_scales():
    kv = allocate_kv_cache(tiny_config(), num_blocks=5, block_size=4, dtype=jnp.int8)
    rng = np.random.default_rng(3)
    kv.k_scale = jnp.asarray(rng.random(kv.k_scale.shape, np.float32))
    kv.k = jnp.asarray(rng.integers(-128, 128, kv.k.shape, np.int8))
    out = copy_blocks(kv, jnp.asarray([[2, 4], [0, 0]]))
    for before, after in [(kv.k, out.k), (kv.k_scale, out.k_scale), (kv.v_scale, out.v_scale)]:
        np.testing.assert_array_equal(np.asarray(after)[:, 4], np.asarray(before)[:, 2])
        np.testing.assert_array_equal(np.asarray(after)[:, :4], np.asarray(before)[:, :4])


def test_capacity_grows_by_the_real_ratio():
    cfg = tiny_config(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)  # the default model's cache shape
    memory = 256 << 20
    bf16 = num_blocks_for_memory(cfg, memory, 16, jnp.bfloat16)
    f32 = num_blocks_for_memory(cfg, memory, 16, jnp.float32)
    for name in ("fp8", "int8"):
        dtype = resolve_kv_cache_dtype(name, jnp.bfloat16)
        assert kv_bytes_per_token(cfg, dtype) == 2 * 30 * 3 * (64 + 4)  # codes + one float32 scale per head
        blocks = num_blocks_for_memory(cfg, memory, 16, dtype)
        assert blocks / bf16 == pytest.approx(128 / 68, rel=1e-3)  # 1.88x
        assert blocks / f32 == pytest.approx(256 / 68, rel=1e-3)  # 3.76x
        assert allocate_kv_cache(cfg, blocks, 16, dtype).nbytes <= memory
    with pytest.raises(ValueError, match="not one of auto, fp8, int8"):
        resolve_kv_cache_dtype("fp4", jnp.float32)


# -- the engine with an 8-bit cache ------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(loaded, prompts, params=GREEDY, **kw):
    config = dict(
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        block_size=4,
        num_blocks=64,
        kv_cache_dtype="fp8",
        warm_up=False,
    )
    engine = LLMEngine(loaded, EngineConfig(**{**config, **kw}))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {o.request_id: [list(c.token_ids) for c in o.outputs] for o in engine.generate_all()}
    return [outs[str(i)] for i in range(len(prompts))], engine


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_batched_equals_alone_and_the_ways_of_running(tiny_llama, kv_cache_dtype):
    batched, engine = run(tiny_llama, PROMPTS, kv_cache_dtype=kv_cache_dtype)
    assert engine.runner.kv.k_scale is not None
    alone = [run(tiny_llama, [p], kv_cache_dtype=kv_cache_dtype)[0][0] for p in PROMPTS]
    assert batched == alone
    if kv_cache_dtype == "int8":
        return  # the rest is the same code path for both
    # Chunked prefill (8-token steps), no prefix caching, and a cache so small that
    # sequences are preempted and recomputed: the same tokens.
    assert (
        run(tiny_llama, PROMPTS, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=8, token_buckets=(8,))[0]
        == batched
    )
    assert run(tiny_llama, PROMPTS, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)[0] == batched
    preempted, small = run(tiny_llama, PROMPTS, kv_cache_dtype=kv_cache_dtype, num_blocks=10)
    assert small.scheduler.stats().num_preemptions > 0
    assert preempted == batched


def test_prefix_cache_hits_and_forks_keep_their_scales(tiny_llama):
    shared = list(range(3, 19))  # four full blocks
    first, _ = run(tiny_llama, [shared + [40, 41]])
    # The second request reuses the first's cached blocks (their codes and scales).
    _, engine = run(tiny_llama, [shared + [40, 41]])
    engine.add_request("again", shared + [40, 41], GREEDY)
    again = {o.request_id: list(o.outputs[0].token_ids) for o in engine.generate_all()}["again"]
    assert engine.scheduler.stats().prefix_cache_hits >= 16
    assert again == first[0][0]
    # n=2 greedy samples fork one sequence (copy-on-write of its last, partial block).
    forked, _ = run(tiny_llama, [shared + [40, 41]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2))
    assert forked[0] == [first[0][0], first[0][0]]


def test_cache_config_in_the_start_up_log(tiny_llama, caplog):
    with caplog.at_level("INFO", logger="jaxserve.engine.builder"):
        _, engine = run(tiny_llama, [[5, 6]], kv_cache_dtype="int8", num_blocks=None, kv_cache_memory=1 << 20)
    full = num_blocks_for_memory(tiny_llama.config, 1 << 20, 4, tiny_llama.model.dtype)
    assert engine.runner.kv.num_blocks > 2 * full  # a float32 model: 4 D / (D + 4) times the blocks
    assert any("int8 with float32 scales per token and KV head" in r.message for r in caplog.records)
    info = engine.cache_config_info()
    assert info["cache_dtype"] == "int8" and info["num_gpu_blocks"] == str(engine.runner.kv.num_blocks - 1)


def test_scales_dtype_is_ml_dtypes_compatible():
    # The fp8 bit patterns read as ml_dtypes' e4m3 on the host too (what a debugger sees).
    bits, _ = quantize_kv(jnp.asarray([[1.0, -2.0, 0.5, 448.0]]), jnp.uint8)
    np.testing.assert_array_equal(
        np.asarray(bits).view(ml_dtypes.float8_e4m3fn).astype(np.float32), [[1.0, -2.0, 0.5, 448.0]]
    )


# -- quality on the default model ---------------------------------------------------------


def test_default_model_with_8bit_caches_agrees_with_the_full_cache(default_model):
    """The first 510 predicted tokens of benchmarks/quality_text.txt (two 256-token
    windows), teacher-forced with each cache. Measured (2026-12-01): fp8 mean KL 0.023,
    top-1 91.2 %; int8 0.0044, 96.7 %; the bounds leave a margin over those."""
    from benchmarks.quality import TEXT, LogitStats, logit_stats, summarize, text_windows, window_logits_fn

    windows = text_windows(default_model.tokenizer, TEXT.read_text(), 256)[:2]
    full = window_logits_fn(default_model, 256)
    reference = [full(ids)[:-1] for ids in windows]
    got = {}
    for name in ("auto", "fp8", "int8"):
        fn = window_logits_fn(default_model, 256, name)
        stats = LogitStats()
        for ids, ref in zip(windows, reference):
            stats += logit_stats(ref, fn(ids)[:-1], np.asarray(ids[1:]))
        got[name] = summarize(stats)
    assert got["auto"]["mean_kl"] == 0 and got["auto"]["top1_agreement"] == 1  # the same cache: the same logits
    assert got["fp8"]["mean_kl"] < 0.035 and got["fp8"]["top1_agreement"] > 0.87
    assert got["int8"]["mean_kl"] < 0.008 and got["int8"]["top1_agreement"] > 0.93
    assert got["int8"]["mean_kl"] < got["fp8"]["mean_kl"]  # 7 bits of uniform precision vs e4m3's 3 mantissa bits

    # And the engine, greedy, with an fp8 cache: the smoke-test answer is unchanged.
    engine = LLMEngine(
        default_model,
        EngineConfig(
            max_num_seqs=2,
            max_num_batched_tokens=64,
            kv_cache_dtype="fp8",
            kv_cache_memory=16 << 20,
            max_model_len=256,
            warm_up=False,
        ),
    )
    engine.add_request("a", "The capital of France is", SamplingParams(temperature=0, max_tokens=2))
    assert engine.generate_all()[0].outputs[0].text == " Paris."
