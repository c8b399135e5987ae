"""Grouped matmuls (mixture-of-experts layers) as Pallas Mosaic GPU kernels for Hopper:
bf16 / f16 expert weights, and int4 (W4A16) and FP8 (W8A8) ones.

Same results as `grouped_matmul_reference` / `int4_grouped_matmul_reference` /
`fp8_grouped_matmul_reference` (`pallas_kernels.grouped_matmul`): x [M, K] rows sorted
by group, one weight per group. Float weights are taken as they are ([G, K, N]); the
quantized ones in `quantized_matmul_mgpu`'s kernel layouts stacked on a leading [G]
axis (`prepare_int4` / `prepare_fp8` keep leading axes), dequantized in the kernel by
the same code as the dense kernels.

Work items. The sorted rows are cut into row tiles of `tile_t`; a tile that straddles a
group boundary is computed once per group it touches (megablox's scheme). XLA lists the
(tile, group) pairs from group_sizes; their number is at most ceil(M / tile_t) + G - 1,
the static size of the list, whose unused entries the kernel skips:

    rows    |g0 g0 g0 g0|g0 g1 g1 g1|g3 g3 g3 g3|g3 . . . |   (g2 empty, tile_t 4)
    items    (t0,g0) (t1,g0) (t1,g1) (t2,g3) (t3,g3) skip skip

Swapped operands, as the dense kernels: y^T [N, rows] = W^T [N, K] @ x^T [K, rows], so an
expert's output channels are wgmma's M (64) and its rows wgmma's N (8..128): a decode
step gives most experts a token or two.

    grid (N / 64, work items); each CTA, if its item is used:
        acc[64, tile_t] = 0
        for k-step:  TMA  W[group] tile (+ int4 scales, offsets), x[tile] rows
                     (int4: dequantize)  acc += w @ x_tile^T
        epilogue: (fp8: acc * w_scale[group] * x_scale[rows]) -> out[item, n tile]

    then XLA: row r takes column r % tile_t of its own item's output (rows of the tile
    that belong to another group were computed with the wrong expert and are not read);
    rows past sum(group_sizes) are zero.

No masking in the kernel and no atomics: each item writes its own [N, tile_t] block,
at the cost of an output buffer up to (1 + G * tile_t / M) times the result's size.

Not done yet: tuning on a GPU (none was lent when this was written), a persistent grid
that skips the unused items without launching them, and splitting K for the few-CTA
case (decode with few experts active: many CTAs exist already with G * N / 64 items).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import quantized_matmul_mgpu as dense
from pallas_kernels.quantized_matmul import quantize_fp8_per_token
from pallas_kernels.quantized_matmul_mgpu import (
    ACTIVATION_DTYPES,
    SMEM_BYTES,
    TILE_N,
    Fp8KernelWeights,
    Int4KernelWeights,
    TuningConfig,
    prepare_fp8,
    prepare_int4,
)

__all__ = [
    "Fp8KernelWeights",
    "Int4KernelWeights",
    "TuningConfig",
    "default_config",
    "fp8_grouped_matmul",
    "fp8_unsupported_reason",
    "grouped_matmul",
    "int4_grouped_matmul",
    "int4_unsupported_reason",
    "num_work_items",
    "prepare_fp8",
    "prepare_int4",
    "unsupported_reason",
    "work_items",
]

# -- the work list (XLA) --------------------------------------------------------------

_GROUP, _TILE, _USED = range(3)  # the columns of WorkItems.items


@functools.partial(jax.tree_util.register_dataclass, data_fields=("items", "row_item", "row_used"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class WorkItems:
    items: jax.Array  # int32 [num_work, 3]: group, row tile, used (1) or skipped (0)
    row_item: jax.Array  # int32 [M]: the item whose output holds row r
    row_used: jax.Array  # bool [M]: r < sum(group_sizes)


def num_work_items(rows: int, groups: int, tile_t: int) -> int:
    """The static bound on (tile, group) pairs: each group boundary adds at most one."""
    return -(-rows // tile_t) + groups - 1


def work_items(group_sizes: jax.Array, rows: int, tile_t: int) -> WorkItems:
    """The (tile, group) pairs in order of group then tile, padded with skipped items."""
    groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), rows)  # NOTE: sizes past M are cut
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    first_tile, last_tile = starts // tile_t, (ends - 1) // tile_t
    tiles = jnp.where(ends > starts, last_tile - first_tile + 1, 0)
    item_ends = jnp.cumsum(tiles)
    item_starts = item_ends - tiles

    w = jnp.arange(num_work_items(rows, groups, tile_t), dtype=jnp.int32)
    group = jnp.searchsorted(item_ends, w, side="right").astype(jnp.int32)  # G: past the last item
    used = group < groups
    g = jnp.minimum(group, groups - 1)
    tile = jnp.where(used, first_tile[g] + w - item_starts[g], 0)
    items = jnp.stack([g, tile, used.astype(jnp.int32)], axis=1)

    r = jnp.arange(rows, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, r, side="right").astype(jnp.int32), groups - 1)
    row_item = item_starts[row_group] + r // tile_t - first_tile[row_group]
    row_used = r < ends[-1]
    return WorkItems(items, jnp.where(row_used, row_item, 0), row_used)


# -- what is supported ---------------------------------------------------------------


def default_config(rows: int, groups: int, tile_k: int = 128, **kwargs) -> TuningConfig:
    """Row tile from the rows a group has on average (a multiple of 8, at most 128): a
    decode step's experts get a token or two, a long prefill's fill whole tiles."""
    per_group = -(-rows // groups)
    tile_t = min(dense.MAX_TILE_T, max(8, -(-per_group // 8) * 8))
    return TuningConfig(tile_t=tile_t, tile_k=tile_k, k_splits=1, **kwargs)


def smem_bytes(kind: str, config: TuningConfig, out_itemsize: int) -> int:
    """Shared memory a kernel with this config allocates (an upper bound)."""
    if kind != "float":
        return dense.smem_bytes(kind, config, out_itemsize)
    tt, tk = config.tile_t or dense.MAX_TILE_T, config.tile_k
    stage = TILE_N * tk * 2 + tt * tk * 2
    return config.max_concurrent_steps * (stage + 8) + TILE_N * tt * out_itemsize + 2 * 1024


def _common_reason(x, group_sizes, groups: int, k: int, config: TuningConfig) -> str | None:
    if jnp.dtype(x.dtype) not in ACTIVATION_DTYPES:
        return f"activations must be bf16 or f16, got {jnp.dtype(x.dtype).name}"
    if x.ndim != 2 or x.shape[1] != k or x.shape[0] < 1:
        return f"x must be [M, K={k}] with M >= 1, got {x.shape}"
    if group_sizes.shape != (groups,):
        return f"group_sizes must be [G={groups}], got {group_sizes.shape}"
    if k % config.tile_k:
        return f"K={k} is not a multiple of {config.tile_k=}"
    if config.k_splits not in (None, 1):
        return f"{config.k_splits=}: the grouped kernel does not split K"
    return None


def _config(x, groups: int, config: TuningConfig | None, tile_k: int) -> TuningConfig:
    rows = x.shape[0] if x.ndim == 2 else 1
    filled = default_config(rows, groups, tile_k=tile_k)
    if config is None:
        return filled
    return dataclasses.replace(config, tile_t=config.tile_t or filled.tile_t, tile_k=min(config.tile_k, tile_k))


def _float_tile_k(k: int) -> int:
    """The largest K step (128, 64 or 32) dividing K."""
    return next((t for t in (128, 64, 32) if k % t == 0), 128)


def unsupported_reason(x, w, group_sizes, config: TuningConfig | None = None) -> str | None:
    """Why the float kernel cannot run x [M, K] @ w [G, K, N], or None."""
    if w.ndim != 3 or jnp.dtype(w.dtype) != jnp.dtype(x.dtype):
        return f"w must be [G, K, N] in x's dtype {jnp.dtype(x.dtype).name}, got {w.dtype} {w.shape}"
    groups, k, n = w.shape
    if n % TILE_N:
        return f"N={n} is not a multiple of {TILE_N}"
    config = _config(x, groups, config, _float_tile_k(k))
    if (reason := _common_reason(x, group_sizes, groups, k, config)) is not None:
        return reason
    if (smem := smem_bytes("float", config, 2)) > SMEM_BYTES:
        return f"{config} needs {smem} bytes of shared memory, more than {SMEM_BYTES}"
    return None


def _int4_tile_k(weights: Int4KernelWeights) -> int:
    k = weights.q.shape[-1]
    group = k // weights.scales.shape[-2]
    return min(group, 128) if group % 128 else 128


def int4_unsupported_reason(x, weights: Int4KernelWeights, group_sizes, config=None) -> str | None:
    """Why the W4A16 kernel cannot run x [M, K] @ these stacked weights, or None."""
    if not isinstance(weights, Int4KernelWeights):
        return "the weights are not in the kernel layout (use prepare_int4 on the stacked [G, ...] weights)"
    if weights.q.ndim != 3 or weights.scales.ndim != 3:
        return f"weights must be stacked [G, N, K], got {weights.q.shape}"
    groups, _, k = weights.q.shape
    quant_groups = weights.scales.shape[1]
    if k % quant_groups or (k // quant_groups) % 32:
        return f"K={k} in {quant_groups} quantization groups: the group size must be a multiple of 32"
    config = _config(x, groups, config, _int4_tile_k(weights))
    if (reason := _common_reason(x, group_sizes, groups, k, config)) is not None:
        return reason
    if (smem := smem_bytes("int4", config, 2)) > SMEM_BYTES:
        return f"{config} needs {smem} bytes of shared memory, more than {SMEM_BYTES}"
    return None


def fp8_unsupported_reason(x, weights: Fp8KernelWeights, group_sizes, config=None) -> str | None:
    """Why the FP8 W8A8 kernel cannot run x [M, K] @ these stacked weights, or None."""
    if not isinstance(weights, Fp8KernelWeights):
        return "the weights are not in the kernel layout (use prepare_fp8 on the stacked [G, ...] weights)"
    if weights.weight.ndim != 3 or jnp.dtype(weights.weight.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        return f"weights must be e4m3 [G, N, K], got {weights.weight.dtype} {weights.weight.shape}"
    groups, _, k = weights.weight.shape
    config = _config(x, groups, config, _float_tile_k(k))
    if (reason := _common_reason(x, group_sizes, groups, k, config)) is not None:
        return reason
    if (smem := smem_bytes("fp8", config, 2)) > SMEM_BYTES:
        return f"{config} needs {smem} bytes of shared memory, more than {SMEM_BYTES}"
    return None


# -- the kernels ---------------------------------------------------------------------


class _Plan(NamedTuple):
    n_tiles: int
    num_work: int
    k_steps: int
    tile_t: int
    tile_k: int


def _item(items_gmem):
    """This CTA's output tile, work item and the item's fields (scalars read from gmem)."""
    ni, wi = lax.axis_index("n"), lax.axis_index("w")
    return ni, wi, items_gmem[wi, _GROUP], items_gmem[wi, _TILE], items_gmem[wi, _USED]


def _store(acc, out_smem, out_gmem, ni, wi):
    """acc [64, tile_t] -> out[item, n tile] through shared memory."""
    out_smem[...] = acc.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[wi, pl.ds(ni * TILE_N, TILE_N)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _run_item(used, step, in_specs, gmem_refs, *, plan: _Plan, config: TuningConfig, prologue, epilogue):
    """The dense kernels' K loop for a used item; a skipped item does nothing."""

    @pl.when(used == 1)
    def _():
        dense._pipelined(step, in_specs, gmem_refs, plan=plan, config=config, prologue=prologue, epilogue=epilogue)


def _kernel_call(body, plan: _Plan, out_dtype, scratch, config: TuningConfig, interpret):
    threads = dict(num_threads=2, thread_name="wg") if config.warp_specialized else {}
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((plan.num_work, plan.n_tiles * TILE_N, plan.tile_t), out_dtype),
        scratch_types=scratch,
        grid=(plan.n_tiles, plan.num_work),
        grid_names=("n", "w"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
        **threads,
    )


def _float_kernel(plan: _Plan, out_dtype, config: TuningConfig, interpret):
    tk, tt = plan.tile_k, plan.tile_t
    in_flight = 0 if config.warp_specialized else 1  # as the dense fp8 kernel: both operands in smem

    def body(items_gmem, w_gmem, x_gmem, out_gmem, out_smem):
        ni, wi, group, tile, used = _item(items_gmem)

        def step(idx, w_smem, x_smem, acc_ref):
            # W[group] is [K, N] as stored: wgmma reads the [tk, 64] tile transposed (N-major A).
            plgpu.wgmma(acc_ref, w_smem.transpose((1, 0)), x_smem.transpose((1, 0)))
            plgpu.wgmma_wait(in_flight)
            return acc_ref

        in_specs = [
            plgpu.BlockSpec((tk, TILE_N), lambda k: (k, ni), delay_release=in_flight),
            plgpu.BlockSpec((tt, tk), lambda k: (tile, k), delay_release=in_flight),
        ]
        _run_item(
            used,
            step,
            in_specs,
            (w_gmem.at[group], x_gmem),
            plan=plan,
            config=config,
            prologue=lambda: None,
            epilogue=lambda acc: _store(acc, out_smem, out_gmem, ni, wi),
        )

    return _kernel_call(body, plan, out_dtype, [plgpu.SMEM((TILE_N, tt), out_dtype)], config, interpret)


def _int4_kernel(plan: _Plan, quant_group: int, out_dtype, x_dtype, config: TuningConfig, interpret):
    tk, tt = plan.tile_k, plan.tile_t
    steps_per_group = quant_group // tk

    def body(items_gmem, q_gmem, s_gmem, o_gmem, x_gmem, out_gmem, out_smem, *a_smem):
        ni, wi, group, tile, used = _item(items_gmem)

        def step(idx, q_smem, s_smem, o_smem, x_smem, acc_ref):
            w = dense.dequantize_int4_tile(q_smem, s_smem, o_smem, x_dtype, a_smem[0] if a_smem else None)
            plgpu.wgmma(acc_ref, w, x_smem.transpose((1, 0)))
            plgpu.wgmma_wait(0)  # A is this step's registers (or the one a_smem buffer)
            return acc_ref

        in_specs = [
            plgpu.BlockSpec((TILE_N, tk), lambda k: (ni, k)),
            plgpu.BlockSpec((1, TILE_N), lambda k: (k // steps_per_group, ni)),
            plgpu.BlockSpec((1, TILE_N), lambda k: (k // steps_per_group, ni)),
            plgpu.BlockSpec((tt, tk), lambda k: (tile, k)),
        ]
        _run_item(
            used,
            step,
            in_specs,
            (q_gmem.at[group], s_gmem.at[group], o_gmem.at[group], x_gmem),
            plan=plan,
            config=config,
            prologue=lambda: None,
            epilogue=lambda acc: _store(acc, out_smem, out_gmem, ni, wi),
        )

    scratch = [plgpu.SMEM((TILE_N, tt), out_dtype)]
    if config.a_via_smem:
        scratch.append(plgpu.SMEM((TILE_N, tk), x_dtype))
    return _kernel_call(body, plan, out_dtype, scratch, config, interpret)


def _fp8_kernel(plan: _Plan, out_dtype, config: TuningConfig, interpret):
    tk, tt = plan.tile_k, plan.tile_t
    in_flight = 0 if config.warp_specialized else 1

    def body(items_gmem, w_gmem, ws_gmem, x_gmem, xs_gmem, out_gmem, out_smem, ws_smem, xs_smem, barrier):
        ni, wi, group, tile, used = _item(items_gmem)

        def prologue():  # the epilogue's scales, fetched while the pipeline runs
            plgpu.copy_gmem_to_smem(ws_gmem.at[group, pl.ds(ni * TILE_N, TILE_N)], ws_smem, barrier)
            plgpu.copy_gmem_to_smem(xs_gmem.at[pl.ds(tile * tt, tt)], xs_smem, barrier)

        def epilogue(acc):
            plgpu.barrier_wait(barrier)
            acc = acc * ws_smem[...][:, None] * xs_smem[...][None, :]
            _store(acc, out_smem, out_gmem, ni, wi)

        def step(idx, w_smem, x_smem, acc_ref):
            plgpu.wgmma(acc_ref, w_smem, x_smem.transpose((1, 0)))
            plgpu.wgmma_wait(in_flight)
            return acc_ref

        in_specs = [
            plgpu.BlockSpec((TILE_N, tk), lambda k: (ni, k), delay_release=in_flight),
            plgpu.BlockSpec((tt, tk), lambda k: (tile, k), delay_release=in_flight),
        ]
        _run_item(
            used,
            step,
            in_specs,
            (w_gmem.at[group], x_gmem),
            plan=plan,
            config=config,
            prologue=prologue,
            epilogue=epilogue,
        )

    scratch = [
        plgpu.SMEM((TILE_N, tt), out_dtype),
        plgpu.SMEM((TILE_N,), jnp.float32),
        plgpu.SMEM((tt,), jnp.float32),
        plgpu.Barrier(num_arrivals=2),
    ]
    return _kernel_call(body, plan, out_dtype, scratch, config, interpret)


def _gather_rows(out: jax.Array, work: WorkItems, tile_t: int, n: int) -> jax.Array:
    """out [num_work, N_pad, tile_t] -> y [M, N]: each row from its own item; unused rows 0."""
    rows = work.row_item.shape[0]
    y = out[work.row_item, :n, jnp.arange(rows) % tile_t]
    return jnp.where(work.row_used[:, None], y, jnp.zeros((), y.dtype))


def _setup(x, groups, group_sizes, config: TuningConfig, n_pad: int, k: int, interpret):
    rows = x.shape[0]
    tt = config.tile_t
    work = work_items(group_sizes, rows, tt)
    plan = _Plan(n_pad // TILE_N, num_work_items(rows, groups, tt), k // config.tile_k, tt, config.tile_k)
    return work, plan, dense._interpret_params(interpret)


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, config: TuningConfig | None = None, interpret=None
) -> jax.Array:
    """`grouped_matmul_reference(x, w, group_sizes)`: x [M, K] sorted by group, w [G, K, N]
    (x's dtype, bf16 / f16), group_sizes int32 [G] -> [M, N] in x's dtype."""
    if (reason := unsupported_reason(x, w, group_sizes, config)) is not None:
        raise NotImplementedError(f"grouped_matmul (Mosaic GPU): {reason}")
    groups, k, n = w.shape
    config = _config(x, groups, config, _float_tile_k(k))
    work, plan, interpret = _setup(x, groups, group_sizes, config, n, k, interpret)
    xp = dense._pad_tokens(x, plan.tile_t)
    out = _float_kernel(plan, x.dtype, config, interpret)(work.items, w, xp)
    return _gather_rows(out, work, plan.tile_t, n)


def int4_grouped_matmul(
    x: jax.Array,
    weights: Int4KernelWeights,
    group_sizes: jax.Array,
    *,
    config: TuningConfig | None = None,
    interpret=None,
) -> jax.Array:
    """`int4_grouped_matmul_reference(x, packed, scales, offsets, group_sizes)` for weights =
    prepare_int4(packed, scales, offsets) (stacked [G, ...]): x [M, K] -> [M, N]."""
    if (reason := int4_unsupported_reason(x, weights, group_sizes, config)) is not None:
        raise NotImplementedError(f"int4_grouped_matmul (Mosaic GPU): {reason}")
    groups, n_pad, k = weights.q.shape
    config = _config(x, groups, config, _int4_tile_k(weights))
    if interpret:  # the interpreter's wgmma takes its A operand from smem only
        config = dataclasses.replace(config, a_via_smem=True)
    work, plan, interpret = _setup(x, groups, group_sizes, config, n_pad, k, interpret)
    xp = dense._pad_tokens(x, plan.tile_t)
    quant_group = k // weights.scales.shape[1]
    kernel = _int4_kernel(plan, quant_group, x.dtype, x.dtype, config, interpret)
    out = kernel(work.items, weights.q, weights.scales, weights.offsets, xp)
    return _gather_rows(out, work, plan.tile_t, weights.n)


def fp8_grouped_matmul(
    x: jax.Array,
    weights: Fp8KernelWeights,
    group_sizes: jax.Array,
    *,
    config: TuningConfig | None = None,
    interpret=None,
) -> jax.Array:
    """`fp8_grouped_matmul_reference(x, weight, scales, group_sizes)` for weights =
    prepare_fp8(weight, scales) (stacked [G, ...]): x [M, K] -> [M, N], x quantized per row in XLA."""
    if (reason := fp8_unsupported_reason(x, weights, group_sizes, config)) is not None:
        raise NotImplementedError(f"fp8_grouped_matmul (Mosaic GPU): {reason}")
    groups, n_pad, k = weights.weight.shape
    config = _config(x, groups, config, _float_tile_k(k))
    work, plan, interpret = _setup(x, groups, group_sizes, config, n_pad, k, interpret)
    # NOTE: the barrier keeps x rounded to its dtype before quantizing (see dense.fp8_matmul).
    xq, x_scale = quantize_fp8_per_token(lax.optimization_barrier(x))
    xq = dense._pad_tokens(xq, plan.tile_t)
    x_scale = jnp.pad(x_scale, (0, xq.shape[0] - x.shape[0]))
    out = _fp8_kernel(plan, x.dtype, config, interpret)(work.items, weights.weight, weights.scales, xq, x_scale)
    return _gather_rows(out, work, plan.tile_t, weights.n)
