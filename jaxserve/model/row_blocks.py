"""Row-wise work in blocks of one fixed shape, so that a row's bits do not depend on the batch.

XLA picks how it vectorizes a reduction from the whole array's shape: on the CPU an RMSNorm
over 576 lanes (SmolLM2's hidden size) sums a row in another order from 8 rows on, so the row
moves by an ulp when batch mates join it. Run in blocks of exactly INVARIANT_ROWS rows (the
last one padded), every call compiles the same [INVARIANT_ROWS, ...] program whatever the
step holds, and a row's result depends on its own values alone (docs/batch-invariance.md).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

INVARIANT_ROWS = 16  # the CPU kernels' block too (cpu_kernels.MAX_ROWS)


def in_fixed_row_blocks(fn: Callable, *arrays, rows: int = INVARIANT_ROWS):
    """`fn(*arrays)` for arrays [T, ...] cut alike into blocks of exactly `rows` rows (padded
    with zeros, one lax.map step each), results [T, ...] (a pytree of them) put back together."""
    t = arrays[0].shape[0]
    blocks, pad = max(1, -(-t // rows)), -t % rows if t else rows
    cut = tuple(jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(blocks, rows, *a.shape[1:]) for a in arrays)
    out = jax.lax.map(lambda block: fn(*block), cut)
    return jax.tree.map(lambda o: o.reshape(blocks * rows, *o.shape[2:])[:t], out)
