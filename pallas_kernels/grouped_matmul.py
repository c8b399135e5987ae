"""Grouped matmuls for mixture-of-experts layers: rows sorted by group, one weight per group.

    x            [M, K]      rows sorted by group (a MoE layer's token copies, by expert)
    w            [G, K, N]   group g's weight (an expert's projection)
    group_sizes  int32 [G]   rows of each group, in order; they sum to at most M
    -> y         [M, N]      y[r] = x[r] @ w[g(r)]; rows past sum(group_sizes) are zero

The quantized forms hold each group's weight in the layouts of `quantized_matmul`
stacked on a leading [G] axis. These are the pure-JAX versions: the CPU serving path, the
oracle for the Mosaic GPU kernel (`grouped_matmul_mgpu`), and differentiable (jax.grad
goes through `jax.lax.ragged_dot`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul import dequantize_int4, quantize_fp8_per_token


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] sorted by group @ w [G, K, N] -> [M, N] in x's dtype (float32 accumulation)."""
    y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def int4_grouped_matmul_reference(
    x: jax.Array, packed: jax.Array, scales: jax.Array, offsets: jax.Array, group_sizes: jax.Array
) -> jax.Array:
    """Like `grouped_matmul_reference` on int4 weights: packed uint8 [G, K // 2, N], scales and
    offsets float32 [G, K // group, N] (each group as `quantized_matmul`'s int4 layout)."""
    x, packed, scales, offsets = jax.lax.optimization_barrier((x, packed, scales, offsets))  # see int4_matmul_reference
    w = jax.vmap(dequantize_int4, in_axes=(0, 0, 0, None))(packed, scales, offsets, x.dtype)
    return grouped_matmul_reference(x, w, group_sizes)


def fp8_grouped_matmul_reference(
    x: jax.Array, weight: jax.Array, scales: jax.Array, group_sizes: jax.Array
) -> jax.Array:
    """Like `grouped_matmul_reference` on e4m3 weights [G, K, N] with float32 scales [G, N]
    per output channel; x is quantized to e4m3 per row on the fly (W8A8, as fp8_matmul_reference)."""
    x, weight, scales = jax.lax.optimization_barrier((x, weight, scales))
    xq, x_scale = quantize_fp8_per_token(x)
    acc = jax.lax.ragged_dot(
        xq.astype(jnp.float32),
        weight.astype(jnp.float32),
        group_sizes.astype(jnp.int32),
        preferred_element_type=jnp.float32,
    )  # NOTE: e4m3 values are exact in float32, so this equals an fp8 product accumulated in float32
    row_scales = _per_row(scales, group_sizes, x.shape[0])
    return (acc * x_scale[:, None] * row_scales).astype(x.dtype)


def group_ids(group_sizes: jax.Array, rows: int) -> jax.Array:
    """int32 [rows]: the group of each sorted row (G for rows past the last group)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def _per_row(per_group: jax.Array, group_sizes: jax.Array, rows: int) -> jax.Array:
    """per_group [G, N] gathered to the rows [rows, N]; rows past the groups get zeros."""
    padded = jnp.concatenate([per_group, jnp.zeros((1, per_group.shape[1]), per_group.dtype)])
    return padded[group_ids(group_sizes, rows)]
