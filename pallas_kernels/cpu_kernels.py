"""The CPU kernels: C++ called through XLA's FFI (`cpu_kernels.cc`).

- `ragged_paged_attention` has the signature and the semantics of
  `ragged_paged_attention_reference`, for float32 or bfloat16 queries and pages (an 8-bit
  cache stays on the reference). It reads each key and value row once, straight from its
  page; the pure-JAX path gathers every chunk of pages into a copy before multiplying.
- `norm_qkv` and `o_proj_mlp` are the two halves of a decoder layer for a few rows (RMSNorm
  and the q/k/v projections; o_proj, the residual, RMSNorm, the MLP and its residual), each
  one call. XLA runs such a layer as a dozen small ops, each paying a dispatch and a wake-up
  of its thread pool: 24.4 against 18.7 ms for SmolLM2-135M's 30 layers and one row.
- `small_matmul(x, w)` is `x @ w` (or `x @ w.T`) for a few rows of x, as in a decode
  step, in blocks of output columns over XLA's thread pool. The engine uses it for a tied
  LM head, `x @ table.T`, where XLA's CPU dot is slow (17.8 against 3.3 ms alone, for
  SmolLM2-135M's table and one row).
- `moe_experts` is a mixture of SwiGLU experts for the few tokens of a decode step, as
  jaxserve.model.moe.run_touched_experts computes it, in one call that reads only the
  experts the tokens chose (XLA runs the loop over experts as a chain of small ops).
- `int4_matmul` is `x @ W` for a few rows of x and a 4-bit weight (GGUF's Q4_0 / Q4_1 / Q4_K
  blocks, `--quantization int4`), read as packed nibbles in tiles of 32 output columns
  (`tile_int4`, once at load; GGUF's float16 scales kept as float16); the pure-JAX path
  writes the whole weight out as floats first, every step.
- `int8_matmul` is the same for 8-bit values with a scale per group (GGUF's Q8_0 blocks:
  `--quantization int8`, a Q8_0 GGUF's projections, and a GGUF's tied embedding table, which
  usually comes as Q8_0: `q8_0_blocks` finds them in the float table).
- `quantized_matmuls` is both for any mix of int4 and int8 weights of one K in one call (q/k/v,
  gate/up), and `quantized_norm_qkv` / `quantized_o_proj_mlp` the two halves of a decoder
  layer whose projections are such weights (`QuantizedWeight`), as `norm_qkv` / `o_proj_mlp`.

`build(cache_dir)` compiles the source with the system C++ compiler (`$CXX`, else `c++`)
against the FFI headers that jaxlib ships. It writes `cache_dir/cpu_kernels/<key>.so`, the
key covering the source, the flags, the compiler, jaxlib and this CPU (the code is built
for it, `-march=native`). Then it registers the handlers with XLA. It returns None, or why
the kernels cannot run here (no compiler, a failed build), so that callers can fall back
to pure JAX.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import as_mask_words

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cc")
ATTENTION_TARGET = "jaxserve_ragged_paged_attention"
MATMUL_TARGET = "jaxserve_small_matmul"
DENSE_MATMUL_TARGET = "jaxserve_dense_matmul"
GREEDY_ARGMAX_TARGET = "jaxserve_greedy_argmax"
NORM_QKV_TARGET = "jaxserve_norm_qkv"
O_PROJ_MLP_TARGET = "jaxserve_o_proj_mlp"
MOE_EXPERTS_TARGET = "jaxserve_moe_experts"
QUANTIZED_MATMUL_TARGET = "jaxserve_quantized_matmul"
QUANTIZED_NORM_QKV_TARGET = "jaxserve_quantized_norm_qkv"
QUANTIZED_O_PROJ_MLP_TARGET = "jaxserve_quantized_o_proj_mlp"
INT4_TILE = 32  # output columns per tile of int4_matmul's and int8_matmul's layouts (kInt4Tile in the .cc)
Q8_0_BLOCK = 32  # values per float16 scale in GGUF's Q8_0
MAX_ROWS = 16  # the most rows of x small_matmul takes
# The most rows of x the quantized kernels take (kQuantizedMaxRows): each tile's weights are
# converted once per four rows, so a batch of up to 64 decode steps still beats dequantizing
# the whole weight to floats (the pure-JAX path).
QUANTIZED_MAX_ROWS = 64
# The most rows of x dense_matmuls takes (kDenseMaxRows): a batch of decode steps. Longer
# steps go to XLA's dot, which packs its operands for many rows.
DENSE_MAX_ROWS = 64
# The fewest rows dense_dot_general sends to it: up to 16 rows XLA's dot is as fast or faster
# (one row: 2.3 against 3.1 ms for a [576, 49152] head; 16 rows of [576, 1536] weights alike).
DENSE_MIN_ROWS = 17
# The most rows the decoder-layer kernels (norm_qkv, o_proj_mlp) serve in the engine. For
# SmolLM2-135M's 30 layers on two cores they take 18.7 / 22.8 / 26.8 / 36.0 / 59.2 ms at
# 1 / 2 / 4 / 8 / 16 rows, XLA 24.4 / 30.6 / 35.7 / 42.4 / 47.0 ms.
LAYER_MAX_ROWS = 8
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp-simd", "-shared", "-fPIC")
# More compiler flags, space-separated: "-mno-avx512f" builds the AVX2 paths on a machine with
# AVX-512 (tests compare the two).
FLAGS_ENV_VAR = "JAXSERVE_CPU_KERNEL_FLAGS"
KV_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

_lock = threading.Lock()
_built: dict[str, object] = {}  # "reason": None or why it cannot run; "library": the loaded .so


def build(cache_dir: str | os.PathLike) -> str | None:
    """Compile (once per machine) and register the kernels: None, or why they cannot run here."""
    with _lock:
        if "reason" not in _built:
            try:
                _built["reason"] = _build(Path(cache_dir))
            except OSError as e:  # an unwritable cache, a library that does not load
                _built["reason"] = f"building or loading it in {cache_dir} failed: {e}"
        return _built["reason"]


def _cpu_identity() -> str:
    try:  # the instruction sets -march=native may use
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _build(cache_dir: Path) -> str | None:
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on the PATH; set CXX)"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    flags = (*FLAGS, *os.environ.get(FLAGS_ENV_VAR, "").split())
    key = hashlib.sha256(
        "\n".join([SOURCE.read_text(), " ".join(flags), version, jax.lib.__version__, _cpu_identity()]).encode()
    ).hexdigest()[:16]
    library = cache_dir / "cpu_kernels" / f"cpu_kernels_{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")  # processes may build at once
        os.close(fd)
        logger.info("compiling the CPU kernels (once per machine) into %s", library)
        start = time.perf_counter()
        done = subprocess.run(
            [compiler, *flags, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", partial], capture_output=True, text=True
        )
        if done.returncode:
            os.unlink(partial)
            return f"compiling {SOURCE.name} failed:\n{done.stderr[-2000:]}"
        os.replace(partial, library)
        logger.info("compiled the CPU kernels in %.1f s", time.perf_counter() - start)
    lib = ctypes.cdll.LoadLibrary(str(library))
    for target, handler in (
        (ATTENTION_TARGET, lib.JaxserveRaggedPagedAttention),
        (MATMUL_TARGET, lib.JaxserveSmallMatmul),
        (DENSE_MATMUL_TARGET, lib.JaxserveDenseMatmul),
        (GREEDY_ARGMAX_TARGET, lib.JaxserveGreedyArgmax),
        (NORM_QKV_TARGET, lib.JaxserveNormQKV),
        (O_PROJ_MLP_TARGET, lib.JaxserveOProjMLP),
        (MOE_EXPERTS_TARGET, lib.JaxserveMoeExperts),
        (QUANTIZED_MATMUL_TARGET, lib.JaxserveQuantizedMatmul),
        (QUANTIZED_NORM_QKV_TARGET, lib.JaxserveQuantizedNormQKV),
        (QUANTIZED_O_PROJ_MLP_TARGET, lib.JaxserveQuantizedOProjMLP),
    ):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    _built["library"] = lib  # keep it loaded
    return None


def is_built() -> bool:
    """Whether build() has registered the kernels in this process."""
    return _built.get("library") is not None


def _check_built() -> None:
    if _built.get("library") is None:
        raise RuntimeError(
            "the CPU kernels are not built: call pallas_kernels.cpu_kernels.build(cache_dir) first"
            + (f" ({_built['reason']})" if _built.get("reason") else "")
        )


def unsupported_reason(q_dtype, kv_dtype, device: jax.Device) -> str | None:
    """Why the attention kernel cannot serve these dtypes on `device` (before any build), or None."""
    if device.platform != "cpu":
        return f"it runs on the CPU; this device is {device.platform}"
    if jnp.dtype(q_dtype) not in KV_DTYPES or jnp.dtype(kv_dtype) not in KV_DTYPES:
        return f"it takes float32 or bfloat16 queries and pages, not {jnp.dtype(q_dtype)} / {jnp.dtype(kv_dtype)}"
    return None


def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,
    kv_lens: jax.Array,  # int32 [S]
    block_tables: jax.Array,  # int32 [S, max_pages]
    query_start_loc: jax.Array,  # int32 [S + 1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    query_tile: int | None = None,
    kv_chunk_pages: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    tree_mask: jax.Array | None = None,
    fixed_order: bool = False,
) -> jax.Array:  # [T, num_heads, head_dim]; zeros for tokens past query_start_loc[S]
    """`ragged_paged_attention_reference`, computed by the C++ kernel (see the module doc).
    `query_tile` and `kv_chunk_pages` are the reference's tiling and are ignored here.
    `fixed_order`: a query row's sums run in one order whatever the other rows of its
    sequence's step (batch invariance: a prefill chunk's row equals the decode step's)."""
    del query_tile, kv_chunk_pages
    if k_scales is not None or v_scales is not None:
        raise ValueError(
            "the CPU attention kernel takes float32 or bfloat16 pages; an 8-bit cache runs on the "
            "reference (--attention-backend reference)"
        )
    _check_built()
    q, k_pages, v_pages = map(jnp.asarray, (q, k_pages, v_pages))
    # every bit set: plain causal attention
    tree_mask = as_mask_words(jnp.full(q.shape[:1], -1, jnp.int32) if tree_mask is None else tree_mask)
    ints = [jnp.asarray(x, jnp.int32) for x in (kv_lens, block_tables, query_start_loc, tree_mask)]
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    return call(
        q,
        k_pages,
        v_pages,
        *ints,
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
        fixed_order=bool(fixed_order),
    )


def in_row_blocks(kernel, rows: tuple[jax.Array, ...], *args, **kwargs):
    """`kernel(*rows, *args, **kwargs)` for any number of rows: blocks of MAX_ROWS rows, one
    call each (the arrays of `rows` [T, ...] are cut alike; `args` go to every call). The
    kernels compute each row alone in an order set by K and the machine, so a row's result
    does not depend on T or on the other rows (batch invariance)."""
    t = rows[0].shape[0]
    if t <= MAX_ROWS:
        return kernel(*rows, *args, **kwargs)
    blocks, pad = -(-t // MAX_ROWS), -t % MAX_ROWS
    cut = [jnp.pad(r, [(0, pad)] + [(0, 0)] * (r.ndim - 1)).reshape(blocks, MAX_ROWS, *r.shape[1:]) for r in rows]
    out = jax.lax.map(lambda block: kernel(*block, *args, **kwargs), tuple(cut))
    return jax.tree.map(lambda o: o.reshape(blocks * MAX_ROWS, *o.shape[2:])[:t], out)


def small_matmul(x: jax.Array, w: jax.Array, *, transposed: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] (or @ w.T for w [N, K] with `transposed`), M <= MAX_ROWS; float32
    or bfloat16, the result in x's dtype, accumulated in float32. Differentiable (the
    gradients are XLA dots), so a model marked for it still trains."""
    return _small_matmul(x, w, transposed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _small_matmul(x, w, transposed):
    _check_built()
    m, k = x.shape
    n = w.shape[0] if transposed else w.shape[1]
    if m > MAX_ROWS or k != w.shape[1 if transposed else 0]:
        raise ValueError(
            f"small_matmul takes x [M <= {MAX_ROWS}, K] and w [K, N] (or [N, K] transposed), "
            f"got {x.shape} and {w.shape}"
        )
    # Under vmap: one call per element (correct, not fast; the engine does not vmap it).
    call = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((m, n), x.dtype), vmap_method="sequential")
    return call(x, w, transposed=transposed)


def _small_matmul_fwd(x, w, transposed):
    return _small_matmul(x, w, transposed), (x, w)


def _small_matmul_bwd(transposed, residuals, g):
    x, w = residuals
    dx = g @ w if transposed else g @ w.T
    dw = g.T @ x if transposed else x.T @ g
    return dx.astype(x.dtype), dw.astype(w.dtype)


_small_matmul.defvjp(_small_matmul_fwd, _small_matmul_bwd)


def greedy_argmax(logits: jax.Array) -> jax.Array:
    """i32 [S]: `jnp.argmax(logits, axis=-1)` of float32 logits [S, V], bit for bit (the first
    maximum; the first NaN of a row that has one), each row read twice from cache."""
    _check_built()
    if logits.ndim != 2 or logits.dtype != jnp.float32 or logits.shape[1] < 1:
        raise ValueError(f"greedy_argmax takes float32 logits [S, V], got {logits.shape} {logits.dtype}")
    call = jax.ffi.ffi_call(
        GREEDY_ARGMAX_TARGET, jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32), vmap_method="sequential"
    )
    return call(logits)


def dense_vectorized() -> bool:
    """Whether dense_matmuls has its AVX-512 path in the built kernels (without it, a plain
    loop with the same results, slower than XLA's dot)."""
    _check_built()
    return bool(_built["library"].JaxserveDenseMatmulVectorized())


def dense_matmuls(x: jax.Array, ws: list[jax.Array]) -> list[jax.Array]:
    """[x @ w for w in ws] in one call, for x [M <= DENSE_MAX_ROWS, K] and float weights
    [K, N] as stored (q/k/v, or gate/up: one dispatch for them), float32 or bfloat16 (the
    weights of one dtype); each result in x's dtype, accumulated in float32. Each sum is one
    fused multiply-add chain over K in order: a row's result does not depend on the other
    rows. Differentiable (the gradients are XLA dots)."""
    return list(_dense_matmuls(x, tuple(ws)))


def dense_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w for one weight: `dense_matmuls(x, [w])`."""
    return _dense_matmuls(x, (w,))[0]


@jax.custom_vjp
def _dense_matmuls(x, ws):
    _check_built()
    if x.ndim != 2 or x.shape[0] > DENSE_MAX_ROWS or x.dtype not in KV_DTYPES:
        raise ValueError(
            f"dense_matmuls takes x [M <= {DENSE_MAX_ROWS}, K] float32 or bfloat16, got {x.shape} {x.dtype}"
        )
    if not ws or any(w.ndim != 2 or w.shape[0] != x.shape[1] or w.dtype != ws[0].dtype for w in ws):
        raise ValueError(f"dense_matmuls takes weights [K={x.shape[1]}, N] of one dtype, got {[w.shape for w in ws]}")
    if ws[0].dtype not in KV_DTYPES:
        raise ValueError(f"dense_matmuls takes float32 or bfloat16 weights, got {ws[0].dtype}")
    shapes = tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype) for w in ws)
    # Under vmap: one call per element (correct, not fast; the engine does not vmap it).
    return tuple(jax.ffi.ffi_call(DENSE_MATMUL_TARGET, shapes, vmap_method="sequential")(x, *ws))


def _dense_matmuls_fwd(x, ws):
    return _dense_matmuls(x, ws), (x, ws)


def _dense_matmuls_bwd(residuals, gs):
    x, ws = residuals
    dx = sum(g @ w.T for g, w in zip(gs, ws))
    return dx.astype(x.dtype), tuple((x.T @ g).astype(w.dtype) for g, w in zip(gs, ws))


_dense_matmuls.defvjp(_dense_matmuls_fwd, _dense_matmuls_bwd)


def dense_takes(rows: int, x_dtype, kernel: jax.Array) -> bool:
    """Whether dense_dot_general sends a product of `rows` rows of x_dtype at `kernel` to the kernel."""
    in_range = DENSE_MIN_ROWS <= rows <= DENSE_MAX_ROWS
    return kernel.ndim == 2 and in_range and x_dtype == kernel.dtype and x_dtype in KV_DTYPES


def dense_dot_general(x, kernel, dimension_numbers, precision=None, **kwargs):
    """`jax.lax.dot_general` for a layer's x [..., K] @ kernel [K, N] (what nnx.Linear asks for):
    DENSE_MIN_ROWS to DENSE_MAX_ROWS rows of one float dtype through dense_matmul, anything else
    through XLA. runner.kernels sets it as the float projections' `dot_general` on the CPU."""
    rows = int(np.prod(x.shape[:-1]))
    if dense_takes(rows, x.dtype, kernel):
        return dense_matmul(x.reshape(rows, x.shape[-1]), kernel).reshape(*x.shape[:-1], kernel.shape[1])
    return jax.lax.dot_general(x, kernel, dimension_numbers, precision=precision, **kwargs)


def tile_int4(
    packed: jax.Array, scales: jax.Array, offsets: jax.Array, scale_dtype=jnp.float32
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An int4 weight from `pallas_kernels.quantized_matmul`'s layout (packed [K // 2, N],
    scales and offsets [G, N]) to int4_matmul's: tiles of INT4_TILE output columns, each
    stored whole (packed [tiles, K // 2, INT4_TILE], scales and offsets [tiles, G,
    INT4_TILE] in `scale_dtype`: float32, or float16 where it holds them exactly, see
    half_scales_exact), N padded with zero columns to whole tiles. Leading axes (stacked
    layers) are kept."""
    return _tile_columns(packed), _tile_columns(scales.astype(scale_dtype)), _tile_columns(offsets.astype(scale_dtype))


def _tile_columns(a: jax.Array) -> jax.Array:
    """[..., R, N] -> [..., tiles, R, INT4_TILE]: each tile of output columns stored whole, N
    padded with zero columns to whole tiles."""
    n = a.shape[-1]
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, -n % INT4_TILE)])
    a = a.reshape(*a.shape[:-1], a.shape[-1] // INT4_TILE, INT4_TILE)
    return jnp.moveaxis(a, -2, -3)


def half_scales_exact(*arrays) -> bool:
    """Whether float16 holds a weight's scales (and int4's offsets) exactly (GGUF's own
    blocks carry float16 d and m): then the kernels read them at half the bytes, same results."""
    return all(
        np.array_equal(np.asarray(a, np.float32).astype(np.float16).astype(np.float32), np.asarray(a, np.float32))
        for a in arrays
    )


def untile_int4(
    packed: jax.Array, scales: jax.Array, offsets: jax.Array, n: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tile_int4 undone: the weight of N output columns in quantized_matmul's layout."""
    return _untile_columns(packed, n), *(_untile_columns(a, n).astype(jnp.float32) for a in (scales, offsets))


def _untile_columns(a: jax.Array, n: int) -> jax.Array:
    """_tile_columns undone: [..., tiles, R, INT4_TILE] -> [..., R, N]."""
    a = jnp.moveaxis(a, -3, -2)
    return a.reshape(*a.shape[:-2], a.shape[-2] * INT4_TILE)[..., :n]


def int4_matmul(x: jax.Array, packed: jax.Array, scales: jax.Array, offsets: jax.Array, n: int) -> jax.Array:
    """x [M <= QUANTIZED_MAX_ROWS, K] @ an int4 weight of N output columns in tile_int4's layout ->
    [M, N] in x's dtype (float32 or bfloat16), accumulated in float32, the weight never
    dequantized to memory. Not differentiable."""
    if packed.dtype != jnp.uint8:
        raise ValueError(f"int4_matmul takes packed uint8 nibbles, got {packed.dtype}")
    return quantized_matmuls(x, [QuantizedWeight(packed, scales, offsets, n)])[0]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales", "offsets"], meta_fields=["n"])
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A 4- or 8-bit weight of N output columns in the CPU kernels' tiled layout: int4 as
    tile_int4 makes it (values: packed uint8 [tiles, K // 2, INT4_TILE]), int8 as tile_int8
    (values: int8 [tiles, K, INT4_TILE]); scales [tiles, G, INT4_TILE] in float32 or float16;
    offsets as the scales (int4 always; int8 where it has them, else None). A pytree whose N
    is static."""

    values: jax.Array
    scales: jax.Array
    offsets: jax.Array | None
    n: int

    @property
    def k(self) -> int:
        return self.values.shape[1] * (2 if self.values.dtype == jnp.uint8 else 1)

    def arrays(self) -> list[jax.Array]:
        return [self.values, self.scales] + ([] if self.offsets is None else [self.offsets])

    def check(self, k: int, name: str = "quantized_matmul") -> None:
        """Raise ValueError unless this is a weight of K inputs the kernels take."""
        values, scales, offsets, n = self.values, self.scales, self.offsets, self.n
        tiles, groups = scales.shape[:2] if scales.ndim == 3 else (0, 0)
        int4 = values.dtype == jnp.uint8
        if (
            values.dtype not in (jnp.uint8, jnp.int8)
            or values.shape != (tiles, k // 2 if int4 else k, INT4_TILE)
            or scales.shape != (tiles, groups, INT4_TILE)
            or k % groups
            or not (tiles - 1) * INT4_TILE < n <= tiles * INT4_TILE
            or (int4 and offsets is None)
            or (offsets is not None and (offsets.shape != scales.shape or (k // groups) % 2))
        ):
            raise ValueError(
                f"{name} takes weights of K={k} inputs in tile_int4's layout (packed uint8 [tiles, K // 2, "
                f"{INT4_TILE}], scales and offsets [tiles, G, {INT4_TILE}]) or tile_int8's (int8 [tiles, K, "
                f"{INT4_TILE}], scales and maybe offsets), G dividing K (an even K // G with offsets), N in the last "
                f"tile; got {values.dtype} {values.shape}, {scales.shape}, "
                f"{None if offsets is None else offsets.shape}, N={n}"
            )
        if scales.dtype not in (jnp.float32, jnp.float16) or (offsets is not None and offsets.dtype != scales.dtype):
            raise ValueError(
                f"{name} takes float32 or float16 scales, offsets in the scales' dtype, not {scales.dtype}"
                + ("" if offsets is None else f", {offsets.dtype}")
            )


def quantized_matmuls(x: jax.Array, weights: list[QuantizedWeight]) -> list[jax.Array]:
    """x [M <= QUANTIZED_MAX_ROWS, K] @ each of `weights` (int4 or int8, any mix of layouts, K alike) ->
    [M, N] each in x's dtype (float32 or bfloat16), accumulated in float32, as one call: q, k
    and v (or gate and up) pay one dispatch and one wake-up of the thread pool, and their
    tiles share it. Not differentiable."""
    _check_built()
    m, k = x.shape
    if m > QUANTIZED_MAX_ROWS or x.dtype not in KV_DTYPES:
        raise ValueError(
            f"quantized_matmul takes float32 or bfloat16 x [M <= {QUANTIZED_MAX_ROWS}, K], got {x.dtype} {x.shape}"
        )
    for w in weights:
        w.check(k)
    shapes = [jax.ShapeDtypeStruct((m, w.n), x.dtype) for w in weights]
    call = jax.ffi.ffi_call(QUANTIZED_MATMUL_TARGET, shapes, vmap_method="sequential")
    return list(call(x, *(a for w in weights for a in w.arrays())))


def q8_0_blocks(table, block: int = Q8_0_BLOCK) -> tuple[np.ndarray, np.ndarray] | None:
    """A float table [N, K] whose every run of `block` values along K is a float16 scale times
    int8 values (GGUF's Q8_0 blocks, dequantized exactly), as its int8 values q [K, N] and
    scales [K // block, N] in float16 (x @ table.T = int8_matmul's product on them, the same
    values); None when any block is not. Q8_0's scale is max|w| / 127, so it is found again
    exactly from the dequantized block."""
    t = np.asarray(table, np.float32)
    n, k = t.shape
    if k % block:
        return None
    blocks = t.reshape(n, k // block, block)
    with np.errstate(invalid="ignore", over="ignore"):
        scales = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float16)
        s32 = scales.astype(np.float32)[..., None]
        q = np.rint(blocks / np.where(s32 == 0, np.float32(1), s32))
    if not (np.abs(q).max(initial=0) <= 127 and np.array_equal(q * s32, blocks)):
        return None
    return q.astype(np.int8).reshape(n, k).T, scales.T


def tile_int8(q: jax.Array, scales: jax.Array, scale_dtype=jnp.float16) -> tuple[jax.Array, jax.Array]:
    """An int8 weight q [K, N] with scales [G, N] in int8_matmul's layout: q [tiles, K,
    INT4_TILE], scales [tiles, G, INT4_TILE] in `scale_dtype`, as tile_int4 tiles int4
    (offsets, where a weight has them, tile as its scales: tile_scales)."""
    return _tile_columns(q), tile_scales(scales, scale_dtype)


def tile_scales(a: jax.Array, scale_dtype=jnp.float16) -> jax.Array:
    """Per-group values [G, N] (an int8 weight's scales or offsets) in int8_matmul's layout."""
    return _tile_columns(a.astype(scale_dtype))


def untile_int8(q: jax.Array, scales: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """tile_int8 undone: the weight of N output columns in quantized_matmul's layout."""
    return _untile_columns(q, n), untile_scales(scales, n)


def untile_scales(a: jax.Array, n: int) -> jax.Array:
    """tile_scales undone, in float32."""
    return _untile_columns(a, n).astype(jnp.float32)


def int8_matmul(x: jax.Array, q: jax.Array, scales: jax.Array, n: int, offsets: jax.Array | None = None) -> jax.Array:
    """x [M <= QUANTIZED_MAX_ROWS, K] @ W with W[k, c] = scales[g, c] * q[k, c] (+ offsets[g, c]; g = k //
    (K // G)), in tile_int8's layout, N output columns -> [M, N] in x's dtype (float32 or
    bfloat16), accumulated in float32, the weight never written out as floats. Not differentiable."""
    if q.dtype != jnp.int8:
        raise ValueError(f"int8_matmul takes int8 q, got {q.dtype}")
    return quantized_matmuls(x, [QuantizedWeight(q, scales, offsets, n)])[0]


def _check_block(name: str, x: jax.Array, *arrays: jax.Array, max_rows: int = MAX_ROWS) -> None:
    _check_built()
    if x.ndim != 2 or x.shape[0] > max_rows:
        raise ValueError(f"{name} takes up to {max_rows} rows [M, D], got {x.shape}")
    if x.dtype not in KV_DTYPES or any(a.dtype != x.dtype for a in arrays):
        raise ValueError(
            f"{name} takes float32 or bfloat16 arrays of one dtype, got {sorted({str(a.dtype) for a in (x, *arrays)})}"
        )


def norm_qkv(
    x: jax.Array, norm_weight: jax.Array, wq: jax.Array, wk: jax.Array, wv: jax.Array, *, eps: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The first half of a decoder layer for a few rows: h = norm_weight * RMSNorm(x), then
    h @ wq, h @ wk, h @ wv (weights [D, N], no biases), as one call. x [M <= MAX_ROWS, D];
    float32 or bfloat16 throughout, accumulated in float32. Not differentiable."""
    _check_block("norm_qkv", x, norm_weight, wq, wk, wv)
    m = x.shape[0]
    shapes = [jax.ShapeDtypeStruct((m, w.shape[1]), x.dtype) for w in (wq, wk, wv)]
    call = jax.ffi.ffi_call(NORM_QKV_TARGET, shapes, vmap_method="sequential")
    return tuple(call(x, norm_weight, wq, wk, wv, eps=np.float32(eps)))


def o_proj_mlp(
    attn: jax.Array,
    x: jax.Array,
    wo: jax.Array,
    norm_weight: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    eps: float,
) -> jax.Array:
    """The second half of a decoder layer for a few rows, as one call: x1 = x + attn @ wo,
    then x1 + (silu(h @ w_gate) * (h @ w_up)) @ w_down with h = norm_weight * RMSNorm(x1).
    attn [M <= MAX_ROWS, A], x [M, D]; weights [K, N]; float32 or bfloat16 throughout.
    Not differentiable."""
    _check_block("o_proj_mlp", attn, x, wo, norm_weight, w_gate, w_up, w_down)
    call = jax.ffi.ffi_call(O_PROJ_MLP_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential")
    return call(attn, x, wo, norm_weight, w_gate, w_up, w_down, eps=np.float32(eps))


def quantized_norm_qkv(
    x: jax.Array, norm_weight: jax.Array, wq: QuantizedWeight, wk: QuantizedWeight, wv: QuantizedWeight, *, eps: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """norm_qkv on 4- and 8-bit weights (each its own layout, as quantized_matmuls takes them):
    h = norm_weight * RMSNorm(x) rounded to x's dtype, then h @ wq, h @ wk, h @ wv, as one call.
    x [M <= QUANTIZED_MAX_ROWS, D] float32 or bfloat16, the norm's weight alike. Not differentiable."""
    _check_block("quantized_norm_qkv", x, norm_weight, max_rows=QUANTIZED_MAX_ROWS)
    for w in (wq, wk, wv):
        w.check(x.shape[1], "quantized_norm_qkv")
    shapes = [jax.ShapeDtypeStruct((x.shape[0], w.n), x.dtype) for w in (wq, wk, wv)]
    call = jax.ffi.ffi_call(QUANTIZED_NORM_QKV_TARGET, shapes, vmap_method="sequential")
    return tuple(call(x, norm_weight, *wq.arrays(), *wk.arrays(), *wv.arrays(), eps=np.float32(eps)))


def quantized_o_proj_mlp(
    attn: jax.Array,
    x: jax.Array,
    wo: QuantizedWeight,
    norm_weight: jax.Array,
    w_gate: QuantizedWeight,
    w_up: QuantizedWeight,
    w_down: QuantizedWeight,
    *,
    eps: float,
) -> jax.Array:
    """o_proj_mlp on 4- and 8-bit weights (each its own layout, as quantized_matmuls takes
    them), as one call; each product's result rounded to x's dtype as the model's ops round it.
    attn [M <= QUANTIZED_MAX_ROWS, A], x [M, D]; float32 or bfloat16, one dtype. Not differentiable."""
    _check_block("quantized_o_proj_mlp", attn, x, norm_weight, max_rows=QUANTIZED_MAX_ROWS)
    a, d, f = attn.shape[1], x.shape[1], w_down.k
    for w, k, n in ((wo, a, d), (w_gate, d, f), (w_up, d, f), (w_down, f, d)):
        if w.n != n:
            raise ValueError(f"quantized_o_proj_mlp: a weight of {w.n} outputs where {n} are needed")
        w.check(k, "quantized_o_proj_mlp")
    if w_gate.values.shape[0] != w_up.values.shape[0]:
        raise ValueError("quantized_o_proj_mlp takes gate and up of the same tiles")
    arrays = [array for w in (wo, w_gate, w_up, w_down) for array in w.arrays()]
    call = jax.ffi.ffi_call(
        QUANTIZED_O_PROJ_MLP_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential"
    )
    return call(attn, x, norm_weight, *arrays, eps=np.float32(eps))


def moe_experts(
    x: jax.Array, chosen: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
    """sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])) with e = chosen[t, j], for
    x [T, D]; chosen int32 and weights [T, k]; gate and up [E, D, F], down [E, F, D] (ExpertLinear's
    kernels). float32 or bfloat16 x and experts, one dtype; the result [T, D] in x's dtype, rounded
    as moe.run_touched_experts rounds. Any T, but each expert's weights are read once per 16 of
    its tokens: meant for decode steps. Not differentiable."""
    _check_built()
    if x.ndim != 2 or chosen.ndim != 2 or chosen.shape != weights.shape or chosen.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_experts takes x [T, D], chosen and weights [T, k], got {x.shape}, {chosen.shape}, {weights.shape}"
        )
    dtypes = sorted({str(a.dtype) for a in (x, gate, up, down)})
    if x.dtype not in KV_DTYPES or len(dtypes) > 1:
        raise ValueError(f"moe_experts takes float32 or bfloat16 x and experts of one dtype, got {dtypes}")
    call = jax.ffi.ffi_call(MOE_EXPERTS_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential")
    return call(x, chosen.astype(jnp.int32), weights.astype(jnp.float32), gate, up, down)
