"""Quantized matmuls: int4 and int8 weight-only (W4A16, W8A16), FP8 (e4m3) W8A8, and
block-wise FP8 checkpoints' weights (W8A16).

Weight layouts (K is the contracting axis, N the output axis):

    int4:  packed  uint8   [K // 2, N]   row i holds k = 2i in its low nibble, 2i + 1 in its high
           scales  float32 [K // group, N]
           offsets float32 [K // group, N]   w[k, n] = scales[g, n] * nibble + offsets[g, n], g = k // group
    int8:  weight  int8    [K, N]
           scales  float32 [K // group, N]   w[k, n] = scales[g, n] * weight[k, n]
    int8_asym: int8's, and offsets float32 [K // group, N]   w[k, n] = scales[g, n] * weight[k, n] + offsets[g, n]
    fp8:   weight  e4m3    [K, N]
           scales  float32 [N]               w[k, n] = scales[n] * weight[k, n]
    fp8_block (block-wise FP8 checkpoints, blocks of bk inputs by bn outputs):
           weight  e4m3    [K, N]
           scales  float32 [ceil(K / bk), ceil(N / bn)]   w[k, n] = scales[k // bk, n // bn] * weight[k, n]

The asymmetric int4 form holds GGUF's Q4_1 (`d * q + m`) and Q4_0 (`d * (q - 8)`)
exactly, and compressed-tensors' zero points (`s * (q - z)`); the symmetric int8 form
holds GGUF's Q8_0 (`d * q`, group 32), Q5_0 and Q6_K exactly, the asymmetric one its Q5_1
(`d * q + m`) and Q5_K. This module holds the
pure-JAX versions: the CPU serving path and the oracle for the Pallas kernels. Those
(`quantized_matmul_mgpu`) take the same weights after a one-time, load-time conversion
to their own layout (`prepare_int4`, `prepare_fp8`: K-major [N, K], N padded); these
canonical layouts stay what loaders, caches and the references use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448


def unpack_int4(packed: jax.Array) -> jax.Array:
    """uint8 [K // 2, N] -> uint8 [K, N] nibbles, in k order."""
    low, high = packed & 0xF, packed >> 4
    return jnp.stack([low, high], axis=1).reshape(2 * packed.shape[0], packed.shape[1])


def dequantize_int4(packed: jax.Array, scales: jax.Array, offsets: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The float weight [K, N] an int4 layer stands for."""
    q = unpack_int4(packed).astype(jnp.float32)
    groups, n = scales.shape
    q = q.reshape(groups, -1, n)
    return (q * scales[:, None, :] + offsets[:, None, :]).reshape(-1, n).astype(dtype)


def int4_matmul_reference(x: jax.Array, packed: jax.Array, scales: jax.Array, offsets: jax.Array) -> jax.Array:
    """x [M, K] @ the int4 weight -> [M, N] in x's dtype (the weight is upcast to it)."""
    # NOTE: the barrier makes the upcast wait for x. Without it XLA, seeing that the float
    # weights do not depend on the activations, may upcast every layer's weights at the start
    # of the step: the whole float model written and read back each step.
    x, packed, scales, offsets = jax.lax.optimization_barrier((x, packed, scales, offsets))
    w = dequantize_int4(packed, scales, offsets, x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def int8_matmul_reference(
    x: jax.Array, weight: jax.Array, scales: jax.Array, offsets: jax.Array | None = None
) -> jax.Array:
    """x [M, K] @ the int8 weight (scales * q, + offsets per group where given) -> [M, N] in
    x's dtype (the weight is upcast to it)."""
    x, weight, scales, offsets = jax.lax.optimization_barrier((x, weight, scales, offsets))  # see int4_matmul_reference
    groups, n = scales.shape
    w = weight.astype(jnp.float32).reshape(groups, -1, n) * scales[:, None, :]
    if offsets is not None:
        w = w + offsets[:, None, :]
    return jnp.dot(x, w.reshape(-1, n).astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def dequantize_fp8_block(weight: jax.Array, scales: jax.Array, block: tuple[int, int], dtype=jnp.float32) -> jax.Array:
    """The float weight [K, N] of an fp8_block layer; block = (bn, bk), as checkpoints give it."""
    bn, bk = block
    k, n = weight.shape
    full = jnp.repeat(jnp.repeat(scales, bk, axis=0)[:k], bn, axis=1)[:, :n]
    return (weight.astype(jnp.float32) * full).astype(dtype)


def fp8_block_matmul_reference(x: jax.Array, weight: jax.Array, scales: jax.Array, block: tuple[int, int]) -> jax.Array:
    """x [M, K] @ the fp8_block weight -> [M, N] in x's dtype: the weight dequantized to x's
    dtype (W8A16; the activations are not quantized), float32 accumulation."""
    x, weight, scales = jax.lax.optimization_barrier((x, weight, scales))  # see int4_matmul_reference
    w = dequantize_fp8_block(weight, scales, block, x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def quantize_fp8_per_token(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic per-row activation quantization: (e4m3 [M, K], float32 scales [M])."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    # NOTE: times the reciprocal, not / FP8_MAX: XLA rewrites a division by a constant into
    # this product under jit but not always eagerly (a 1-row call divided exactly), and a
    # row's scale must not depend on how many rows the call has (batch invariance).
    scale = jnp.where(amax > 0, amax * (1 / FP8_MAX), 1.0)
    q = jnp.clip(x.astype(jnp.float32) / scale[:, None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


def fp8_matmul_reference(x: jax.Array, weight: jax.Array, scales: jax.Array) -> jax.Array:
    """x [M, K] @ the e4m3 weight [K, N] -> [M, N] in x's dtype.

    x is quantized to e4m3 per token on the fly; the product accumulates in float32 and
    both scales are applied to it (per token, per output channel).
    """
    x, weight, scales = jax.lax.optimization_barrier((x, weight, scales))  # see int4_matmul_reference
    xq, x_scale = quantize_fp8_per_token(x)
    acc = jax.lax.dot(xq, weight, preferred_element_type=jnp.float32)
    return (acc * x_scale[:, None] * scales[None, :]).astype(x.dtype)
