"""This device's roofs, measured: memory bandwidth and matmul peak, the two limits of the
roofline. One set of helpers for `python -m jaxserve.plan --measure` and the benchmarks.

Times are wall-clock, the best of several samples, each several calls back to back ended
by `block_until_ready` (dispatch overlaps the previous call), on arrays large enough that
caches do not hold them.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def on_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


def best_seconds(fn, *args, samples: int = 5, calls: int = 3) -> float:
    """Seconds per call of the jitted `fn(*args)`: the best sample, after a warm-up call."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(samples):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _buffer(num_bytes: int | None, dtype=jnp.float32) -> jax.Array:
    num_bytes = num_bytes or (1 << 30 if on_gpu() else 1 << 29)
    return jnp.ones(num_bytes // jnp.dtype(dtype).itemsize, dtype)


def read_bandwidth(num_bytes: int | None = None) -> float:
    """Bytes per second this device reads (a sum over a large array): the roof a
    memory-bound decode step runs under."""
    x = _buffer(num_bytes)
    return x.nbytes / best_seconds(jax.jit(jnp.sum), x)


def copy_bandwidth(num_bytes: int | None = None) -> float:
    """Bytes per second of a device-to-device copy, read and write counted."""
    x = _buffer(num_bytes, jnp.bfloat16)
    return 2 * x.nbytes / best_seconds(jax.jit(lambda a: a * 2), x)  # one fused read + write pass


def matmul_peak(dtype: str = "float32", n: int | None = None) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` ("fp8": e4m3 inputs, float32 accumulation)."""
    n = n or (8192 if on_gpu() else 2048)
    in_dtype = jnp.float8_e4m3fn if dtype == "fp8" else jnp.dtype(dtype)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(in_dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(in_dtype)
    out = jnp.float32 if dtype == "fp8" else None
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=out))
    return 2 * n**3 / best_seconds(matmul, a, b)
