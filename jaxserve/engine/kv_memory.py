"""The KV cache's memory per device: what was given, else a fraction of what the device
reports (vLLM's --gpu-memory-utilization, measured after a probe's warm-up), else a fixed
size on the CPU, which reports nothing. The arithmetic is jaxserve.model.sizing's
(kv_budget_per_device); here are the device reads and the probe."""

from __future__ import annotations

import logging

import jax
import numpy as np

from jaxserve.engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig
from jaxserve.model.sizing import both_units, kv_budget_per_device
from jaxserve.parallel.sharding import resident_bytes

logger = logging.getLogger(__name__)


def kv_memory_bytes(config: EngineConfig, make_runner, max_model_len: int, mesh, progress=False) -> int | None:
    """The KV cache's bytes per device (None: config.num_blocks sizes it). What was given
    wins: num_blocks, then kv_cache_memory, then gpu_memory_utilization. Given none, a
    device that reports its memory (a GPU) gets DEFAULT_GPU_MEMORY_UTILIZATION of it and the
    CPU a fixed DEFAULT_CPU_KV_CACHE_MEMORY."""
    if config.num_blocks is not None:
        return None
    if config.kv_cache_memory is not None:
        if config.gpu_memory_utilization is not None:
            logger.info("kv_cache_memory given: gpu_memory_utilization %s is not used", config.gpu_memory_utilization)
        return config.kv_cache_memory
    if config.gpu_memory_utilization is not None:
        return kv_memory_for_utilization(make_runner, max_model_len, config.gpu_memory_utilization, mesh, progress)
    devices = local_devices(mesh)
    if any(device_memory_stats(d) is None for d in devices):
        return DEFAULT_CPU_KV_CACHE_MEMORY  # the CPU: a fixed size, as before
    spec = config.speculative_config
    if spec is not None and spec.method != "ngram":
        logger.info(
            "KV cache: %s per device, not %s of the memory: the %s model loads after the cache is sized and "
            "is not measured (give --gpu-memory-utilization or --kv-cache-memory)",
            both_units(DEFAULT_CPU_KV_CACHE_MEMORY),
            DEFAULT_GPU_MEMORY_UTILIZATION,
            spec.method,
        )
        return DEFAULT_CPU_KV_CACHE_MEMORY
    try:
        return kv_memory_for_utilization(make_runner, max_model_len, DEFAULT_GPU_MEMORY_UTILIZATION, mesh, progress)
    except ValueError as e:
        raise ValueError(
            f"{e} (gpu_memory_utilization {DEFAULT_GPU_MEMORY_UTILIZATION} is the default on this device; the peak "
            "counts all this process has held, another engine's too: give kv_cache_memory to size the cache alone)"
        ) from None


def kv_memory_for_utilization(make_runner, max_model_len: int, utilization: float, mesh, progress=False) -> int:
    """The KV cache's bytes per device under gpu_memory_utilization, as vLLM sizes it.

    The order matters: the activations of the largest step are known only once it has
    run, and running needs a cache. So a probe runner with the smallest cache (the null
    block and one more) compiles and runs every step shape first (warm-up, the largest
    included); each device's peak in use then is its weights plus the largest step's
    activations plus that small cache. A device's cache gets `utilization * bytes_limit`
    less that peak (the probe's cache excepted), and every device of the mesh gets the
    smallest device's figure (tensor parallelism: one cache shape; several nodes agree on
    it). The probe is freed before the real runner allocates its cache. Its programs
    compile again for the real cache's shape (the persistent compilation cache keeps both
    for the next start). A peak from loading the weights (jax cannot reset it) only makes
    the figure smaller, never too large. Not counted: a draft model (speculative_config),
    which loads after the cache is sized."""
    devices = local_devices(mesh)
    for device in devices:
        require_memory_stats(device)
    probe = make_runner(num_blocks=2, max_model_len=max_model_len)
    probe.warm_up(progress=progress)
    stats = {str(d): device_memory_stats(d) for d in devices}
    held = resident_bytes(probe.kv)  # by device id
    probe_kv = {str(d): held.get(d.id, 0) for d in devices}
    jax.tree.map(lambda a: a.delete(), probe.kv)
    del probe
    budget = kv_budget_per_device(utilization, stats, probe_kv)
    limiting = budget.limiting_device
    logger.info(
        "gpu_memory_utilization %s of %s on %s (the smallest budget of %d devices): weights and activations "
        "peaked at %s; KV cache budget %s per device",
        utilization,
        both_units(stats[limiting]["bytes_limit"]),
        limiting,
        len(devices),
        both_units(stats[limiting]["peak_bytes_in_use"] - probe_kv[limiting]),
        both_units(budget.bytes),
    )
    if jax.process_count() > 1:  # every node must allocate the same cache: the smallest node's
        from jax.experimental import multihost_utils

        mib = multihost_utils.process_allgather(np.int32(budget.bytes // 2**20))  # int32: jax's default ints
        return int(mib.min()) * 2**20
    return budget.bytes


def local_devices(mesh) -> list:
    """The mesh's devices this process can read (all of them on one host)."""
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def device_memory_stats(device) -> dict | None:
    """The device's allocator figures (`bytes_limit`, `peak_bytes_in_use`, ...); None on the CPU."""
    return device.memory_stats()


def require_memory_stats(device) -> None:
    if device_memory_stats(device) is None:
        raise ValueError(
            f"gpu_memory_utilization needs a device that reports its memory; the {device.platform} "
            "device does not: size the KV cache with kv_cache_memory (--kv-cache-memory) instead"
        )
