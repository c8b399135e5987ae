"""An 8-bit KV cache: K and V stored as fp8 (e4m3) or int8 codes with a float32 scale per
token and KV head.

    pages   8-bit codes   [num_pages, page_size, num_kv_heads, head_dim]   (as unquantized)
    scales  float32       [num_pages, num_kv_heads, page_size]             x = scale * code

The scales are head-major within a page so that one KV head's scales of a page are
contiguous (one TMA box in the Mosaic GPU kernel). Each token's vector of one head is
scaled by its own absolute maximum, so a large value in one token never costs another
token its precision. Both attention paths take the scales as an optional argument and
dequantize right after loading a page.

The engine stores fp8 codes as their uint8 bit patterns: XLA on the CPU has no native
e4m3 gather or scatter and converts the whole cache to f16 around each one (measured: 75
ms for a small attention call that takes 1.5 ms on an int8 cache). So the code dtypes are
float8_e4m3fn, uint8 (e4m3 bit patterns) and int8; the attention functions accept each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
# `--kv-cache-dtype` -> the dtype the cache stores its codes in.
KV_DTYPES = {"fp8": jnp.dtype(jnp.uint8), "int8": jnp.dtype(jnp.int8)}
_QMAX = {E4M3: float(jnp.finfo(E4M3).max), jnp.dtype(jnp.uint8): float(jnp.finfo(E4M3).max), jnp.dtype(jnp.int8): 127.0}


def is_quantized_kv(dtype) -> bool:
    return jnp.dtype(dtype) in _QMAX


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] -> (codes [..., head_dim] in `dtype`, float32 scales [...])."""
    dtype = jnp.dtype(dtype)
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / _QMAX[dtype], 1.0)
    q = x / scale[..., None]
    if dtype == jnp.int8:
        q = jnp.round(q)
    # NOTE: the clip guards against x / (amax / qmax) rounding a hair past qmax.
    q = jnp.clip(q, -_QMAX[dtype], _QMAX[dtype])
    if dtype == jnp.uint8:
        return jax.lax.bitcast_convert_type(q.astype(E4M3), jnp.uint8), scale
    return q.astype(dtype), scale


def quantize_kv_calibrated(x: jax.Array, scale: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., num_kv_heads, head_dim] with a fixed scale per KV head [num_kv_heads] (a
    checkpoint's calibrated k_scale or v_scale) -> (codes in `dtype`, float32 scales
    [..., num_kv_heads]: the fixed ones, in the per-token layout attention reads).

    compressed-tensors' rule: x / scale clamped to the type's range (int8: -128 to 127)
    and rounded; a value past the calibrated range saturates."""
    dtype = jnp.dtype(dtype)
    scale = scale.astype(jnp.float32)
    q = x.astype(jnp.float32) / scale[:, None]
    if dtype == jnp.int8:
        q = jnp.round(jnp.clip(q, -128.0, 127.0))
    else:
        q = jnp.clip(q, -_QMAX[dtype], _QMAX[dtype])
    scales = jnp.broadcast_to(scale, x.shape[:-1])
    if dtype == jnp.uint8:
        return jax.lax.bitcast_convert_type(q.astype(E4M3), jnp.uint8), scales
    return q.astype(dtype), scales


def rescale_for(scale: jax.Array, calibrated_for: str, dtype) -> jax.Array:
    """A scale calibrated for one 8-bit type ("fp8" or "int8") as one for `dtype` with the
    same clipping range (the calibrated absolute maximum)."""
    ratio = _QMAX[KV_DTYPES[calibrated_for]] / _QMAX[jnp.dtype(dtype)]
    return scale if ratio == 1.0 else scale * ratio


def codes_to_float(codes: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The values of 8-bit codes (before scaling), in `dtype`."""
    if codes.dtype == jnp.uint8:
        codes = jax.lax.bitcast_convert_type(codes, E4M3)
    return codes.astype(dtype)


def dequantize_kv(q: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Pages [..., page_size, KV, D] and their scales [..., KV, page_size] -> float pages."""
    return (codes_to_float(q) * jnp.swapaxes(scales, -1, -2)[..., None]).astype(dtype)
