"""LoRA's batched products on Hopper as segmented gather matmuls (Punica's SGMV), built on
the Mosaic GPU grouped matmul (`grouped_matmul_mgpu`).

Same result as `jaxserve.model.lora.bgmv_reference(x, a, b, slots)`: every row t gets
(x[t] @ a[slots[t]]) @ b[slots[t]], shrunk to the rank in float32 and rounded to x's dtype,
then expanded. The reference multiplies every row by all slots' columns and masks; here a
step reads only the slots its rows use:

    order  = rows sorted by slot, slot-0 rows ("no adapter") last
    sizes  = rows per slot, slot 0's counted as none
    shrunk = grouped_matmul(x[order], a, sizes)       [T, r]       (shrink)
    out    = grouped_matmul(shrunk, b, sizes)         [T, d_out]   (expand)
    then each row back to its place; rows past sum(sizes), the slot-0 rows, come out zero

so the rows without an adapter cost nothing, and an adapter's stacks are read once a step
however many rows use it. The grouped matmul's tiles ask for a rank that is a multiple of
64 (its output tile, for the shrink) and d_in a multiple of 32; the engine allocates the
stacks with the rank rounded up (`kernel_rank`) where it uses this kernel, so no step
pads them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import grouped_matmul_mgpu as gmm

RANK_MULTIPLE = gmm.TILE_N  # the shrink's N is the rank


def kernel_rank(max_rank: int) -> int:
    """The stacks' rank where this kernel runs: `max_rank` rounded up to RANK_MULTIPLE."""
    return -(-max_rank // RANK_MULTIPLE) * RANK_MULTIPLE


def unsupported_reason(x, a, b) -> str | None:
    """Why `sgmv` cannot run x [T, d_in] with stacks a [n, d_in, r] and b [n, r, d_out], or None."""
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        return f"a [n, d_in, r] and b [n, r, d_out] must agree, got {a.shape} and {b.shape}"
    if jnp.dtype(a.dtype) != jnp.dtype(x.dtype) or jnp.dtype(b.dtype) != jnp.dtype(x.dtype):
        return f"the stacks must be in x's dtype {jnp.dtype(x.dtype).name}, got {a.dtype} and {b.dtype}"
    n, _, r = a.shape
    if r % RANK_MULTIPLE:
        return f"rank {r} is not a multiple of {RANK_MULTIPLE} (allocate the stacks with kernel_rank)"
    sizes = jax.ShapeDtypeStruct((n,), jnp.int32)
    shrunk = jax.ShapeDtypeStruct((x.shape[0] if x.ndim == 2 else 0, r), x.dtype)
    return gmm.unsupported_reason(x, a, sizes) or gmm.unsupported_reason(shrunk, b, sizes)


def sgmv(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, *, interpret=None) -> jax.Array:
    """`bgmv_reference(x, a, b, slots)` on the Mosaic GPU grouped matmul: x [T, d_in] (bf16 /
    f16), a [n, d_in, r], b [n, r, d_out] in x's dtype, slots int32 [T] in [0, n); slot 0
    is "no adapter" (its rows get zeros, its stacks are never read) -> [T, d_out]."""
    if (reason := unsupported_reason(x, a, b)) is not None:
        raise NotImplementedError(f"sgmv (Mosaic GPU): {reason}")
    n = a.shape[0]
    slots = slots.astype(jnp.int32)
    key = jnp.where(slots == 0, n, slots)  # slot-0 rows sort last, past every group
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((n,), jnp.int32).at[key].add(1, mode="drop")  # key n (slot 0) is dropped
    shrunk = gmm.grouped_matmul(x[order], a, sizes, interpret=interpret)
    out = gmm.grouped_matmul(shrunk, b, sizes, interpret=interpret)
    return jnp.zeros_like(out).at[order].set(out)
