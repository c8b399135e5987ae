"""Reductions whose order does not depend on the batch (batch invariance, docs/batch-invariance.md).

XLA picks how it vectorizes a reduction from the whole array's shape: on the CPU an RMSNorm
over 576 lanes (SmolLM2's hidden size) sums a row in another order from 8 rows on, so the row
moves by an ulp when batch mates join it. Two ways out, both used:

- `in_fixed_row_blocks`: run row-wise work in blocks of exactly INVARIANT_ROWS rows (the last
  one padded): every call compiles the same [INVARIANT_ROWS, ...] program whatever the step
  holds (the LM head and the logprob tables; a lax.map, so a loop over the blocks);
- `fixed_order_sum`: a sum written as elementwise adds in an order set by the row's length
  alone (the RMSNorms on a GPU): XLA never reorders float adds, so no shape can change it,
  provided no multiply is fused into the adds (LLVM may contract it into an FMA in one code
  path and not in another: RMSNorm materializes its squares first).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

INVARIANT_ROWS = 16  # the CPU kernels' block too (cpu_kernels.MAX_ROWS)
LANES = 64  # fixed_order_sum's partial sums per row


def in_fixed_row_blocks(fn: Callable, *arrays, rows: int = INVARIANT_ROWS, min_blocks: int = 1):
    """`fn(*arrays)` for arrays [T, ...] cut alike into blocks of exactly `rows` rows (padded
    with zeros, one lax.map step each), results [T, ...] (a pytree of them) put back together.

    `min_blocks` 2 keeps a loop of two steps or more (padding blocks as needed): XLA compiles
    a loop of one step into other code, and in Qwen3's q/k norms and RoPE that moved a row's
    bits (hiding the trip count from XLA, or fencing the body with barriers, did not help)."""
    t = arrays[0].shape[0]
    blocks = max(min_blocks, -(-t // rows))
    pad = blocks * rows - t
    cut = tuple(jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(blocks, rows, *a.shape[1:]) for a in arrays)
    out = jax.lax.map(lambda block: fn(*block), cut)
    return jax.tree.map(lambda o: o.reshape(blocks * rows, *o.shape[2:])[:t], out)


def fixed_order_sum(x: jax.Array) -> jax.Array:
    """x [..., D] summed over its last axis: the D / LANES slices of LANES values added one after
    another (zeros pad the last), then the LANES partial sums halved pairwise down to one."""
    d = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -d % LANES)])
    acc = x[..., :LANES]
    for start in range(LANES, x.shape[-1], LANES):
        acc = acc + x[..., start : start + LANES]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]
