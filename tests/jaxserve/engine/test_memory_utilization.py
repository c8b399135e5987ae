"""--gpu-memory-utilization: the KV cache gets `utilization * device memory` less what the
weights and the largest step's activations took (vLLM's sizing); 0.9 by default on a
device that reports its memory, a fixed 1 GiB on the CPU; with tensor parallelism every
device is measured and the smallest budget wins.

The CPU reports no device memory, so the arithmetic is checked with injected device
figures, by hand; the engine's order (probe, measure, then allocate) with the device's
figures injected and the live arrays counted; and the CPU's default and refusal for real.
The GPU path itself runs in benchmarks/gpu_check.sh (--only memory, --only kvdefault)."""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest

from jaxserve.engine import EngineConfig, LLMEngine, kv_memory
from jaxserve.engine.config import DEFAULT_CPU_KV_CACHE_MEMORY
from jaxserve.model.config import ModelConfig
from jaxserve.model.kv_cache import kv_bytes_per_token
from jaxserve.model.sizing import kv_budget_for_utilization, kv_budget_per_device, per_device_config, plan_kv
from scheduler import SamplingParams
from tests.api.conftest import REPO

GiB, MiB = 2**30, 2**20


def test_budget_is_utilization_of_total_less_the_peak():
    # An 80 GiB device, 2 GiB of weights and 1 GiB of activations at the peak, 0.9 of it:
    # 72 GiB allowed, 69 GiB for the cache.
    budget = kv_budget_for_utilization(0.9, total_bytes=80 * GiB, peak_bytes=2 * GiB + 1 * GiB)
    assert budget == 69 * GiB
    # A Llama-style config: 16 layers, 8 KV heads of 64 in bf16: K and V are
    # 2 * 16 * 8 * 64 * 2 = 32 KiB a token, 512 KiB a 16-token block: 69 GiB is 141312 blocks.
    cfg = ModelConfig(
        "LlamaForCausalLM",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
    )
    plan = plan_kv(cfg, "bfloat16", context=4096, block_size=16, memory_bytes=budget)
    assert plan.num_blocks == 69 * 2048 == 141312
    assert plan.max_sequences == (141312 - 1) // 256


def test_nothing_left_is_refused_saying_what_is_needed():
    # 0.9 of 10 GiB is 9 GiB; the peak is 9.5 GiB: more than 0.95 is needed.
    with pytest.raises(ValueError, match=r"nothing is left for the KV cache; give more than 0\.950"):
        kv_budget_for_utilization(0.9, total_bytes=10 * GiB, peak_bytes=9 * GiB + GiB // 2)
    with pytest.raises(ValueError, match="nothing is left"):  # exactly used up is nothing too
        kv_budget_for_utilization(0.5, total_bytes=10 * GiB, peak_bytes=5 * GiB)


@pytest.mark.parametrize("utilization", [0, -0.1, 1.5])
def test_a_fraction_out_of_range_is_refused(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_for_utilization(utilization, total_bytes=10 * GiB, peak_bytes=GiB)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a fraction in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=utilization)


def test_the_cpu_refuses_it_before_loading_weights():
    assert jax.devices()[0].memory_stats() is None  # the premise: the CPU reports no memory
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLMEngine.from_model("/nonexistent/model", gpu_memory_utilization=0.5)  # refused before the path is read


def test_the_server_refuses_it_on_the_cpu():
    proc = subprocess.run(
        [sys.executable, "-m", "api", "--gpu-memory-utilization", "0.5", "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--kv-cache-memory" in proc.stderr and "gpu_memory_utilization" in proc.stderr


def test_engine_measures_after_warm_up_and_before_allocating(tiny_llama, monkeypatch):
    """With the device's figures injected (the bytes of jax's live arrays as the peak, at
    the moment the engine asks), the cache is what the arithmetic gives, the real cache
    did not exist yet when the engine measured, and the probe's cache is gone after."""
    cfg = tiny_llama.config
    block = 16
    probe_shape = (cfg.num_layers, 2, block, cfg.num_kv_heads, cfg.head_dim)  # K or V of 2 blocks
    probe_kv = 2 * block * kv_bytes_per_token(cfg, "float32")

    def caches():
        return [a.shape for a in jax.live_arrays() if a.ndim == 5]

    def device_stats(device):
        seen["live"] = sum(a.nbytes for a in jax.live_arrays())
        seen["caches"] = caches()
        return {"bytes_limit": total, "peak_bytes_in_use": seen["live"]}

    seen = {}
    total = 2 * (sum(a.nbytes for a in jax.live_arrays()) + 8 * MiB)
    probes_before = caches().count(probe_shape)
    monkeypatch.setattr(kv_memory, "device_memory_stats", device_stats)
    limits = dict(
        max_num_seqs=2,
        max_num_batched_tokens=16,
        token_buckets=(16,),
        max_model_len=64,
        block_size=block,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(tiny_llama, EngineConfig(gpu_memory_utilization=0.5, **limits))

    budget = total // 2 - (seen["live"] - probe_kv)
    expected = plan_kv(cfg, "float32", context=64, block_size=block, memory_bytes=budget).num_blocks
    assert engine.runner.kv.num_blocks == expected > 100
    # When it measured, the probe's K and V (2 blocks) were alive and the real cache was not;
    # now the probe's are gone.
    shape = (cfg.num_layers, expected, block, cfg.num_kv_heads, cfg.head_dim)
    assert seen["caches"].count(probe_shape) == probes_before + 2 and shape not in seen["caches"]
    assert caches().count(probe_shape) == probes_before

    # The same requests through an engine given that many blocks directly: the same tokens.
    direct = LLMEngine(tiny_llama, EngineConfig(num_blocks=expected, warm_up=False, **limits))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for e in (engine, direct):
        e.add_request("a", [5, 6, 7, 8, 9], params)
        e.add_request("b", [10, 11, 12], params)
    tokens = [{o.request_id: o.outputs[0].token_ids for o in e.generate_all()} for e in (engine, direct)]
    assert tokens[0] == tokens[1] and len(tokens[0]["a"]) == 8


def test_tensor_parallel_budget_is_the_smallest_devices():
    # Two 80 GiB devices at 0.9 (72 GiB allowed on each); at the peak device 0 held 8 GiB of
    # weights and activations, device 1 10 GiB, and each 1 MiB of the probe's cache.
    stats = {
        "cuda:0": {"bytes_limit": 80 * GiB, "peak_bytes_in_use": 8 * GiB + MiB},
        "cuda:1": {"bytes_limit": 80 * GiB, "peak_bytes_in_use": 10 * GiB + MiB},
    }
    budget = kv_budget_per_device(0.9, stats, {"cuda:0": MiB, "cuda:1": MiB})
    assert budget.per_device == {"cuda:0": 64 * GiB, "cuda:1": 62 * GiB}
    assert (budget.bytes, budget.limiting_device) == (62 * GiB, "cuda:1")
    # A smaller device bounds it though it holds less: 0.9 of 40 GiB is 36 GiB, less 4 GiB.
    stats["cuda:2"] = {"bytes_limit": 40 * GiB, "peak_bytes_in_use": 4 * GiB}
    budget = kv_budget_per_device(0.9, stats, {"cuda:0": MiB, "cuda:1": MiB})
    assert (budget.bytes, budget.limiting_device) == (32 * GiB, "cuda:2")
    # One device alone: the single-device figure of kv_budget_for_utilization.
    one = kv_budget_per_device(0.9, {"cuda:0": stats["cuda:0"]}, {"cuda:0": MiB})
    assert one.bytes == kv_budget_for_utilization(0.9, total_bytes=80 * GiB, peak_bytes=8 * GiB) == 64 * GiB


def test_a_device_with_nothing_left_is_named():
    stats = {
        "cuda:0": {"bytes_limit": 10 * GiB, "peak_bytes_in_use": 2 * GiB},
        "cuda:1": {"bytes_limit": 10 * GiB, "peak_bytes_in_use": 6 * GiB},
    }
    with pytest.raises(ValueError, match=r"^cuda:1: gpu_memory_utilization 0\.5 allows .* nothing is left"):
        kv_budget_per_device(0.5, stats, {})


LIMITS = dict(
    max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,), max_model_len=64, enable_prefix_caching=False
)


def test_the_cpu_default_is_a_fixed_size(tiny_llama):
    assert jax.devices()[0].memory_stats() is None
    engine = LLMEngine(tiny_llama, EngineConfig(warm_up=False, **LIMITS))
    plan = plan_kv(tiny_llama.config, "float32", context=64, memory_bytes=DEFAULT_CPU_KV_CACHE_MEMORY)
    assert DEFAULT_CPU_KV_CACHE_MEMORY == GiB and engine.runner.kv.num_blocks == plan.num_blocks


def injected_memory(monkeypatch, totals: dict[int, int]) -> dict:
    """Device figures for the engine (device id -> bytes_limit), the peak being the bytes of
    jax's live arrays on that device at the moment the engine asks; what it saw, by device id."""
    seen = {}

    def device_stats(device):
        live = sum(s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards if s.device == device)
        seen[device.id] = live
        return {"bytes_limit": totals[device.id], "peak_bytes_in_use": live}

    monkeypatch.setattr(kv_memory, "device_memory_stats", device_stats)
    return seen


def test_a_device_that_reports_memory_gets_0_9_of_it_unless_a_size_is_given(tiny_llama, monkeypatch):
    cfg = tiny_llama.config
    probe_kv = 2 * 16 * kv_bytes_per_token(cfg, "float32")
    total = 2 * (sum(a.nbytes for a in jax.live_arrays()) + 8 * MiB)
    seen = injected_memory(monkeypatch, {0: total})
    engine = LLMEngine(tiny_llama, EngineConfig(**LIMITS))  # nothing given: the default fraction
    budget = kv_budget_for_utilization(0.9, total_bytes=total, peak_bytes=seen[0] - probe_kv)
    expected = plan_kv(cfg, "float32", context=64, memory_bytes=budget).num_blocks
    assert engine.runner.kv.num_blocks == expected > 100
    del engine

    seen.clear()  # a size given wins, and the device is not measured
    engine = LLMEngine(tiny_llama, EngineConfig(kv_cache_memory=4 * MiB, warm_up=False, **LIMITS))
    assert engine.runner.kv.num_blocks == plan_kv(cfg, "float32", context=64, memory_bytes=4 * MiB).num_blocks
    engine = LLMEngine(tiny_llama, EngineConfig(num_blocks=40, gpu_memory_utilization=0.5, warm_up=False, **LIMITS))
    assert engine.runner.kv.num_blocks == 40 and seen == {}


def test_tensor_parallel_measures_every_device_and_takes_the_smallest(tiny_llama, monkeypatch):
    cfg = tiny_llama.config
    live = sum(a.nbytes for a in jax.live_arrays())
    # Device 1 is the smaller by 40 MiB (20 MiB of budget at 0.5). What each device already
    # holds (arrays earlier tests left on device 0) is added to its own total, so it cannot
    # decide which device is smaller.
    held = {
        i: sum(s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards if s.device.id == i)
        for i in (0, 1)
    }
    totals = {0: 4 * live + 2 * held[0] + 64 * MiB, 1: 4 * live + 2 * held[1] + 24 * MiB}
    seen = injected_memory(monkeypatch, totals)
    engine = LLMEngine(tiny_llama, EngineConfig(tensor_parallel_size=2, gpu_memory_utilization=0.5, **LIMITS))
    # Each device held half the probe's K and V (one of the two KV heads).
    probe_kv = 2 * 16 * kv_bytes_per_token(per_device_config(cfg, 2), "float32")
    stats = {str(d): {"bytes_limit": totals[d.id], "peak_bytes_in_use": seen[d.id]} for d in engine.mesh.devices.flat}
    budget = kv_budget_per_device(0.5, stats, dict.fromkeys(stats, probe_kv))
    assert set(seen) == {0, 1} and budget.limiting_device == str(jax.devices()[1])
    expected = plan_kv(cfg, "float32", context=64, memory_bytes=budget.bytes, tp=2).num_blocks
    assert engine.runner.kv.num_blocks == expected > 100
    assert min(budget.per_device.values()) < max(budget.per_device.values())  # the smaller one was taken
