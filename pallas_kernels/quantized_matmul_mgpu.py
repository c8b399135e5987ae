"""Matmuls as Pallas Mosaic GPU kernels for Hopper: W4A16 (int4 groups), FP8 W8A8 and dense
bf16 / f16 weights.

Same results as `int4_matmul_reference` / `fp8_matmul_reference` (see
`pallas_kernels.quantized_matmul`), but on weights converted once, at load time, into a
kernel layout (`Int4KernelWeights`, `Fp8KernelWeights`; built by `prepare_int4` /
`prepare_fp8`). The canonical layouts stay what loaders, caches and the references use.
The dense kernel (`dense_matmul`) takes a float weight as the model stores it, with no
copy: [K, N] (a linear layer's kernel, read by wgmma as an N-major A operand) or [N, K]
(a tied embedding table as the LM head, K-major like fp8's weight).

Swapped operands. A decode step has 1..16 tokens, far fewer than wgmma's 64-row M. So
the kernels compute the transposed product  y^T [N, T] = W^T [N, K] @ x^T [K, T]: the
weight's output channels are wgmma's M (64 per warpgroup) and the tokens are wgmma's N
(8..128, a multiple of 8), so one token wastes 7 columns, not 63 rows.

    grid (N / 64, T / tile_t, k_splits); each CTA:

        acc[64, tile_t] = 0                              (f32, wgmma accumulator)
        for k-step in its share of K  (`max_concurrent_steps` TMA stages in flight):
            TMA  W^T tile [64, tile_k], x tile [tile_t, tile_k] (+ int4: scales, offsets)
            int4: w = (s * q + o) in f32 registers -> bf16/f16   (q: int4 -> bf16 by bit ops -> f32)
            acc += w @ x_tile^T                          (wgmma; B is K-major)
        epilogue: (fp8: acc * w_scale[row] * x_scale[col]) -> smem -> TMA to out[split]

    then XLA: sum the K splits (if any), transpose to [T, N], drop padding, cast.

Kernel layouts (made once by `prepare_*`; N padded up to a multiple of 64 with zeros):

    int4:  q       int4    [N, K]  K-major, signed: q = nibble - 8
           scales  float32 [K // group, N]
           offsets float32 [K // group, N]   offsets + 8 * scales, so w = scales * q + offsets
    fp8:   weight  e4m3    [N, K]  K-major (wgmma's fp8 operands must both be K-major)
           scales  float32 [N]

Activations: fp8 quantizes x per token in XLA (`quantize_fp8_per_token`, a small step
next to the kernel); both scales are applied in the kernel's epilogue.

K splits (flash-decoding for matmuls): with few output tiles (N = 4096 gives 64 CTAs,
half an H100), K is cut into `k_splits` parts whose float32 partial products are summed
by XLA, so every SM streams weights.

Batch invariance (`batch_invariant=True`, `invariant_config`): the default config follows
the token count T (tile_t, and a K split for T <= 32), and both change the order in which
a token's row is summed, so a row's bits depend on how many rows share the call. The
invariant config fixes tile_t = 64 and k_splits = 1 whatever T is: every token's row is
one column of a [64, 64]-output wgmma chain over K in the same tile_k steps, so y[t]
depends only on x[t] and the weights (fp8's per-token quantization of x is row-wise too).
Why 64: a decode step of up to 64 sequences is one token tile (a single token pads to
64 columns; decode streams the weights, and the x tile is no larger than a dense
weight tile), while a prefill re-reads the weights T / 64 times instead of T / 128
(mostly from L2), and the 64 x 64 float32 accumulator keeps 32 registers per thread.
The cost is the K split: a decode step of a narrow layer (N = 576: 9 CTAs) runs on few SMs.

Two pipelines (`TuningConfig.warp_specialized`): plain `emit_pipeline` (one warpgroup
issues the copies of later stages and does the math; the default) or
`emit_pipeline_warp_specialized` (a memory warpgroup with 40 registers issues the
copies, a compute warpgroup dequantizes and multiplies). Both pass the interpreter and
lower for sm_90; which is faster is for benchmarks/kernels.py on a GPU to say.

`a_via_smem` stages the dequantized int4 tile through shared memory instead of passing
it to wgmma from registers; the Mosaic GPU interpreter needs it (its wgmma takes A from
shared memory only).

Not done yet: dense weights whose N is not a multiple of 64 (the weight is used as stored,
so it cannot be padded), two compute warpgroups per CTA, overlapping one step's int4 dequant with
the previous step's wgmma (each waits for its wgmma), fp8 activation quantization fused
into the kernel, and tuning on a GPU (none was available when this was written).
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

from pallas_kernels.quantized_matmul import quantize_fp8_per_token, unpack_int4

TILE_N = 64  # output channels per CTA: the M of one warpgroup's wgmma
MAX_TILE_T = 128  # tokens per CTA: wgmma's N
INVARIANT_TILE_T = 64  # the batch-invariant token tile (see the module docstring)
H100_SMS = 132
SMEM_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90
ACTIVATION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """tile_t: tokens per CTA (None: the token count rounded up to 8, at most 128);
    tile_k: K per pipeline step (int4: capped at the group size);
    k_splits: parts K is cut into (None: see `default_config`);
    warp_specialized: a memory warpgroup issues the copies (else one warpgroup does all);
    a_via_smem: int4 only, the dequantized tile goes to wgmma through shared memory."""

    tile_t: int | None = None
    tile_k: int = 128
    k_splits: int | None = None
    max_concurrent_steps: int = 4
    a_via_smem: bool = False
    warp_specialized: bool = False

    def __post_init__(self):
        if self.tile_t is not None and (self.tile_t % 8 or not 8 <= self.tile_t <= MAX_TILE_T):
            raise ValueError(f"{self.tile_t=} must be a multiple of 8 in [8, {MAX_TILE_T}]")
        if self.tile_k not in (32, 64, 128, 256):
            raise ValueError(f"{self.tile_k=} must be 32, 64, 128 or 256")
        if self.k_splits is not None and self.k_splits < 1:
            raise ValueError(f"{self.k_splits=} must be at least 1")
        if self.max_concurrent_steps < 2:  # fp8 keeps one stage's wgmma in flight (delay_release=1)
            raise ValueError(f"{self.max_concurrent_steps=} must be at least 2")


# -- kernel layouts (one-time conversion at load time) --------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=("q", "scales", "offsets"), meta_fields=("n",))
@dataclasses.dataclass(frozen=True)
class Int4KernelWeights:
    q: jax.Array  # int4 [..., N_pad, K]
    scales: jax.Array  # float32 [..., K // group, N_pad]
    offsets: jax.Array  # float32 [..., K // group, N_pad] (offsets + 8 * scales)
    n: int  # the real N


@functools.partial(jax.tree_util.register_dataclass, data_fields=("weight", "scales"), meta_fields=("n",))
@dataclasses.dataclass(frozen=True)
class Fp8KernelWeights:
    weight: jax.Array  # e4m3 [..., N_pad, K]
    scales: jax.Array  # float32 [..., N_pad]
    n: int


def padded_n(n: int) -> int:
    """N rounded up to the kernels' output tile (the kernel layout pads with zeros)."""
    return -(-n // TILE_N) * TILE_N


def _pad_last(a: jax.Array, size: int) -> jax.Array:
    return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, size - a.shape[-1])])


def prepare_int4(packed: jax.Array, scales: jax.Array, offsets: jax.Array) -> Int4KernelWeights:
    """Canonical int4 (packed uint8 [..., K // 2, N], scales/offsets [..., G, N]) -> the
    kernel layout. Leading axes (stacked layers) are kept."""
    lead, (half_k, n) = packed.shape[:-2], packed.shape[-2:]
    nibbles = jax.vmap(unpack_int4)(packed.reshape(-1, half_k, n)).reshape(*lead, 2 * half_k, n)
    q = (nibbles.astype(jnp.int8) - 8).astype(jnp.int4)
    n_pad = padded_n(n)
    q = jnp.swapaxes(_pad_last(q, n_pad), -1, -2)  # [..., N_pad, K]
    scales = scales.astype(jnp.float32)
    offsets = offsets.astype(jnp.float32) + 8 * scales
    return Int4KernelWeights(q, _pad_last(scales, n_pad), _pad_last(offsets, n_pad), n)


def prepare_fp8(weight: jax.Array, scales: jax.Array) -> Fp8KernelWeights:
    """Canonical fp8 (e4m3 [..., K, N], scales [..., N]) -> the kernel layout."""
    n = weight.shape[-1]
    n_pad = padded_n(n)
    w = jnp.swapaxes(_pad_last(weight, n_pad), -1, -2)
    return Fp8KernelWeights(w, _pad_last(scales.astype(jnp.float32), n_pad), n)


# -- what is supported ---------------------------------------------------------------


def default_config(num_tokens: int, n: int, k: int, tile_k: int = 128, **kwargs) -> TuningConfig:
    """Token tile from the token count; K split in 1, 2, 4 or 8 parts, whichever gives the
    least estimated time (waves of CTAs over 132 SMs, each 1 / splits of K long), a split
    only when it saves more than 5 %, and only for at most 32 tokens: the float32 partial
    sums ([splits, N, T]) are then small next to the weights."""
    tile_t = min(MAX_TILE_T, -(-num_tokens // 8) * 8)
    ctas = (padded_n(n) // TILE_N) * -(-num_tokens // tile_t)
    k_steps = k // tile_k if k % tile_k == 0 else 1

    def cost(splits):
        return -(-ctas * splits // H100_SMS) / splits

    splits = 1
    for s in (2, 4, 8) if tile_t <= 32 else ():
        if k_steps % s == 0 and k_steps // s >= 4 and cost(s) < 0.95 * cost(splits):
            splits = s
    return TuningConfig(tile_t=tile_t, tile_k=tile_k, k_splits=splits, **kwargs)


def invariant_config(tile_k: int = 128, **kwargs) -> TuningConfig:
    """The batch-invariant config: a token tile of INVARIANT_TILE_T and no K split, whatever
    the token count, so a row's sum over K runs in the same order in every call. tile_k is
    the default's for this K (and int4 group); `batch_invariant=True` fills it in."""
    return TuningConfig(tile_t=INVARIANT_TILE_T, tile_k=tile_k, k_splits=1, **kwargs)


def is_invariant(config: TuningConfig) -> bool:
    """Whether a config gives every row the same summation order whatever the token count."""
    return config.tile_t is not None and config.k_splits == 1


def _default_or_invariant(num_tokens: int, n_pad: int, k: int, tile_k: int, batch_invariant: bool) -> TuningConfig:
    if batch_invariant:
        return invariant_config(tile_k)
    return default_config(num_tokens, n_pad, k, tile_k=tile_k)


def smem_bytes(kind: str, config: TuningConfig, out_itemsize: int) -> int:
    """Shared memory a kernel with this config allocates (an upper bound): its pipeline
    stages and their barriers, the output tile, for fp8 the epilogue's scales, and 2 KiB
    for the padding of small buffers to 1 KiB boundaries (swizzled tiles' alignment).
    `kind`: "int4", "fp8" or "dense" (16-bit weights)."""
    tt, tk, stages = config.tile_t or MAX_TILE_T, config.tile_k, config.max_concurrent_steps
    if kind == "int4":
        stage = TILE_N * tk // 2 + tt * tk * 2 + 2 * TILE_N * 4
        extra = TILE_N * tk * 2 if config.a_via_smem else 0
    elif kind == "dense":
        stage, extra = (TILE_N + tt) * tk * 2, 0
    else:
        stage = TILE_N * tk + tt * tk
        extra = (TILE_N + tt) * 4 + 8
    return stages * (stage + 8) + extra + TILE_N * tt * out_itemsize + 2 * 1024


def _common_reason(x, k: int, config: TuningConfig | None) -> str | None:
    if jnp.dtype(x.dtype) not in ACTIVATION_DTYPES:
        return f"activations must be bf16 or f16, got {jnp.dtype(x.dtype).name}"
    if x.ndim != 2 or x.shape[1] != k:
        return f"x must be [T, K={k}], got {x.shape}"
    if config is not None and config.tile_k and k % config.tile_k:
        return f"K={k} is not a multiple of {config.tile_k=}"
    return None


def _invariance_reason(config: TuningConfig | None, batch_invariant: bool) -> str | None:
    if batch_invariant and config is not None and not is_invariant(config):
        return f"batch_invariant needs a fixed tile_t and k_splits=1, got {config}"
    return None


def int4_unsupported_reason(
    x, weights: Int4KernelWeights, config: TuningConfig | None = None, batch_invariant: bool = False
) -> str | None:
    """Why the W4A16 kernel cannot run x [T, K] @ these weights, or None."""
    if not isinstance(weights, Int4KernelWeights):
        return "the weights are not in the kernel layout (use prepare_int4)"
    if weights.q.ndim != 2 or weights.scales.ndim != 2:
        return f"weights must be one layer's [N, K], got {weights.q.shape}"
    n_pad, k = weights.q.shape
    groups = weights.scales.shape[0]
    if k % groups:
        return f"K={k} is not a multiple of the {groups} groups"
    group = k // groups
    if group % 32:
        return f"group size {group} is not a multiple of 32"
    if (reason := _invariance_reason(config, batch_invariant)) is not None:
        return reason
    config = _int4_config(x.shape[0] if x.ndim == 2 else 1, weights, config, batch_invariant)
    if (reason := _common_reason(x, k, config)) is not None:
        return reason
    if (smem := smem_bytes("int4", config, 4)) > SMEM_BYTES:
        return f"{config} needs {smem} bytes of shared memory, more than {SMEM_BYTES}"
    return None


def fp8_unsupported_reason(
    x, weights: Fp8KernelWeights, config: TuningConfig | None = None, batch_invariant: bool = False
) -> str | None:
    """Why the FP8 W8A8 kernel cannot run x [T, K] @ these weights, or None."""
    if not isinstance(weights, Fp8KernelWeights):
        return "the weights are not in the kernel layout (use prepare_fp8)"
    if weights.weight.ndim != 2 or jnp.dtype(weights.weight.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        return f"weights must be e4m3 [N, K], got {weights.weight.dtype} {weights.weight.shape}"
    n_pad, k = weights.weight.shape
    if (reason := _invariance_reason(config, batch_invariant)) is not None:
        return reason
    config = config or _default_or_invariant(x.shape[0] if x.ndim == 2 else 1, n_pad, k, _k_step(k), batch_invariant)
    if (reason := _common_reason(x, k, config)) is not None:
        return reason
    if (smem := smem_bytes("fp8", config, 4)) > SMEM_BYTES:
        return f"{config} needs {smem} bytes of shared memory, more than {SMEM_BYTES}"
    return None


def _dense_shape(w, transposed: bool) -> tuple[int, int]:
    """(K, N) of a dense weight stored [K, N], or [N, K] when transposed."""
    return (w.shape[1], w.shape[0]) if transposed else (w.shape[0], w.shape[1])


def dense_unsupported_reason(
    x, w, transposed: bool = False, config: TuningConfig | None = None, batch_invariant: bool = False
) -> str | None:
    """Why the dense kernel cannot run x [T, K] @ w ([K, N], or [N, K] when transposed), or None."""
    if w.ndim != 2 or jnp.dtype(w.dtype) != jnp.dtype(x.dtype):
        return f"w must be 2-D in x's dtype {jnp.dtype(x.dtype).name}, got {jnp.dtype(w.dtype).name} {w.shape}"
    k, n = _dense_shape(w, transposed)
    if n % TILE_N:  # used as stored: no padded copy
        return f"N={n} is not a multiple of {TILE_N}"
    if (reason := _invariance_reason(config, batch_invariant)) is not None:
        return reason
    config = config or _default_or_invariant(x.shape[0] if x.ndim == 2 else 1, n, k, _k_step(k), batch_invariant)
    if (reason := _common_reason(x, k, config)) is not None:
        return reason
    if (smem := smem_bytes("dense", config, 4)) > SMEM_BYTES:
        return f"{config} needs {smem} bytes of shared memory, more than {SMEM_BYTES}"
    return None


def _k_step(k: int) -> int:
    """The largest K step (128, 64 or 32) dividing K: fp8's and the dense kernel's tile_k."""
    return next((t for t in (128, 64, 32) if k % t == 0), 128)


def _int4_config(
    num_tokens: int, weights: Int4KernelWeights, config: TuningConfig | None, batch_invariant: bool = False
) -> TuningConfig:
    n_pad, k = weights.q.shape[-2:]
    group = k // weights.scales.shape[-2]
    tile_k = min(group, 128) if group % 128 else 128
    if config is None:
        return _default_or_invariant(num_tokens, n_pad, k, tile_k, batch_invariant)
    return dataclasses.replace(config, tile_k=min(config.tile_k, tile_k))


def _finish_config(config: TuningConfig, num_tokens: int, n_pad: int, k: int) -> TuningConfig:
    """Fill tile_t and k_splits left as None."""
    filled = default_config(num_tokens, n_pad, k, tile_k=config.tile_k)
    k_splits = config.k_splits or filled.k_splits
    if (k // config.tile_k) % k_splits:
        raise ValueError(f"{k_splits=} does not divide the {k // config.tile_k} K steps")
    return dataclasses.replace(config, tile_t=config.tile_t or filled.tile_t, k_splits=k_splits)


# -- the kernels ---------------------------------------------------------------------


class _Plan(NamedTuple):
    n_tiles: int
    t_tiles: int
    k_splits: int
    k_steps: int  # per split
    tile_t: int
    tile_k: int


def _plan(config: TuningConfig, t_pad: int, n_pad: int, k: int) -> _Plan:
    splits = config.k_splits
    return _Plan(
        n_pad // TILE_N, t_pad // config.tile_t, splits, k // config.tile_k // splits, config.tile_t, config.tile_k
    )


def _store_tile(acc, out_smem, out_gmem, ni, ti, si, plan: _Plan):
    """acc [64, tile_t] -> out[si, n tile, t tile] through shared memory."""
    out_smem[...] = acc.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[si, pl.ds(ni * TILE_N, TILE_N), pl.ds(ti * plan.tile_t, plan.tile_t)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _pipelined(step, in_specs, gmem_refs, *, plan: _Plan, config: TuningConfig, prologue, epilogue):
    """Run `step(idx, *smem_refs, acc_ref) -> acc_ref` over this CTA's K steps with a
    [64, tile_t] float32 accumulator, then `epilogue(acc)`; `prologue()` runs first.

    Plain: one warpgroup issues the TMA copies of later stages and does the math.
    Warp-specialized: a memory warpgroup (40 registers) only issues copies, the compute
    warpgroup only does math; prologue and epilogue run in the compute warpgroup.
    """
    acc_type = plgpu.ACC((TILE_N, plan.tile_t))
    if not config.warp_specialized:

        def scope(acc_ref):
            plgpu.emit_pipeline(
                step,
                grid=(plan.k_steps,),
                in_specs=in_specs,
                max_concurrent_steps=config.max_concurrent_steps,
                init_carry=acc_ref,
            )(*gmem_refs)
            return acc_ref[...]

        prologue()
        epilogue(pl.run_scoped(scope, acc_type))
        return

    def compute_context(eval_pipeline):
        def scope(acc_ref):
            eval_pipeline(acc_ref)
            return acc_ref[...]

        prologue()
        epilogue(pl.run_scoped(scope, acc_type))

    plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(plan.k_steps,),
        memory_registers=40,
        in_specs=in_specs,
        wg_axis="wg",
        num_compute_wgs=1,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context,
    )(*gmem_refs)


def _kernel_call(body, plan: _Plan, out_dtype, scratch, config: TuningConfig, interpret):
    threads = dict(num_threads=2, thread_name="wg") if config.warp_specialized else {}
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((plan.k_splits, plan.n_tiles * TILE_N, plan.t_tiles * plan.tile_t), out_dtype),
        scratch_types=scratch,
        grid=(plan.n_tiles, plan.t_tiles, plan.k_splits),
        grid_names=("n", "t", "k"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
        **threads,
    )


def dequantize_int4_tile(q_smem, s_smem, o_smem, dtype, a_smem=None):
    """The wgmma A operand [64, tile_k] from an int4 tile and its group's scales and offsets:
    w = s * q + o in f32 (as the reference computes it), then the activation dtype; staged
    through `a_smem` when given (the interpreter's wgmma takes A from smem only). Shared
    with the grouped (MoE) kernels."""
    # NOTE: through bf16 (exact for int4): Mosaic converts int4 to bf16 with bit operations;
    # int4 straight to f32 was an I2F per value (64 a thread per step), at I2F's throughput a
    # cap near 2x bf16 on the kernel. The same values, so the same results.
    w = q_smem[...].astype(jnp.bfloat16).astype(jnp.float32)
    w = w * s_smem[0][:, None] + o_smem[0][:, None]
    w = w.astype(dtype)
    if a_smem is None:
        return w
    a_smem[...] = w
    plgpu.commit_smem()
    return a_smem


def _int4_kernel(plan: _Plan, group: int, out_dtype, x_dtype, config: TuningConfig, interpret):
    tk, tt = plan.tile_k, plan.tile_t
    steps_per_group = group // tk

    def body(q_gmem, s_gmem, o_gmem, x_gmem, out_gmem, out_smem, *a_smem):
        ni, ti, si = lax.axis_index("n"), lax.axis_index("t"), lax.axis_index("k")
        k0 = si * plan.k_steps

        def step(idx, q_smem, s_smem, o_smem, x_smem, acc_ref):
            w = dequantize_int4_tile(q_smem, s_smem, o_smem, x_dtype, a_smem[0] if a_smem else None)
            plgpu.wgmma(acc_ref, w, x_smem.transpose((1, 0)))
            plgpu.wgmma_wait(0)  # A is this step's registers (or the one a_smem buffer)
            return acc_ref

        in_specs = [
            plgpu.BlockSpec((TILE_N, tk), lambda k: (ni, k0 + k)),
            plgpu.BlockSpec((1, TILE_N), lambda k: ((k0 + k) // steps_per_group, ni)),
            plgpu.BlockSpec((1, TILE_N), lambda k: ((k0 + k) // steps_per_group, ni)),
            plgpu.BlockSpec((tt, tk), lambda k: (ti, k0 + k)),
        ]
        _pipelined(
            step,
            in_specs,
            (q_gmem, s_gmem, o_gmem, x_gmem),
            plan=plan,
            config=config,
            prologue=lambda: None,
            epilogue=lambda acc: _store_tile(acc, out_smem, out_gmem, ni, ti, si, plan),
        )

    scratch = [plgpu.SMEM((TILE_N, tt), out_dtype)]
    if config.a_via_smem:
        scratch.append(plgpu.SMEM((TILE_N, tk), x_dtype))
    return _kernel_call(body, plan, out_dtype, scratch, config, interpret)


def _fp8_kernel(plan: _Plan, out_dtype, config: TuningConfig, interpret):
    tk, tt = plan.tile_k, plan.tile_t
    # Both operands in smem: without warp specialization one wgmma stays in flight while
    # the next is issued, and the delayed release keeps its stage from being refilled
    # until it is done. (The warp-specialized pipeline frees a stage when the body returns.)
    in_flight = 0 if config.warp_specialized else 1

    def body(w_gmem, ws_gmem, x_gmem, xs_gmem, out_gmem, out_smem, ws_smem, xs_smem, barrier):
        ni, ti, si = lax.axis_index("n"), lax.axis_index("t"), lax.axis_index("k")
        k0 = si * plan.k_steps

        def prologue():  # the epilogue's scales, fetched while the pipeline runs
            plgpu.copy_gmem_to_smem(ws_gmem.at[pl.ds(ni * TILE_N, TILE_N)], ws_smem, barrier)
            plgpu.copy_gmem_to_smem(xs_gmem.at[pl.ds(ti * tt, tt)], xs_smem, barrier)

        def epilogue(acc):
            plgpu.barrier_wait(barrier)
            acc = acc * ws_smem[...][:, None] * xs_smem[...][None, :]
            _store_tile(acc, out_smem, out_gmem, ni, ti, si, plan)

        def step(idx, w_smem, x_smem, acc_ref):
            plgpu.wgmma(acc_ref, w_smem, x_smem.transpose((1, 0)))
            plgpu.wgmma_wait(in_flight)
            return acc_ref

        in_specs = [
            plgpu.BlockSpec((TILE_N, tk), lambda k: (ni, k0 + k), delay_release=in_flight),
            plgpu.BlockSpec((tt, tk), lambda k: (ti, k0 + k), delay_release=in_flight),
        ]
        _pipelined(step, in_specs, (w_gmem, x_gmem), plan=plan, config=config, prologue=prologue, epilogue=epilogue)

    scratch = [
        plgpu.SMEM((TILE_N, tt), out_dtype),
        plgpu.SMEM((TILE_N,), jnp.float32),
        plgpu.SMEM((tt,), jnp.float32),
        plgpu.Barrier(num_arrivals=2),
    ]
    return _kernel_call(body, plan, out_dtype, scratch, config, interpret)


def _dense_kernel(plan: _Plan, out_dtype, transposed: bool, config: TuningConfig, interpret):
    """The fp8 kernel without scales: 16-bit weights as stored, both operands in smem."""
    tk, tt = plan.tile_k, plan.tile_t
    in_flight = 0 if config.warp_specialized else 1  # as in the fp8 kernel

    def body(w_gmem, x_gmem, out_gmem, out_smem):
        ni, ti, si = lax.axis_index("n"), lax.axis_index("t"), lax.axis_index("k")
        k0 = si * plan.k_steps

        def step(idx, w_smem, x_smem, acc_ref):
            # [N, K] tiles are K-major as wgmma's A; [K, N] tiles are read transposed (N-major A).
            a = w_smem if transposed else w_smem.transpose((1, 0))
            plgpu.wgmma(acc_ref, a, x_smem.transpose((1, 0)))
            plgpu.wgmma_wait(in_flight)
            return acc_ref

        if transposed:
            w_spec = plgpu.BlockSpec((TILE_N, tk), lambda k: (ni, k0 + k), delay_release=in_flight)
        else:
            w_spec = plgpu.BlockSpec((tk, TILE_N), lambda k: (k0 + k, ni), delay_release=in_flight)
        in_specs = [w_spec, plgpu.BlockSpec((tt, tk), lambda k: (ti, k0 + k), delay_release=in_flight)]
        _pipelined(
            step,
            in_specs,
            (w_gmem, x_gmem),
            plan=plan,
            config=config,
            prologue=lambda: None,
            epilogue=lambda acc: _store_tile(acc, out_smem, out_gmem, ni, ti, si, plan),
        )

    return _kernel_call(body, plan, out_dtype, [plgpu.SMEM((TILE_N, tt), out_dtype)], config, interpret)


def _pad_tokens(x: jax.Array, tile_t: int) -> jax.Array:
    t = x.shape[0]
    return jnp.pad(x, ((0, -t % tile_t), (0, 0)))


def _finish(out: jax.Array, t: int, n: int, dtype) -> jax.Array:
    """[splits, N_pad, T_pad] -> [T, N] in dtype."""
    y = out[0] if out.shape[0] == 1 else out.astype(jnp.float32).sum(0)
    return y.T[:t, :n].astype(dtype)


def _interpret_params(interpret):
    return plgpu.InterpretGPUParams() if interpret is True else interpret


def int4_matmul(
    x: jax.Array,
    weights: Int4KernelWeights,
    *,
    config: TuningConfig | None = None,
    batch_invariant: bool = False,
    interpret=None,
) -> jax.Array:
    """`int4_matmul_reference(x, packed, scales, offsets)` for weights = prepare_int4(packed,
    scales, offsets): x [T, K] bf16/f16 -> [T, N] in x's dtype. `batch_invariant`: row t
    depends on x[t] alone, whatever T (`invariant_config`; a config given must be invariant)."""
    if (reason := int4_unsupported_reason(x, weights, config, batch_invariant)) is not None:
        raise NotImplementedError(f"int4_matmul (Mosaic GPU): {reason}")
    interpret = _interpret_params(interpret)
    t, k = x.shape
    n_pad = weights.q.shape[0]
    group = k // weights.scales.shape[0]
    config = _finish_config(_int4_config(t, weights, config, batch_invariant), t, n_pad, k)
    if interpret:  # the interpreter's wgmma takes its A operand from smem only
        config = dataclasses.replace(config, a_via_smem=True)
    xp = _pad_tokens(x, config.tile_t)
    plan = _plan(config, xp.shape[0], n_pad, k)
    out_dtype = x.dtype if plan.k_splits == 1 else jnp.float32
    kernel = _int4_kernel(plan, group, out_dtype, x.dtype, config, interpret)
    out = kernel(weights.q, weights.scales, weights.offsets, xp)
    return _finish(out, t, weights.n, x.dtype)


def fp8_matmul(
    x: jax.Array,
    weights: Fp8KernelWeights,
    *,
    config: TuningConfig | None = None,
    batch_invariant: bool = False,
    interpret=None,
) -> jax.Array:
    """`fp8_matmul_reference(x, weight, scales)` for weights = prepare_fp8(weight, scales):
    x [T, K] bf16/f16 -> [T, N] in x's dtype (x quantized per token first, in XLA: each row
    by its own absmax, so `batch_invariant` holds for it as for `int4_matmul`)."""
    if (reason := fp8_unsupported_reason(x, weights, config, batch_invariant)) is not None:
        raise NotImplementedError(f"fp8_matmul (Mosaic GPU): {reason}")
    interpret = _interpret_params(interpret)
    t, k = x.shape
    n_pad = weights.weight.shape[0]
    config = _finish_config(config or _default_or_invariant(t, n_pad, k, _k_step(k), batch_invariant), t, n_pad, k)
    # NOTE: the barrier keeps x rounded to its dtype before quantizing, as the reference
    # does (its barrier); else XLA may fuse the producer (e.g. RMSNorm) into the
    # quantization in float32, and a few activations then round to another e4m3 value.
    xq, x_scale = quantize_fp8_per_token(lax.optimization_barrier(x))
    xq = _pad_tokens(xq, config.tile_t)
    x_scale = jnp.pad(x_scale, (0, xq.shape[0] - t))
    plan = _plan(config, xq.shape[0], n_pad, k)
    out_dtype = x.dtype if plan.k_splits == 1 else jnp.float32
    out = _fp8_kernel(plan, out_dtype, config, interpret)(weights.weight, weights.scales, xq, x_scale)
    return _finish(out, t, weights.n, x.dtype)


def dense_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    transposed: bool = False,
    config: TuningConfig | None = None,
    batch_invariant: bool = False,
    interpret=None,
) -> jax.Array:
    """x [T, K] @ w -> [T, N] in x's dtype (float32 accumulation, one rounding), w in x's dtype
    as stored: [K, N], or [N, K] with `transposed` (y = x @ w.T, a tied LM head).
    `batch_invariant`: row t depends on x[t] alone, whatever T (see `int4_matmul`)."""
    if (reason := dense_unsupported_reason(x, w, transposed, config, batch_invariant)) is not None:
        raise NotImplementedError(f"dense_matmul (Mosaic GPU): {reason}")
    interpret = _interpret_params(interpret)
    t = x.shape[0]
    k, n = _dense_shape(w, transposed)
    config = _finish_config(config or _default_or_invariant(t, n, k, _k_step(k), batch_invariant), t, n, k)
    xp = _pad_tokens(x, config.tile_t)
    plan = _plan(config, xp.shape[0], n, k)
    out_dtype = x.dtype if plan.k_splits == 1 else jnp.float32
    out = _dense_kernel(plan, out_dtype, transposed, config, interpret)(w, xp)
    return _finish(out, t, n, x.dtype)
