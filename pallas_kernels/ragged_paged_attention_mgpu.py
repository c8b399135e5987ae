"""Ragged paged attention as a Pallas Mosaic GPU kernel (Hopper: TMA, wgmma, warp specialization).

Same signature and semantics as `ragged_paged_attention_reference` (see its module): the
flat token axis holds the new tokens of many sequences (prefill chunks and decode tokens
alike); each token attends causally over its own sequence's paged context, optionally
limited to a sliding window and soft-capped. NOTE: the K/V of this step's new tokens
must already be in the pages when this is called (the model writes them first); the
kernel only reads the cache.

The work is cut in three layers. The first and last are plain jnp in the same jit:

1. Plan (`plan_work`, XLA; depends only on kv_lens / query_start_loc, so one plan can
   serve every layer of a step). Each sequence's new tokens are cut into query tiles of
   `query_tile` tokens. A tile's rows are its tokens times the G = num_heads /
   num_kv_heads query heads that share a KV head (row = token * G + head_in_group), so
   even a decode step of a GQA model puts G rows into the M dimension of the matmul. A
   tile needs the kv blocks (`block_kv` tokens, a whole number of pages) from its first
   visible key to its last query's position. When there are too few tiles to keep every
   SM busy (long decodes at small batch), a tile's blocks are split evenly over several
   work items, flash-decoding style: the split length is picked (on device) among a few
   candidates to minimise the estimated makespan of the round-robin over the CTAs, none
   shorter than `min_split_blocks` blocks, every non-empty tile at least one item.

       sequence s: | tile 0 (tq tokens) | tile 1 | ...        (its new tokens)
       tile t:     kv blocks [b_lo, b_hi)  ->  items [b_lo, b1), [b1, b2), ..., [bk, b_hi)

   The queries are gathered into a tile-major layout [tiles * rows, KV * D] (rows =
   tq * G rounded up to 8, the smem tile height) so the kernel can TMA a tile's rows of
   one KV head as a [64, D] box.

2. Kernel. A persistent grid of `num_ctas` CTAs walks the (item, kv head) work units
   round-robin. Each CTA has `num_compute_wgs` compute warpgroups (64 query rows each)
   and one memory warpgroup:

       memory WG:   for each block: wait slot free -> one TMA per page for K, then V
                    (8-bit: and one for the page's scales)
       compute WG:  wait K -> S = Q K^T (wgmma) -> scale, soft-cap, mask -> online
                    softmax (base 2) -> wait V -> O += P V (wgmma) -> free the slot
                    (8-bit: upcast K / V into the WG's buffer first, see below)

   K and V go through a ring of `max_concurrent_steps` shared-memory slots ([block_kv,
   D], 128-byte swizzle), so the loads of later blocks (and of the next work unit)
   overlap the current one's math; each unit's Q is loaded while the previous unit
   runs. A unit ends by writing O / l (q's dtype) and the base-2 log-sum-exp of each
   of its rows.

3. Combine (XLA). The partial results of a tile's items are merged by their
   log-sum-exps (exactly a softmax over the union of their key ranges), then gathered
   back to the flat [T, H, D] token order; padding tokens get zeros.

An 8-bit KV cache (`quantized_kv`: e4m3 or int8 pages, a float32 scale per token and KV
head, given as `k_scales` / `v_scales`) is dequantized inside the kernel, never copied
out dequantized. The memory WG TMAs the 8-bit pages (half the bytes) and, beside each,
the page's page_size scales of that head into a [block_kv] ring slot on the same
barrier. wgmma cannot mix 8-bit with bf16, so each compute WG upcasts the block (smem ->
registers -> q's dtype -> its own [block_kv, D] smem buffer, fenced) and runs the wgmma
on that; K and then V share the buffer. The upcast is exact (every e4m3 / int8 value is
a bf16 and an f16 number), so the scales are applied in f32 outside the matmuls, one
per key column: S = (Q Kq^T) * k_scale and O += (P * v_scale) Vq (l sums the unscaled
P). That costs [64, block_kv] multiplies per block instead of [block_kv, D] in the
upcast, and adds no bf16 rounding of scaled values. The ring slot is freed as soon as
it is read, before the matmul.

A tree mask (`tree_mask`, W words per new token: speculative tree verification, see the
reference) travels with the query rows: gathered into the same tile-major row order
([W, tiles * rows] int32), a TMA per word and unit beside Q on the same barrier, then held
in registers for the unit. Only blocks holding some of a sequence's first 32 W new tokens
apply it (a second select after the causal / window one; past one word, each key's word is
selected first); without a tree the kernel is built without it.

Slots past a sequence's context (the tail of its last page, pages it does not own) may
hold anything, NaN included (the tests fill them with NaN, and their scales too): their
scores are replaced by -inf with a select (only in blocks that cross the causal
diagonal, the window edge or the context end), pages wholly past the context are not
read, and V rows past the context are zeroed in shared memory before P V (8-bit: in
each WG's upcast copy, and their v_scale by a select), so 0 * NaN never reaches the
output.

Batch-invariant mode (`batch_invariant=True`, `TuningConfig.batch_invariant`; what the
engine's --batch-invariant needs on Hopper, not yet wired there: jaxserve/runner/kernels.py):
a token's output rows are bit for bit the same whatever else the call holds (alone, in any
batch at any place, in any bucket, its prompt in one chunk or several).
By default three things depend on the step, and this mode fixes each:

- block_kv (the online softmax's blocking) came from the bucket, tree and kv dtype: it is
  max(64, page_size), always (`default_config`);
- the split length came from the whole step's work and splits were even: split j is now
  blocks [j * c, (j + 1) * c) of the context, c = `split_blocks` (a constant), clipped to
  the tile's own blocks (`_fixed_splits`);
- segment sums merged a tile's items in an order XLA picks: `_combine_in_split_order`
  takes the max of the splits' lse, then folds w * o and w split by split, elementwise.

The query tile still follows the bucket. That is harmless because each query row is
computed on its own (its own row of each wgmma, a row-wise max and sum; a mask select
keeps a visible score as it is) and a block wholly masked for a row leaves its state bit
for bit: every score is -inf, so the row max stays (m_new == m), the rescale is exactly 1
(a select: not left to ex2.approx of 0), p = exp2(-inf) = +0, so l + 0 = l and
acc * 1 + 0 * V = acc (V past the context is zeroed: no NaN; at most the sign of a zero
in acc can flip, which the combine absorbs: its sums start at +0, so are never -0). A
token in a prefill tile meets only such extra blocks beside its own: past its position
(the tile's later queries) and before its window (the tile's earlier ones); and extra
splits wholly masked for it (o = 0, lse = -inf), which add +0 in the combine, just as the
splits it lacks alone.

Cost: the work list is static, sized for the worst case, every tile meeting
`max_splits(config, max_pages * page_size, window)` splits; the partial outputs (q's
dtype, plus a float32 lse per row) take that many times the tiles' rows. At c = 32
blocks (2048 keys) a decode at context 32K still gets 16 splits per head, and the buffer
costs (Llama-3-8B heads, 132 CTAs): decode b64 at 8K 4 MiB (default 3 MiB), the engine's
512-token bucket at 8K 32 MiB (25), a 8192-token prefill with 32K block tables 1 GiB
(99 MiB) or 263 MiB under a 4096 window. Halving c doubles the splits and the buffer.

Supported: bf16 / f16 (q, and the pages unless 8-bit), head_dim 64 or 128, page sizes
that are multiples of 8 dividing 256, any GQA ratio up to 128 query heads per KV head.
`unsupported_reason` says why a call is not supported; the kernel raises it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention import max_tiles

ROWS_PER_WG = 64  # query rows per compute warpgroup: the M of one wgmma
H100_SMS = 132  # SMs of an H100 / H200 SXM: the default persistent grid
SMEM_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90
# Row max / sum of the WGMMA layout stay within a warp (shuffles), so no cross-warp
# reduction scratch is reserved (Mosaic GPU's default is 2 KiB; lowering fails if needed).
_REDUCTION_SCRATCH = 0
_SWIZZLE = 128
_LOG2E = math.log2(math.e)
# Registers per thread with two compute warpgroups (warp specialization moves them from the
# memory warpgroup, which only issues copies): 2 x 240 + 32 fill the SM's 64K. 232 + 40
# left the 8-bit prefill spilling 4 bytes per thread; the memory warpgroup does not spill at 32.
COMPUTE_WG_REGISTERS = 240
MEMORY_WG_REGISTERS = 32
_NEG_BIG = -1e30  # finite "no key yet" running max: exp2(m_old - m_new) stays NaN-free

# Columns of the int32 [max_items, _META] work list the kernel reads.
_TILE, _SEQ, _BLK_BEGIN, _BLK_END, _POS0, _KV_LEN, _NUM_Q, _NEW0 = range(8)
_META = 8


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Tiles and pipeline of the kernel. `default_config` picks one per bucket."""

    block_kv: int = 128  # kv tokens per pipeline step (a whole number of pages)
    max_concurrent_steps: int = 2  # depth of the K/V shared-memory ring
    num_compute_wgs: int = 1  # 64 query rows each; 2 for prefill-sized tiles
    query_tile: int = 1  # tokens per query tile; rows = query_tile * G
    num_ctas: int = H100_SMS  # persistent grid size
    max_waves: int = 8  # flash-decoding makes at most about num_ctas * max_waves work units
    min_split_blocks: int = 2  # do not split a tile's kv range finer than this
    # P V takes P from registers (as FlashAttention 3) unless this stages P through
    # shared memory; the Mosaic GPU interpreter supports only the latter.
    p_via_smem: bool = False
    # A token's output bits depend on its own sequence only (see "Batch-invariant mode" in
    # the module docstring): splits of `split_blocks` blocks at absolute block boundaries
    # (max_waves and min_split_blocks unused), combined in a fixed order.
    batch_invariant: bool = False
    split_blocks: int = 32

    def __post_init__(self):
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"{self.block_kv=} must be 64, 128, 192 or 256")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"{self.max_concurrent_steps=} must be at least 2")
        if self.num_compute_wgs not in (1, 2):
            raise ValueError(f"{self.num_compute_wgs=} must be 1 or 2")
        if self.query_tile < 1:
            raise ValueError(f"{self.query_tile=} must be positive")
        if self.num_ctas < 1 or self.max_waves < 1 or self.min_split_blocks < 1:
            raise ValueError(f"{self.num_ctas=}, {self.max_waves=} and {self.min_split_blocks=} must be positive")
        if self.split_blocks < 1:
            raise ValueError(f"{self.split_blocks=} must be positive")

    def with_query_tile(self, query_tile: int, groups: int) -> TuningConfig:
        """This config with `query_tile` tokens per tile (at most two warpgroups' rows) and
        the compute warpgroups those rows need."""
        tq = max(1, min(query_tile, (2 * ROWS_PER_WG) // groups))
        return dataclasses.replace(self, query_tile=tq, num_compute_wgs=1 if tq * groups <= ROWS_PER_WG else 2)

    def rows_per_tile(self, groups: int) -> int:
        """Query rows of one tile in the gathered layout: tq * G rounded up to 8."""
        return -(-self.query_tile * groups // 8) * 8

    def check(self, *, groups: int, page_size: int) -> None:
        """Raise ValueError if this config cannot serve this head grouping / page size."""
        if (rows := self.query_tile * groups) > ROWS_PER_WG * self.num_compute_wgs:
            raise ValueError(
                f"{self.query_tile=} * {groups=} = {rows} query rows exceed {ROWS_PER_WG} * {self.num_compute_wgs=}"
            )
        if self.num_compute_wgs == 2 and rows <= ROWS_PER_WG:
            raise ValueError(
                f"{self.query_tile=} * {groups=} = {rows} query rows leave the second of {self.num_compute_wgs=} idle"
            )
        if self.block_kv % page_size:
            raise ValueError(f"{self.block_kv=} must be a multiple of {page_size=}")

    def smem_bytes(self, head_dim: int, itemsize: int = 2, kv_itemsize: int | None = None, tree_words: int = 0) -> int:
        """Shared memory the kernel asks for: buffers (1 KiB aligned), barriers, reductions.

        `kv_itemsize` 1 is an 8-bit cache: its K/V ring costs half, plus the scales' ring
        and one upcast [block_kv, D] buffer per compute warpgroup. `tree_words` (a tree
        mask's words a token) adds the double-buffered words of the query rows.
        """

        def align(n: int) -> int:
            return -(-n // 1024) * 1024

        wgs, rows, steps, bkv = self.num_compute_wgs, ROWS_PER_WG, self.max_concurrent_steps, self.block_kv
        kv_itemsize = kv_itemsize or itemsize
        q = align(2 * wgs * rows * head_dim * itemsize)  # double-buffered Q / O
        kv = 2 * align(steps * bkv * head_dim * kv_itemsize)
        quantized = kv_itemsize != itemsize
        scales = 2 * align(steps * bkv * 4) if quantized else 0
        upcast = align(wgs * bkv * head_dim * itemsize) if quantized else 0
        lse = align(wgs * rows * 4)
        words = align(2 * wgs * tree_words * rows * 4) if tree_words else 0
        p = align(wgs * rows * bkv * itemsize) if self.p_via_smem else 0
        barriers = 8 * (2 * wgs + 1 + 4 * steps)
        return q + kv + scales + upcast + lse + words + p + barriers + _REDUCTION_SCRATCH


def default_query_tile(num_tokens: int, num_seqs: int) -> int:
    """Query tile length for a (token, sequence) bucket: about tokens per sequence, at most 32.

    Decode-heavy buckets (one token per sequence) get tiles of 1, so no work is spent on
    empty query rows; prefill-heavy ones get longer tiles, so the context is gathered
    once per tile rather than once per token.
    """
    per_seq = min(32, max(1, num_tokens // max(1, num_seqs)))
    return 1 << (per_seq.bit_length() - 1)  # round down to a power of two


def default_config(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    *,
    num_ctas: int | None = None,
    query_tile: int | None = None,
    p_via_smem: bool = False,
    kv_dtype=None,
    tree_words: int = 0,
    batch_invariant: bool = False,
) -> TuningConfig:
    """A config for a (token, sequence) bucket and model shape.

    Decode-heavy buckets get one-token tiles and one compute warpgroup; prefill-heavy
    ones get 128-row tiles (two warpgroups) so each K/V block feeds more queries. The
    K/V ring is as deep as shared memory allows, up to 4 steps. 8-bit caches, and tree
    masks with two compute warpgroups, take 64-key blocks (fewer live registers: no spills
    on sm_90a). `kv_dtype` is the pages' dtype when it is 8-bit (the ring then costs half,
    the upcast buffers more);
    `tree_words` is for calls with a tree mask of that many words a token. `batch_invariant` fixes block_kv at max(64,
    page_size) whatever the bucket, tree or kv dtype: the online softmax's blocking then
    never depends on the step (the query tile still does, which the kernel makes harmless).
    """
    kv_itemsize = jnp.dtype(kv_dtype).itemsize if kv_dtype is not None else 2

    def smem(c: TuningConfig) -> int:
        return c.smem_bytes(head_dim, 2, kv_itemsize, tree_words)

    cfg = TuningConfig(block_kv=max(128, page_size), num_ctas=num_ctas or device_sm_count(), p_via_smem=p_via_smem)
    cfg = cfg.with_query_tile(query_tile or default_query_tile(num_tokens, num_seqs), num_heads // num_kv_heads)
    if batch_invariant:
        cfg = dataclasses.replace(cfg, block_kv=max(64, page_size), batch_invariant=True)
    elif kv_itemsize == 1 or (tree_words and cfg.num_compute_wgs == 2):
        # The upcast of an 8-bit block, and the tree words beside two warpgroups' rows, keep
        # more registers live next to the [64, block_kv] float32 scores: at 128 keys ptxas
        # spilled 8-136 bytes per thread in the inner loop; at 64 none
        # (benchmarks/gpu_compile.py, sm_90a).
        cfg = dataclasses.replace(cfg, block_kv=max(64, page_size))
    while smem(cfg) > SMEM_BYTES and cfg.block_kv > max(64, page_size):
        cfg = dataclasses.replace(cfg, block_kv=cfg.block_kv // 2)
    while cfg.max_concurrent_steps < 4:
        deeper = dataclasses.replace(cfg, max_concurrent_steps=cfg.max_concurrent_steps + 1)
        if smem(deeper) > SMEM_BYTES:
            break
        cfg = deeper
    return cfg


def device_sm_count() -> int:
    """SMs of the default GPU, or of an H100 / H200 when there is none (lowering on CPU)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return H100_SMS
    return getattr(device, "core_count", None) or H100_SMS


_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# uint8 pages hold e4m3 bit patterns (how the engine stores an fp8 cache: see quantized_kv).
_KV8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint8), jnp.dtype(jnp.int8))


def unsupported_reason(
    q, k_pages, v_pages=None, *, k_scales=None, v_scales=None, tree_mask=None, config: TuningConfig | None = None
) -> str | None:
    """Why the kernel cannot run these shapes / dtypes (/ config), or None if it can.

    Without scales q, k and v are all bf16 or all f16; with `k_scales` and `v_scales`
    (float32 [P, KV, page_size], see `quantized_kv`) the pages are e4m3 or int8. A
    `tree_mask` is int32 [T].
    """
    if q.ndim != 3 or k_pages.ndim != 4:
        return f"expected q [T, H, D] and pages [P, page_size, KV, D], got {q.shape=} {k_pages.shape=}"
    if v_pages is not None and v_pages.shape != k_pages.shape:
        return f"{k_pages.shape=} != {v_pages.shape=}"
    _, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, kv_dim = k_pages.shape
    kv_dtypes = {jnp.dtype(x.dtype) for x in (k_pages, v_pages) if x is not None}
    if (k_scales is None) != (v_scales is None):
        return "k_scales and v_scales must be given together (an 8-bit cache) or not at all"
    if k_scales is None:
        dtypes = kv_dtypes | {jnp.dtype(q.dtype)}
        if len(dtypes) != 1 or dtypes.pop() not in _FLOAT_DTYPES:
            if kv_dtypes & set(_KV8_DTYPES):
                return f"8-bit pages ({k_pages.dtype}) need k_scales and v_scales"
            return f"q, k and v must all be bf16 or all f16, got {q.dtype=} {k_pages.dtype=}"
    else:
        if len(kv_dtypes) != 1 or kv_dtypes.pop() not in _KV8_DTYPES:
            return (
                f"with k_scales / v_scales the pages must all be float8_e4m3fn or all int8 (or uint8: "
                f"e4m3 bit patterns), "
                f"got {k_pages.dtype=}{f' {v_pages.dtype=}' if v_pages is not None else ''}"
            )
        if jnp.dtype(q.dtype) not in _FLOAT_DTYPES:
            return f"q must be bf16 or f16 with an 8-bit cache, got {q.dtype=}"
        want = (num_pages, num_kv_heads, page_size)
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if tuple(s.shape) != want or jnp.dtype(s.dtype) != jnp.dtype(jnp.float32):
                return f"{name} must be float32 {want} (pages, KV heads, page_size), got {s.dtype} {tuple(s.shape)}"
    if tree_mask is not None and (
        tuple(tree_mask.shape[:1]) != q.shape[:1]
        or tree_mask.ndim not in (1, 2)
        or jnp.dtype(tree_mask.dtype) != jnp.int32
    ):
        return (
            f"tree_mask must be int32 {q.shape[:1]} or {q.shape[:1] + ('W',)} (words a token), "
            f"got {tree_mask.dtype} {tree_mask.shape}"
        )
    if kv_dim != head_dim:
        return f"{head_dim=} of q != {kv_dim=} of the pages"
    if head_dim not in (64, 128):
        # 256 would lower, but O and the fresh P V accumulator ([64, D] f32 each) would
        # not fit in a warpgroup's registers together.
        return f"{head_dim=} must be 64 or 128"
    if num_heads % num_kv_heads:
        return f"{num_heads=} must be a multiple of {num_kv_heads=}"
    if num_heads // num_kv_heads > 2 * ROWS_PER_WG:
        return f"at most {2 * ROWS_PER_WG} query heads per KV head, got {num_heads // num_kv_heads}"
    if page_size % 8 or 256 % page_size:
        return f"{page_size=} must be a multiple of 8 that divides 256"
    if config is not None:
        try:
            config.check(groups=num_heads // num_kv_heads, page_size=page_size)
        except ValueError as e:
            return str(e)
        words = 0 if tree_mask is None else math.prod(tree_mask.shape[1:])
        if (smem := config.smem_bytes(head_dim, 2, k_pages.dtype.itemsize, words)) > SMEM_BYTES:
            return f"{config} needs {smem} bytes of shared memory, more than {SMEM_BYTES}"
    return None


def is_supported(
    q, k_pages, v_pages=None, *, k_scales=None, v_scales=None, tree_mask=None, config: TuningConfig | None = None
) -> bool:
    return (
        unsupported_reason(
            q, k_pages, v_pages, k_scales=k_scales, v_scales=v_scales, tree_mask=tree_mask, config=config
        )
        is None
    )


# ------------------------------------------------------------------------------------
# 1. Plan: query tiles and work items.
# ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkPlan:
    """Device-side work list of one step; depends on kv_lens / query_start_loc only."""

    work: jax.Array  # int32 [max_items, _META]: tile, seq, kv block range, pos0, kv_len, num_q, new0
    num_items: jax.Array  # int32 [1]: items in use (a prefix of `work`)
    item_tile: jax.Array  # int32 [max_items]: each item's tile; NT for unused items
    tile_tokens: jax.Array  # int32 [NT, TQ]: flat token of each tile slot; T where empty
    token_row: jax.Array  # int32 [T]: the token's slot in the flattened [NT * TQ] tiles
    token_valid: jax.Array  # bool [T]: False for padding tokens
    # int32 [NT, max_splits], batch-invariant plans only (else None): the item of each of a
    # tile's splits in kv order; max_items past the tile's last split.
    split_item: jax.Array | None
    config: TuningConfig  # static: the tiles this plan was cut for
    sliding_window: int | None  # static


jax.tree_util.register_dataclass(
    WorkPlan,
    data_fields=["work", "num_items", "item_tile", "tile_tokens", "token_row", "token_valid", "split_item"],
    meta_fields=["config", "sliding_window"],
)


class _Items(NamedTuple):
    """A tile's kv blocks cut into work items (a prefix of `max_items` rows in use)."""

    tile: jax.Array  # int32 [max_items]: the item's tile (clamped for unused items)
    blk_begin: jax.Array  # int32 [max_items]
    blk_end: jax.Array  # int32 [max_items]: == blk_begin for unused items
    valid: jax.Array  # bool [max_items]
    num_items: jax.Array  # int32 []
    split_item: jax.Array | None  # see WorkPlan


def _searchsorted_right(sorted_ends, values):
    """jnp.searchsorted(side="right") as one fused compare-and-count (no loop on the GPU)."""
    return jnp.sum(values[:, None] >= sorted_ends[None, :], axis=1, dtype=jnp.int32)


def plan_work(
    kv_lens,
    query_start_loc,
    *,
    num_tokens: int,
    num_kv_heads: int,
    config: TuningConfig,
    sliding_window: int | None = None,
    max_context: int | None = None,
) -> WorkPlan:
    """Query tiles of every sequence and the flash-decoding work items over their kv blocks.

    `max_context` (static: block_tables' width times page_size) bounds a sequence's context;
    a batch-invariant config needs it to size the work list.
    """
    if config.batch_invariant and max_context is None:
        raise ValueError("a batch-invariant plan needs max_context (max_pages * page_size)")
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    num_seqs = kv_lens.shape[0]
    tq, bkv = config.query_tile, config.block_kv

    # -- query tiles -----------------------------------------------------------------
    q_lens = qsl[1:] - qsl[:-1]  # [S]
    tiles_per_seq = (q_lens + tq - 1) // tq
    tile_end = jnp.cumsum(tiles_per_seq)
    num_tiles = max_tiles(num_tokens, num_seqs, tq)
    ids = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = _searchsorted_right(tile_end, ids)  # == S for spare tiles
    tile_valid = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    first_q = (ids - (tile_end[seq] - tiles_per_seq[seq])) * tq  # offset in the sequence's new tokens
    num_q = jnp.where(tile_valid, jnp.clip(q_lens[seq] - first_q, 0, tq), 0)
    new0 = kv_lens[seq] - q_lens[seq]  # context position of the sequence's first new token
    pos0 = new0 + first_q  # context position of the tile's first token
    slot = jnp.arange(tq, dtype=jnp.int32)
    tile_tokens = jnp.where(slot < num_q[:, None], (qsl[seq] + first_q)[:, None] + slot, num_tokens)

    # -- kv blocks each tile needs, split into items ------------------------------------
    key_end = jnp.where(num_q > 0, pos0 + num_q, 0)  # causal: through the last query
    key_begin = jnp.zeros_like(key_end) if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    blk_begin = key_begin // bkv
    num_blocks = jnp.where(key_end > 0, (key_end + bkv - 1) // bkv - blk_begin, 0)  # [NT]

    if config.batch_invariant:
        items = _fixed_splits(blk_begin, num_blocks, config, max_splits(config, max_context, sliding_window))
    else:
        items = _even_splits(blk_begin, num_blocks, num_kv_heads, config)
    tile = items.tile
    fields = [tile, seq[tile], items.blk_begin, items.blk_end, pos0[tile], kv_lens[seq[tile]], num_q[tile], new0[tile]]
    work = jnp.stack(fields, axis=1)

    # -- where each flat token's output row lives ------------------------------------
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    token_seq = jnp.minimum(_searchsorted_right(qsl[1:], token), num_seqs - 1)
    offset = token - qsl[token_seq]
    token_tile = tile_end[token_seq] - tiles_per_seq[token_seq] + offset // tq
    return WorkPlan(
        work=work.astype(jnp.int32),
        num_items=items.num_items.astype(jnp.int32).reshape(1),
        item_tile=jnp.where(items.valid, tile, num_tiles).astype(jnp.int32),
        tile_tokens=tile_tokens.astype(jnp.int32),
        token_row=(token_tile * tq + offset % tq).astype(jnp.int32),
        token_valid=token < qsl[-1],
        split_item=items.split_item,
        config=config,
        sliding_window=sliding_window,
    )


def _even_splits(blk_begin, num_blocks, num_kv_heads: int, config: TuningConfig) -> _Items:
    """Each tile's blocks split evenly into items of at most `_split_chunk` blocks (picked
    from the whole step's work)."""
    num_tiles = blk_begin.shape[0]
    chunk = _split_chunk(num_blocks, num_kv_heads, config)
    # sum(cdiv(n, chunk)) <= sum(n) / chunk + NT, and chunk >= sum(n) * KV / (ctas * max_waves)
    max_items = num_tiles + -(-config.num_ctas * config.max_waves // num_kv_heads)
    splits = (num_blocks + chunk - 1) // chunk  # [NT]
    item_end = jnp.cumsum(splits)
    num_items = item_end[-1]

    item = jnp.arange(max_items, dtype=jnp.int32)
    item_valid = item < num_items
    tile = jnp.minimum(_searchsorted_right(item_end, item), num_tiles - 1)
    part = item - (item_end[tile] - splits[tile])
    n, k = num_blocks[tile], jnp.maximum(splits[tile], 1)
    b0 = blk_begin[tile] + part * n // k  # an even split of the tile's blocks
    b1 = jnp.where(item_valid, blk_begin[tile] + (part + 1) * n // k, b0)
    return _Items(tile, b0, b1, item_valid, num_items, None)


def max_splits(config: TuningConfig, max_context: int, sliding_window: int | None = None) -> int:
    """Most fixed splits (`config.split_blocks` blocks at absolute boundaries) one tile can touch.

    A tile's keys run from its first visible key to its last query: from key 0 (at most
    max_context keys), or under a window at most window + query_tile - 1 keys starting anywhere.
    """
    bkv, c = config.block_kv, config.split_blocks
    blocks = -(-max_context // bkv)
    splits = -(-blocks // c)  # blocks [0, n) meet cdiv(n, c) splits
    if sliding_window is not None:
        keys = sliding_window + config.query_tile - 1
        blocks = -(-(keys - 1) // bkv) + 1  # keys [a, a + keys) meet this many blocks at most
        splits = min(splits, -(-(blocks - 1) // c) + 1)
    return max(1, splits)


def _fixed_splits(blk_begin, num_blocks, config: TuningConfig, splits_bound: int) -> _Items:
    """Batch-invariant items: split j covers blocks [j * c, (j + 1) * c) of the context,
    clipped to the tile's own range, c = config.split_blocks whatever the step.

        tile's blocks:        [b_lo ..................... b_hi)
        fixed splits:   | j*c        | (j+1)*c      | (j+2)*c      |
        items:                [b_lo, (j+1)*c), [.., (j+2)*c), [.., b_hi)

    Items are listed tile by tile, splits in kv order; `split_item` maps each tile's k-th
    split back to its item, the fixed order in which `_combine_in_split_order` folds them.
    """
    num_tiles, c = blk_begin.shape[0], config.split_blocks
    blk_end = blk_begin + num_blocks
    first = blk_begin // c
    splits = jnp.where(num_blocks > 0, (blk_end + c - 1) // c - first, 0)  # [NT], <= splits_bound
    item_end = jnp.cumsum(splits)
    item_begin = item_end - splits
    max_items = num_tiles * splits_bound

    item = jnp.arange(max_items, dtype=jnp.int32)
    item_valid = item < item_end[-1]
    tile = jnp.minimum(_searchsorted_right(item_end, item), num_tiles - 1)
    j = first[tile] + item - item_begin[tile]  # the absolute split
    b0 = jnp.maximum(j * c, blk_begin[tile])
    b1 = jnp.where(item_valid, jnp.minimum((j + 1) * c, blk_end[tile]), b0)
    k = jnp.arange(splits_bound, dtype=jnp.int32)
    split_item = jnp.where(k < splits[:, None], item_begin[:, None] + k, max_items).astype(jnp.int32)
    return _Items(tile, b0, b1, item_valid, item_end[-1], split_item)


_UNIT_OVERHEAD_BLOCKS = 0.5  # a unit's fixed cost (queries in, result out), in kv blocks


def _split_chunk(num_blocks, num_kv_heads: int, config: TuningConfig):
    """Most kv blocks per work item: the candidate with the least estimated makespan.

    Units (item x KV head) go round-robin to the CTAs, so a schedule takes about
    ceil(units / ctas) rounds of its longest unit. Candidates aim at 1, 2, 3, 4, 6, 8
    (up to max_waves) units per CTA; ties go to fewer splits.
    """
    waves = [w for w in (1, 2, 3, 4, 6, 8) if w <= config.max_waves] or [config.max_waves]
    work = jnp.sum(num_blocks) * num_kv_heads  # block loads in all
    per_round = jnp.asarray([config.num_ctas * w for w in waves], jnp.int32)
    chunk = jnp.maximum(config.min_split_blocks, (work + per_round - 1) // per_round)  # [W]
    splits = (num_blocks[None, :] + chunk[:, None] - 1) // chunk[:, None]  # [W, NT]
    longest = jnp.max(-(-num_blocks[None, :] // jnp.maximum(splits, 1)), axis=1)  # even splits
    rounds = (jnp.sum(splits, axis=1) * num_kv_heads + config.num_ctas - 1) // config.num_ctas
    cost = rounds * (longest + _UNIT_OVERHEAD_BLOCKS)
    return chunk[jnp.argmin(cost)]


def _gather_query_tiles(q, tile_tokens, num_kv_heads: int, rows: int, pad_rows: int):
    """q [T, H, D] -> [NT * rows + pad_rows, KV * D]: row tile * rows + t * G + g."""
    num_tokens, num_heads, head_dim = q.shape
    num_tiles, tq = tile_tokens.shape
    groups = num_heads // num_kv_heads
    x = jnp.take(q, jnp.minimum(tile_tokens, num_tokens - 1).reshape(-1), axis=0)  # [NT*TQ, H, D]
    x = jnp.where((tile_tokens < num_tokens).reshape(-1, 1, 1), x, 0)
    x = x.reshape(num_tiles, tq, num_kv_heads, groups, head_dim).transpose(0, 1, 3, 2, 4)
    x = x.reshape(num_tiles, tq * groups, num_kv_heads * head_dim)
    x = jnp.pad(x, ((0, 0), (0, rows - tq * groups), (0, 0))).reshape(num_tiles * rows, -1)
    return jnp.pad(x, ((0, pad_rows), (0, 0)))  # a 64-row box of the last tile stays in bounds


# ------------------------------------------------------------------------------------
# 2. Kernel.
# ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Shapes:
    dtype: jnp.dtype  # of q, the output and every wgmma operand
    kv_dtype: jnp.dtype  # of the pages: dtype, or e4m3 / int8 (then with scales)
    num_kv_heads: int
    head_dim: int
    page_size: int
    groups: int
    rows: int  # rows per tile in the gathered query / partial output layouts
    max_items: int
    max_pages: int


def _build_kernel(
    cfg: TuningConfig,
    shp: _Shapes,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    tree_words: int,
    interpret,
):
    nwg, bkv, stages, num_ctas = cfg.num_compute_wgs, cfg.block_kv, cfg.max_concurrent_steps, cfg.num_ctas
    kv_heads, dim, page_size, groups, rows = shp.num_kv_heads, shp.head_dim, shp.page_size, shp.groups, shp.rows
    pages_per_block = bkv // page_size
    wg_rows = [min(ROWS_PER_WG, rows - w * ROWS_PER_WG) for w in range(nwg)]  # rows each WG stores
    assert all(r > 0 and r % 8 == 0 for r in wg_rows), (rows, nwg)
    layout, row_layout, col_layout = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    quantized = shp.kv_dtype != shp.dtype
    copies_per_page = 2 if quantized else 1  # the 8-bit page and its scales
    i32 = jnp.int32
    tree = tree_words > 0

    # -- the persistent loop over (item, kv head) units --------------------------------

    def num_units(num_items_ref):
        """Units of this CTA: sm, sm + num_ctas, ... below num_items * KV."""
        left = num_items_ref[0] * kv_heads - lax.axis_index("sm")
        return lax.div(jnp.maximum(left + num_ctas - 1, 0), i32(num_ctas))

    def unit(work_ref, n):
        """The n-th unit of this CTA: its kv head and its item's fields."""
        u = lax.axis_index("sm") + n * num_ctas
        item = lax.div(u, i32(kv_heads))
        names = (_TILE, _SEQ, _BLK_BEGIN, _BLK_END, _POS0, _KV_LEN, _NUM_Q) + ((_NEW0,) if tree else ())
        fields = {f: work_ref[item, f] for f in names}
        return item, lax.rem(u, i32(kv_heads)), fields

    # -- memory warpgroup ------------------------------------------------------------

    def memory_wg(
        work_ref,
        num_items_ref,
        tables_ref,
        k_ref,
        v_ref,
        ks_ref,
        vs_ref,
        k_smem,
        v_smem,
        ks_smem,
        vs_smem,
        k_full,
        v_full,
        k_free,
        v_free,
    ):
        def step_body(j, step0, head, f):
            step = step0 + j
            slot = lax.rem(step, i32(stages))
            blk = f[_BLK_BEGIN] + j
            # Page ids first: their loads overlap the wait for a free slot.
            index = [blk * pages_per_block + p for p in range(pages_per_block)]
            pages = [tables_ref[f[_SEQ], jnp.minimum(i, shp.max_pages - 1)] for i in index]
            for src, dst, src_s, dst_s, full, free in (
                (k_ref, k_smem, ks_ref, ks_smem, k_full, k_free),
                (v_ref, v_smem, vs_ref, vs_smem, v_full, v_free),
            ):

                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])  # the slot's previous block is consumed

                for p, (i, page) in enumerate(zip(index, pages)):
                    live = i * page_size < f[_KV_LEN]

                    @pl.when(live)
                    def _():
                        plgpu.copy_gmem_to_smem(
                            src.at[pl.ds(page * page_size, page_size), pl.ds(head * dim, dim)],
                            dst.at[slot, pl.ds(p * page_size, page_size)],
                            full.at[slot],
                        )
                        if quantized:  # the page's scales of this head: page_size contiguous floats
                            plgpu.copy_gmem_to_smem(
                                src_s.at[page, pl.ds(head * page_size, page_size)],
                                dst_s.at[slot, pl.ds(p * page_size, page_size)],
                                full.at[slot],
                            )

                    # A page wholly past the context is not read (its rows get masked and
                    # zeroed); arriving keeps the barrier's count at one per copy.
                    @pl.when(~live)
                    def _():
                        for _ in range(copies_per_page):
                            plgpu.barrier_arrive(full.at[slot])

        def unit_body(n, step0):
            _, head, f = unit(work_ref, n)
            num_steps = f[_BLK_END] - f[_BLK_BEGIN]
            lax.fori_loop(0, num_steps, lambda j, c: step_body(j, step0, head, f), None)
            return step0 + num_steps

        total = lax.fori_loop(0, num_units(num_items_ref), unit_body, i32(0))
        # Observe the last frees too, so no barrier completion is left unawaited.
        for k in range(stages):
            step = total - stages + k

            @pl.when(step >= 0)
            def _():
                slot = lax.rem(step, i32(stages))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

    # -- compute warpgroups ----------------------------------------------------------

    # Logits in base-2 units are s * log2_scale; without a soft-cap the multiply is left
    # to the exp2 argument, where it fuses into one FMA with the max subtraction.
    log2_scale = sm_scale * _LOG2E if soft_cap is None else soft_cap * _LOG2E

    def soft_capped(s):
        """Raw q.k -> cap * tanh(q.k * scale / cap) / cap: times log2_scale, the base-2 logit."""
        return s if soft_cap is None else jnp.tanh(s * (sm_scale / soft_cap))

    def needs_mask(blk, f, wg):
        """Whether some key of the block is invisible to some query row of this WG."""
        first_row = wg * ROWS_PER_WG
        last_row = jnp.minimum(first_row + ROWS_PER_WG, f[_NUM_Q] * groups) - 1
        lo_pos, hi_pos = f[_POS0] + lax.div(first_row, i32(groups)), f[_POS0] + lax.div(last_row, i32(groups))
        lo_key, hi_key = blk * bkv, blk * bkv + bkv - 1
        mask = (hi_key > lo_pos) | (hi_key >= f[_KV_LEN]) | (last_row < first_row)
        if sliding_window is not None:
            mask |= lo_key <= hi_pos - sliding_window
        return mask

    def apply_mask(s, blk, f, wg):
        row = plgpu.broadcasted_iota(i32, s.shape, 0, layout=layout) + wg * ROWS_PER_WG
        key = plgpu.broadcasted_iota(i32, s.shape, 1, layout=layout) + blk * bkv
        q_pos = f[_POS0] + (lax.div(row, i32(groups)) if groups > 1 else row)
        visible = (key <= q_pos) & (key < f[_KV_LEN])
        if sliding_window is not None:
            visible &= key > q_pos - sliding_window
        return jnp.where(visible, s, -jnp.inf)

    def holds_tree(blk, f):
        """Whether the block holds some of the sequence's first 32 W new tokens (the tree's)."""
        return (blk * bkv + bkv > f[_NEW0]) & (blk * bkv < f[_NEW0] + 32 * tree_words)

    def apply_tree_mask(s, blk, f, words):
        """Hide new token j < 32 W from the rows whose words (`words`: W of [64] int32) lack
        bit j % 32 in word j // 32."""
        key = plgpu.broadcasted_iota(i32, s.shape, 1, layout=layout) + blk * bkv
        j = key - f[_NEW0]  # offset among the sequence's new tokens
        word = lax.broadcast_in_dim(words[0], s.shape, [0])
        for w in range(1, tree_words):  # each key's word (j >> 5 of a negative j matches none)
            word = jnp.where(lax.shift_right_logical(j, 5) == w, lax.broadcast_in_dim(words[w], s.shape, [0]), word)
        bit = lax.shift_right_logical(word, j & 31) & 1  # j & 31: in range
        visible = (j < 0) | (j >= 32 * tree_words) | (bit != 0)
        return jnp.where(visible, s, -jnp.inf)

    def upcast(src, dst, num_valid=None):
        """8-bit [bkv, D] block in smem -> q's dtype in `dst` (exact: e4m3 and int8 values
        are all bf16 / f16 numbers), rows >= num_valid zeroed (they may be NaN or garbage)."""
        for c in range(bkv // ROWS_PER_WG):
            chunk = pl.ds(c * ROWS_PER_WG, ROWS_PER_WG)
            x = plgpu.load(src.at[chunk], layout=layout)
            if shp.kv_dtype == jnp.uint8:  # e4m3 bit patterns
                x = lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
            if shp.kv_dtype in (jnp.uint8, jnp.float8_e4m3fn) and shp.dtype != jnp.float16:
                # Hopper converts e4m3 pairs to f16 only (also exact); bf16 via f32.
                x = x.astype(jnp.float16).astype(jnp.float32)
            x = x.astype(shp.dtype)
            if num_valid is not None:
                row = plgpu.broadcasted_iota(i32, x.shape, 0, layout=layout) + c * ROWS_PER_WG
                x = jnp.where(row < num_valid, x, jnp.zeros_like(x))
            dst.at[chunk][...] = x

    def zero_tail(v_slot, num_valid):
        """Zero rows >= num_valid of a V block: past the context they may hold NaN."""
        for c in range(bkv // ROWS_PER_WG):

            @pl.when(num_valid < (c + 1) * ROWS_PER_WG)
            def _():
                chunk = v_slot.at[pl.ds(c * ROWS_PER_WG, ROWS_PER_WG)]
                v = plgpu.load(chunk, layout=layout)
                row = plgpu.broadcasted_iota(i32, v.shape, 0, layout=layout) + c * ROWS_PER_WG
                chunk[...] = jnp.where(row < num_valid, v, jnp.zeros_like(v))

    def compute_wg(
        work_ref,
        num_items_ref,
        q_ref,
        tree_ref,
        o_ref,
        lse_ref,
        qo_smem,
        k_smem,
        v_smem,
        ks_smem,
        vs_smem,
        up_smem,
        lse_smem,
        tree_smem,
        p_smem,
        q_bar,
        k_full,
        v_full,
        k_free,
        v_free,
        tail_bar,
    ):
        wg = lax.axis_index("wg")
        my_units = num_units(num_items_ref)

        def load_q(n):
            """Start the TMA of unit n's query rows into buffer n % 2."""
            _, head, f = unit(work_ref, n)
            buf = lax.rem(n, i32(2))
            q_rows = pl.ds(f[_TILE] * rows + wg * ROWS_PER_WG, ROWS_PER_WG)
            plgpu.copy_gmem_to_smem(q_ref.at[q_rows, pl.ds(head * dim, dim)], qo_smem.at[buf, wg], q_bar.at[buf, wg])
            for w in range(tree_words):  # the same rows' tree words, on the same barrier
                plgpu.copy_gmem_to_smem(tree_ref.at[w, q_rows], tree_smem.at[buf, wg, w], q_bar.at[buf, wg])

        def step_body(j, carry, step0, qo, f, words):
            acc, m, l = carry  # [64, D] f32, [64] f32 (base-2 running max), [64] f32
            step = step0 + j
            slot = lax.rem(step, i32(stages))
            blk = f[_BLK_BEGIN] + j

            plgpu.barrier_wait(k_full.at[slot])
            if quantized:  # upcast into this WG's buffer; the slot is free once read
                k_scale = plgpu.load(ks_smem.at[slot], layout=col_layout)  # [bkv]
                upcast(k_smem.at[slot], up)
                # NOTE: the fence (for wgmma's reads of `up`) also orders our generic-proxy
                # reads of the slot before the next TMA (async proxy) write into it.
                plgpu.commit_smem()
                plgpu.barrier_arrive(k_free.at[slot])
                k_operand = up
            else:
                k_operand = k_smem.at[slot]

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, qo, k_operand.transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((ROWS_PER_WG, bkv), jnp.float32))
            if quantized:
                # One scale per key: S = (Q Kq^T) * k_scale, columnwise. Scales past the
                # context may be NaN; those columns are masked below by a select.
                s = s * lax.broadcast_in_dim(k_scale, s.shape, [1])
            else:
                plgpu.barrier_arrive(k_free.at[slot])

            s = soft_capped(s)
            s = lax.cond(needs_mask(blk, f, wg), lambda x: apply_mask(x, blk, f, wg), lambda x: x, s)
            if tree:
                s = lax.cond(holds_tree(blk, f), lambda x: apply_tree_mask(x, blk, f, words), lambda x: x, s)
            m_new = jnp.maximum(m, s.max(axis=1) * log2_scale)
            alpha = jnp.exp2(m - m_new)
            if cfg.batch_invariant:
                # Exactly 1 when the max stays, whatever ex2.approx(0) gives: a block wholly
                # masked for a row must leave its state bit for bit (module docstring).
                alpha = jnp.where(m_new == m, jnp.ones_like(alpha), alpha)
            p = jnp.exp2(s * log2_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)

            def p_operand_of(p):
                """P in q's dtype: from registers, or staged in smem (to be fenced)."""
                if p_smem is None:
                    return p.astype(shp.dtype)
                p_smem.at[wg][...] = p.astype(shp.dtype)
                return p_smem.at[wg]

            if not quantized:
                p_operand = p_operand_of(p)
                if p_smem is not None:
                    plgpu.commit_smem()

            plgpu.barrier_wait(v_full.at[slot])
            num_valid = f[_KV_LEN] - blk * bkv
            if quantized:
                # O += (P * v_scale) Vq: one scale per key, zeroed past the context (where
                # it may be NaN and P is 0). Each WG zeroes the tail in its own copy.
                v_scale = plgpu.load(vs_smem.at[slot], layout=col_layout)  # [bkv]
                key = plgpu.broadcasted_iota(i32, (bkv,), 0, layout=col_layout)
                v_scale = jnp.where(key < num_valid, v_scale, jnp.zeros_like(v_scale))
                p = p * lax.broadcast_in_dim(v_scale, p.shape, [1])
                p_operand = p_operand_of(p)
                pl.when(num_valid < bkv)(lambda: upcast(v_smem.at[slot], up, num_valid))
                pl.when(num_valid >= bkv)(lambda: upcast(v_smem.at[slot], up))
                plgpu.commit_smem()  # as for K: for wgmma, and before the slot is refilled
                plgpu.barrier_arrive(v_free.at[slot])
                v_operand = up
            else:

                @pl.when(num_valid < bkv)
                def _():
                    # The first compute WG cleans the block's tail; every compute WG waits for it.
                    @pl.when(wg == 0)
                    def _():
                        zero_tail(v_smem.at[slot], num_valid)
                        plgpu.commit_smem()

                    plgpu.barrier_arrive(tail_bar)
                    plgpu.barrier_wait(tail_bar)

                v_operand = v_smem.at[slot]

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_operand, v_operand)
                return acc_ref[...]

            # A fresh accumulator, folded in with the rescale's multiply as one FMA;
            # unlike pl.run_state this also runs in the interpreter.
            pv_out = pl.run_scoped(pv, plgpu.ACC((ROWS_PER_WG, dim), jnp.float32))
            if not quantized:
                plgpu.barrier_arrive(v_free.at[slot])
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv_out
            return acc, m_new, l

        up = up_smem.at[wg] if quantized else None  # [bkv, D]: this WG's upcast K, then V

        def unit_body(n, step0):
            item, head, f = unit(work_ref, n)
            buf = lax.rem(n, i32(2))
            qo = qo_smem.at[buf, wg]  # [64, D]: this unit's query rows, later its output rows
            plgpu.barrier_wait(q_bar.at[buf, wg])
            # W of [64] int32: each row's tree words, read before load_q(n + 2) refills the buffer.
            words = [plgpu.load(tree_smem.at[buf, wg, w], layout=row_layout) for w in range(tree_words)]

            # The other buffer held unit n - 1's output, already read by its store.
            @pl.when(n + 1 < my_units)
            def _():
                load_q(n + 1)

            init = (
                plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, dim), jnp.float32), layout),
                plgpu.layout_cast(jnp.full((ROWS_PER_WG,), _NEG_BIG, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.zeros((ROWS_PER_WG,), jnp.float32), row_layout),
            )
            num_steps = f[_BLK_END] - f[_BLK_BEGIN]
            acc, m, l = lax.fori_loop(0, num_steps, lambda j, c: step_body(j, c, step0, qo, f, words), init)

            # Rows that saw no key (l == 0) give o = 0 and lse = -inf.
            acc = acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])
            qo[...] = acc.astype(shp.dtype)
            lse_smem.at[wg][...] = m + jnp.log(l) * (1 / math.log(2))
            plgpu.commit_smem()
            for w in range(nwg):  # each WG stores a static number of rows

                @pl.when(wg == w)
                def _():
                    out_rows = pl.ds(item * rows + w * ROWS_PER_WG, wg_rows[w])
                    plgpu.copy_smem_to_gmem(qo.at[pl.ds(0, wg_rows[w])], o_ref.at[out_rows, pl.ds(head * dim, dim)])
                    plgpu.copy_smem_to_gmem(lse_smem.at[w, pl.ds(0, wg_rows[w])], lse_ref.at[head, out_rows])

            # Before qo (the next unit's Q buffer after next) and lse_smem are reused.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            return step0 + num_steps

        @pl.when(my_units > 0)
        def _():
            load_q(0)

        lax.fori_loop(0, my_units, unit_body, i32(0))
        plgpu.wait_smem_to_gmem(0)

    def body(*refs):
        # Inputs (the optional ones as passed by the entry point), outputs, scratch.
        work_ref, num_items_ref, tables_ref, q_ref, *refs = refs
        tree_ref = refs.pop(0) if tree else None
        k_ref, v_ref, *refs = refs
        ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if quantized else (None, None)
        o_ref, lse_ref, *scratch = refs
        (
            qo_smem,
            k_smem,
            v_smem,
            ks_smem,
            vs_smem,
            up_smem,
            lse_smem,
            tree_smem,
            p_smem,
            q_bar,
            k_full,
            v_full,
            k_free,
            v_free,
            tail_bar,
        ) = scratch
        wg = lax.axis_index("wg")

        @pl.when(wg < nwg)
        def _():
            if nwg == 2:
                plgpu.set_max_registers(COMPUTE_WG_REGISTERS, action="increase")
            compute_wg(
                work_ref,
                num_items_ref,
                q_ref,
                tree_ref,
                o_ref,
                lse_ref,
                qo_smem,
                k_smem,
                v_smem,
                ks_smem,
                vs_smem,
                up_smem,
                lse_smem,
                tree_smem,
                p_smem,
                q_bar,
                k_full,
                v_full,
                k_free,
                v_free,
                tail_bar,
            )

        @pl.when(wg == nwg)
        def _():
            if nwg == 2:
                plgpu.set_max_registers(MEMORY_WG_REGISTERS, action="decrease")
            memory_wg(
                work_ref,
                num_items_ref,
                tables_ref,
                k_ref,
                v_ref,
                ks_ref,
                vs_ref,
                k_smem,
                v_smem,
                ks_smem,
                vs_smem,
                k_full,
                v_full,
                k_free,
                v_free,
            )

    tiled = (plgpu.TilingTransform((8, _SWIZZLE // shp.dtype.itemsize)), plgpu.SwizzleTransform(_SWIZZLE))
    # An 8-bit [bkv, 64] block has 64-byte rows: a 64-byte swizzle.
    kv_swizzle = min(_SWIZZLE, dim * shp.kv_dtype.itemsize)
    kv_tiled = (plgpu.TilingTransform((8, kv_swizzle // shp.kv_dtype.itemsize)), plgpu.SwizzleTransform(kv_swizzle))
    out_type = (
        jax.ShapeDtypeStruct((shp.max_items * rows, kv_heads * dim), shp.dtype),  # partial O / l
        jax.ShapeDtypeStruct((kv_heads, shp.max_items * rows), jnp.float32),  # base-2 log-sum-exp
    )
    scratch = [
        plgpu.SMEM((2, nwg, ROWS_PER_WG, dim), shp.dtype, transforms=tiled),  # Q, then O
        plgpu.SMEM((stages, bkv, dim), shp.kv_dtype, transforms=kv_tiled),  # K ring
        plgpu.SMEM((stages, bkv, dim), shp.kv_dtype, transforms=kv_tiled),  # V ring
        plgpu.SMEM((stages, bkv), jnp.float32) if quantized else None,  # K scales ring
        plgpu.SMEM((stages, bkv), jnp.float32) if quantized else None,  # V scales ring
        plgpu.SMEM((nwg, bkv, dim), shp.dtype, transforms=tiled) if quantized else None,  # upcast K / V
        plgpu.SMEM((nwg, ROWS_PER_WG), jnp.float32),  # log-sum-exp
        plgpu.SMEM((2, nwg, tree_words, ROWS_PER_WG), jnp.int32) if tree else None,  # tree words, buffered as Q
        plgpu.SMEM((nwg, ROWS_PER_WG, bkv), shp.dtype, transforms=tiled) if cfg.p_via_smem else None,
        plgpu.Barrier(num_arrivals=1 + tree_words, num_barriers=(2, nwg)),  # Q (+ tree words) landed
        plgpu.Barrier(num_arrivals=pages_per_block * copies_per_page, num_barriers=stages),  # K slot full
        plgpu.Barrier(num_arrivals=pages_per_block * copies_per_page, num_barriers=stages),  # V slot full
        plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),  # K slot free
        plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),  # V slot free
        plgpu.Barrier(num_arrivals=nwg),  # V tail zeroed
    ]
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_ctas,),
        grid_names=("sm",),
        num_threads=nwg + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
            reduction_scratch_bytes=_REDUCTION_SCRATCH,
        ),
        interpret=interpret,
    )


# ------------------------------------------------------------------------------------
# 3. Combine, and the entry point.
# ------------------------------------------------------------------------------------


def _combine(o_part, lse, plan: WorkPlan, rows: int, num_kv_heads: int, head_dim: int):
    """Merge each tile's partial results by their log-sum-exps -> [NT, rows, KV, D] f32."""
    num_tiles = plan.tile_tokens.shape[0]
    max_items = plan.item_tile.shape[0]
    o = o_part.reshape(max_items, rows, num_kv_heads, head_dim).astype(jnp.float32)
    lse = lse.reshape(num_kv_heads, max_items, rows).transpose(1, 2, 0)  # [I, rows, KV]
    # Unused items point at segment NT and are dropped (their rows were never written).
    m = jax.ops.segment_max(lse, plan.item_tile, num_segments=num_tiles)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp2(lse - m[jnp.minimum(plan.item_tile, num_tiles - 1)])[..., None]
    sums = jax.ops.segment_sum(jnp.concatenate([w * o, w], axis=-1), plan.item_tile, num_segments=num_tiles)
    num, den = sums[..., :head_dim], sums[..., head_dim:]
    return num / jnp.where(den > 0, den, 1.0)


def _combine_in_split_order(o_part, lse, plan: WorkPlan, rows: int, num_kv_heads: int, head_dim: int):
    """`_combine` for batch-invariant plans: each tile's splits folded in kv order with
    elementwise ops only (no reduction whose order a backend picks) -> [NT, rows, KV, D] f32.

    A split the tile does not have, or one wholly masked for a row (lse = -inf), adds
    exactly +0 to sums that start at +0 and so are never -0: it changes no bit.
    """
    max_items = plan.item_tile.shape[0]
    o = o_part.reshape(max_items, rows, num_kv_heads, head_dim)
    lse = lse.reshape(num_kv_heads, max_items, rows).transpose(1, 2, 0)  # [I, rows, KV]
    has_split = plan.split_item < max_items  # [NT, S]; the rows of other items were never written
    item = jnp.minimum(plan.split_item, max_items - 1)
    lse = jnp.where(has_split[..., None, None], lse[item], -jnp.inf)  # [NT, S, rows, KV]
    m = jnp.max(lse, axis=1)  # a max is exact in any order
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    num = jnp.zeros((*m.shape, head_dim), jnp.float32)
    den = jnp.zeros((*m.shape, 1), jnp.float32)
    for k in range(item.shape[1]):
        w = jnp.exp2(lse[:, k] - m)[..., None]
        o_k = jnp.where(has_split[:, k, None, None, None], o[item[:, k]].astype(jnp.float32), 0.0)
        num, den = num + w * o_k, den + w
    return num / jnp.where(den > 0, den, 1.0)


def _tiles_to_tokens(out_tiles, plan: WorkPlan, groups: int, dtype):
    """[NT, rows, KV, D] tile rows -> [T, H, D] in flat token order (padding tokens 0)."""
    num_tiles, _, num_kv_heads, head_dim = out_tiles.shape
    tq = plan.tile_tokens.shape[1]
    x = out_tiles[:, : tq * groups].reshape(num_tiles, tq, groups, num_kv_heads, head_dim)
    x = x.transpose(0, 1, 3, 2, 4).reshape(num_tiles * tq, num_kv_heads * groups, head_dim)
    out = jnp.take(x, jnp.clip(plan.token_row, 0, num_tiles * tq - 1), axis=0)
    return jnp.where(plan.token_valid[:, None, None], out, 0).astype(dtype)


def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # int32 [S]
    block_tables: jax.Array,  # int32 [S, max_pages]
    query_start_loc: jax.Array,  # int32 [S + 1]
    *,
    k_scales: jax.Array | None = None,  # float32 [num_pages, num_kv_heads, page_size] (8-bit pages)
    v_scales: jax.Array | None = None,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    query_tile: int | None = None,
    kv_chunk_pages: int | None = None,
    config: TuningConfig | None = None,
    plan: WorkPlan | None = None,
    tree_mask: jax.Array | None = None,  # int32 [T, W] or [T]: tree mask words a token (see the reference)
    batch_invariant: bool = False,
    interpret=None,
) -> jax.Array:  # [T, num_heads, head_dim]; zeros for tokens past query_start_loc[S]
    """`ragged_paged_attention_reference` on a Hopper GPU (see the module docstring).

    `query_tile` sets the tokens per tile (capped so a tile has at most 128 rows);
    `kv_chunk_pages` is accepted for signature compatibility and ignored (the kv step
    is `config.block_kv`). `plan` (from `plan_work`, e.g. once per step for all layers)
    saves recomputing the work list; it carries its config. `interpret=True` or a
    `plgpu.InterpretGPUParams` runs the Mosaic GPU interpreter instead of a GPU.
    With `k_scales` and `v_scales` the pages are an 8-bit cache (`quantized_kv`),
    dequantized inside the kernel. `tree_mask` limits which of its sequence's first 32 W
    new tokens each token sees, as in `ragged_paged_attention_reference`.
    `batch_invariant` makes a token's output bits independent of the rest of the call
    (module docstring); a given `config` or `plan` must then be batch-invariant itself.
    """
    del kv_chunk_pages
    tree_words = 0
    if tree_mask is not None:
        tree_mask = jnp.asarray(tree_mask)
        tree_words = math.prod(tree_mask.shape[1:])
    optional = dict(k_scales=k_scales, v_scales=v_scales, tree_mask=tree_mask)
    if (reason := unsupported_reason(q, k_pages, v_pages, **optional)) is not None:
        raise NotImplementedError(f"ragged_paged_attention (Mosaic GPU): {reason}")
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, max_pages = block_tables.shape
    groups = num_heads // num_kv_heads
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    if plan is not None:
        if plan.sliding_window != sliding_window:
            raise ValueError(f"{plan.sliding_window=} != {sliding_window=}")
        config = plan.config
    elif config is None:
        config = default_config(
            num_tokens,
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            page_size,
            query_tile=query_tile,
            p_via_smem=bool(interpret),
            kv_dtype=k_pages.dtype,
            tree_words=tree_words,
            batch_invariant=batch_invariant,
        )
    elif query_tile is not None:
        config = config.with_query_tile(query_tile, groups)
    if batch_invariant and not config.batch_invariant:
        raise ValueError("batch_invariant=True needs a batch-invariant config / plan (TuningConfig.batch_invariant)")
    max_context = max_pages * page_size
    if plan is not None and config.batch_invariant:
        if plan.split_item.shape[1] < (need := max_splits(config, max_context, sliding_window)):
            raise ValueError(f"the plan has {plan.split_item.shape[1]} splits per tile, these block tables {need}")
    if interpret:  # the interpreter's wgmma takes its A operand from smem only
        config = dataclasses.replace(config, p_via_smem=True)
    if (reason := unsupported_reason(q, k_pages, v_pages, **optional, config=config)) is not None:
        raise NotImplementedError(f"ragged_paged_attention (Mosaic GPU): {reason}")
    if plan is None:
        plan = plan_work(
            kv_lens,
            query_start_loc,
            num_tokens=num_tokens,
            num_kv_heads=num_kv_heads,
            config=config,
            sliding_window=sliding_window,
            max_context=max_context,
        )

    rows = config.rows_per_tile(groups)
    shapes = _Shapes(
        jnp.dtype(q.dtype),
        jnp.dtype(k_pages.dtype),
        num_kv_heads,
        head_dim,
        page_size,
        groups,
        rows,
        plan.work.shape[0],
        max_pages,
    )
    kernel = _build_kernel(
        config,
        shapes,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        tree_words=tree_words,
        interpret=interpret,
    )
    pad_rows = ROWS_PER_WG * config.num_compute_wgs
    q_tiles = _gather_query_tiles(q, plan.tile_tokens, num_kv_heads, rows, pad_rows)
    tree_rows = ()
    # [W, NT * rows + pad_rows]: the words in the query rows' order (a W-wide "query" of G heads).
    # Padding rows get 0: they may see no key at all, which gives o = 0 and lse = -inf, never read.
    if tree_words:
        words = jnp.broadcast_to(tree_mask.reshape(num_tokens, 1, tree_words), (num_tokens, groups, tree_words))
        tree_rows = (_gather_query_tiles(words, plan.tile_tokens, 1, rows, pad_rows).T,)
    # Free reshapes: a page of one KV head is then a rectangular [page_size, D] TMA box.
    k2d = k_pages.reshape(num_pages * page_size, num_kv_heads * head_dim)
    v2d = v_pages.reshape(num_pages * page_size, num_kv_heads * head_dim)
    kv = (k2d, v2d)
    if k_scales is not None:  # [P, KV * page_size]: a page's scales of one KV head are one row slice
        kv += (k_scales.reshape(num_pages, -1), v_scales.reshape(num_pages, -1))
    o_part, lse = kernel(plan.work, plan.num_items, jnp.asarray(block_tables, jnp.int32), q_tiles, *tree_rows, *kv)

    combine = _combine_in_split_order if config.batch_invariant else _combine
    out_tiles = combine(o_part, lse, plan, rows, num_kv_heads, head_dim)
    return _tiles_to_tokens(out_tiles, plan, groups, q.dtype)
