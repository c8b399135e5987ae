"""Ragged paged attention as a Pallas Mosaic GPU kernel (Hopper: TMA, wgmma, warp specialization).

Same signature and semantics as `ragged_paged_attention_reference` (see its module): the
flat token axis holds the new tokens of many sequences (prefill chunks and decode tokens
alike), each attends causally over its own sequence's paged context, optionally limited
to a sliding window and soft-capped. NOTE: the K/V of this step's new tokens must already
be in the pages when this is called (the model writes them first); the kernel only reads
the cache.

The work is cut in three layers; the first and last are plain jnp inside the same jit:

1. Plan (XLA). The tokens of each sequence are cut into query tiles of `query_tile`
   tokens. A tile's rows are its tokens times the G = num_heads / num_kv_heads query
   heads that share one KV head (row = token * G + head_in_group), so a decode step of
   a GQA model still puts G rows into the M dimension of the matmul. Each tile needs
   the keys [first visible, last query position]; those kv blocks (`block_kv` tokens,
   several pages) are split into work items (flash-decoding) when there are too few
   tiles to keep every SM busy: one item per (tile, kv range), at most about
   `num_ctas * waves / num_kv_heads` items beyond one per tile. Items are sorted longest
   first. The queries are gathered into a tile-major layout [tiles * R8, KV * D] (R8 =
   rows per tile rounded up to 8, the TMA/smem tile height) so the kernel can TMA them.

2. Kernel. A persistent grid of `num_ctas` CTAs walks the (item, kv head) work units
   round-robin. Each CTA has `num_compute_wgs` compute warpgroups (64 query rows each)
   and one memory warpgroup. The memory warpgroup reads the block table and issues one
   TMA per page per step for K and for V into a `max_concurrent_steps`-deep ring of
   shared-memory slots ([block_kv, D] each, 128-byte swizzle); pages wholly past the
   context are not copied. The compute warpgroups run S = Q K^T (wgmma from smem),
   scale / soft-cap / mask in registers, an online softmax in base 2, and O += P V
   (wgmma, P from registers), then write O / l (in q's dtype) and the base-2
   log-sum-exp of each row. Barriers: full (TMA -> compute) and free (compute ->
   memory) per slot, so loads of the next item overlap the current one's tail.

3. Combine (XLA). The partial results of a tile's items are merged with their
   log-sum-exps (exact: softmax over the union of key ranges), then the tile rows are
   gathered back to the flat [T, H, D] token order; padding tokens get zeros.

Slots past a sequence's context (the tail of its last page, and pages it does not own)
may hold anything; scores there are masked with a select, and the tail rows of V are
zeroed in shared memory before P V, so NaN garbage cannot leak into the output (the
tests fill them with NaN).

Supported: bf16 / f16, head_dim 64 / 128 / 256 (multiple of 64), page sizes that are
multiples of 8 dividing `block_kv`, any GQA ratio with at most 128 query heads per KV
head. `unsupported_reason` says why a call is not supported; the kernel raises it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ragged_paged_attention import default_query_tile

ROWS_PER_WG = 64  # query rows per compute warpgroup: the M of one wgmma
H100_SMS = 132  # SMs on an H100 / H200 SXM: the default persistent grid
_SMEM_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90
_LOG2E = math.log2(math.e)
_NEG_BIG = -1e30  # finite "no key yet" running max: keeps exp2(m_old - m_new) NaN-free
_SWIZZLE = 128

# Columns of the int32 [max_items, _META] work list the kernel reads.
_TILE, _SEQ, _BLK_BEGIN, _BLK_END, _POS0, _KV_LEN = range(6)
_META = 8


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Tiles and pipeline of the kernel. `default_config` picks one per bucket."""

    block_kv: int = 128  # kv tokens per pipeline step (a whole number of pages)
    max_concurrent_steps: int = 2  # depth of the K/V shared-memory ring
    num_compute_wgs: int = 1  # 64 query rows each; 2 for prefill-sized tiles
    query_tile: int = 1  # tokens per query tile; rows = query_tile * G
    num_ctas: int = H100_SMS  # persistent grid size
    waves: int = 2  # flash-decoding aims at about num_ctas * waves work units
    min_split_blocks: int = 2  # do not split a tile's kv range finer than this
    # P V takes P from registers (as FlashAttention 3) unless this stages P through
    # shared memory; the Mosaic GPU interpreter only supports the latter.
    p_via_smem: bool = False

    def __post_init__(self):
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"{self.block_kv=} must be 64, 128, 192 or 256")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"{self.max_concurrent_steps=} must be at least 2")
        if self.num_compute_wgs not in (1, 2):
            raise ValueError(f"{self.num_compute_wgs=} must be 1 or 2")
        if self.query_tile < 1:
            raise ValueError(f"{self.query_tile=} must be positive")
        if self.num_ctas < 1 or self.waves < 1 or self.min_split_blocks < 1:
            raise ValueError(f"{self.num_ctas=}, {self.waves=} and {self.min_split_blocks=} must be positive")

    def rows_per_tile(self, groups: int) -> int:
        """Query rows of one tile, rounded up to the 8-row smem tile."""
        return -(-self.query_tile * groups // 8) * 8

    def check(self, *, groups: int, page_size: int) -> None:
        """Raise ValueError if this config cannot serve the given head grouping / page size."""
        rows = self.query_tile * groups
        if rows > ROWS_PER_WG * self.num_compute_wgs:
            raise ValueError(
                f"{self.query_tile=} * {groups=} = {rows} query rows exceed "
                f"{ROWS_PER_WG} * {self.num_compute_wgs=}")
        if self.block_kv % page_size:
            raise ValueError(f"{self.block_kv=} must be a multiple of {page_size=}")

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory the kernel allocates (barriers aside)."""
        qo = self.num_compute_wgs * ROWS_PER_WG * head_dim * itemsize
        kv = 2 * self.max_concurrent_steps * self.block_kv * head_dim * itemsize
        lse = self.num_compute_wgs * ROWS_PER_WG * 4
        p = self.num_compute_wgs * ROWS_PER_WG * self.block_kv * itemsize if self.p_via_smem else 0
        return qo + kv + lse + p


def default_config(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, page_size: int, *, num_ctas: int | None = None) -> TuningConfig:
    """A config for a (token, sequence) bucket and model shape.

    Decode-heavy buckets get one-token tiles and one compute warpgroup; prefill-heavy
    ones get tiles of 128 rows (two warpgroups) so each K/V block feeds more queries.
    The K/V ring is as deep as shared memory allows (at most 4 steps).
    """
    groups = num_heads // num_kv_heads
    tq = default_query_tile(num_tokens, num_seqs)
    tq = max(1, min(tq, (2 * ROWS_PER_WG) // groups))
    wgs = 1 if tq * groups <= ROWS_PER_WG else 2
    block_kv = max(128, page_size)
    cfg = TuningConfig(block_kv=block_kv, num_compute_wgs=wgs, query_tile=tq,
                       num_ctas=num_ctas or _device_sm_count())
    steps = 2
    while steps < 4 and dataclasses.replace(cfg, max_concurrent_steps=steps + 1).smem_bytes(head_dim) <= _SMEM_BYTES - 4096:
        steps += 1
    return dataclasses.replace(cfg, max_concurrent_steps=steps)


def _device_sm_count() -> int:
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return H100_SMS
    if device.platform != "gpu":
        return H100_SMS
    return getattr(device, "core_count", None) or H100_SMS


def unsupported_reason(q, k_pages, v_pages=None, *, config: TuningConfig | None = None) -> str | None:
    """Why the kernel cannot run these shapes / dtypes, or None if it can."""
    if q.ndim != 3 or k_pages.ndim != 4:
        return f"expected q [T, H, D] and pages [P, page_size, KV, D], got {q.shape=} {k_pages.shape=}"
    if v_pages is not None and v_pages.shape != k_pages.shape:
        return f"{k_pages.shape=} != {v_pages.shape=}"
    _, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, kv_dim = k_pages.shape
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(k_pages.dtype)} | ({jnp.dtype(v_pages.dtype)} if v_pages is not None else set())
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"only bf16 or f16 q/k/v of one dtype are supported, got {q.dtype=} {k_pages.dtype=}"
    if kv_dim != head_dim:
        return f"{head_dim=} of q != {kv_dim=} of the pages"
    if head_dim % 64 or head_dim > 256:
        return f"{head_dim=} must be a multiple of 64 and at most 256"
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
        if (smem := config.smem_bytes(head_dim)) > _SMEM_BYTES - 1024:
            return f"{config=} needs {smem} bytes of shared memory, more than the {_SMEM_BYTES} available"
    return None


def is_supported(q, k_pages, v_pages=None, *, config: TuningConfig | None = None) -> bool:
    return unsupported_reason(q, k_pages, v_pages, config=config) is None


# ------------------------------------------------------------------------------------
# 1. Plan: query tiles, work items (flash-decoding splits), query gather.
# ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Tiles:
    seq: jax.Array  # int32 [NT]: the tile's sequence (clamped to S - 1 for spare tiles)
    first_q: jax.Array  # int32 [NT]: offset of its first token within the sequence's new tokens
    num_q: jax.Array  # int32 [NT]: tokens in the tile (0 for spare tiles)
    pos0: jax.Array  # int32 [NT]: context position of its first token
    tokens: jax.Array  # int32 [NT, TQ]: flat token index of each slot, T where empty


def _cut_tiles(kv_lens, query_start_loc, num_tokens: int, tq: int) -> _Tiles:
    num_seqs = kv_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    tiles_per_seq = (q_lens + tq - 1) // tq
    tile_end = jnp.cumsum(tiles_per_seq)
    num_tiles = _max_tiles(num_tokens, num_seqs, tq)
    ids = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.searchsorted(tile_end, ids, side="right").astype(jnp.int32)  # == S for spare tiles
    valid = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    first_q = (ids - (tile_end[seq] - tiles_per_seq[seq])) * tq
    num_q = jnp.where(valid, jnp.clip(q_lens[seq] - first_q, 0, tq), 0)
    pos0 = kv_lens[seq] - q_lens[seq] + first_q
    slot = jnp.arange(tq, dtype=jnp.int32)
    tokens = jnp.where(slot[None, :] < num_q[:, None], query_start_loc[seq][:, None] + first_q[:, None] + slot, num_tokens)
    return _Tiles(seq, first_q, num_q, pos0, tokens)


def _max_tiles(num_tokens: int, num_seqs: int, tq: int) -> int:
    """Static bound on sum(cdiv(q_len, tq)) given sum(q_len) <= T over S sequences."""
    return max(1, min(num_tokens, (num_tokens + num_seqs * (tq - 1)) // tq))


def _plan_items(tiles: _Tiles, kv_lens, cfg: TuningConfig, num_kv_heads: int, sliding_window: int | None):
    """Work items (tile, kv block range) and the int32 [max_items, _META] list the kernel reads."""
    bkv = cfg.block_kv
    num_tiles = tiles.seq.shape[0]
    kv_len = kv_lens[tiles.seq]
    key_end = jnp.where(tiles.num_q > 0, tiles.pos0 + tiles.num_q, 0)  # causal: up to the last query
    key_begin = jnp.zeros_like(key_end)
    if sliding_window is not None:
        key_begin = jnp.maximum(tiles.pos0 - sliding_window + 1, 0)
    blk_begin = key_begin // bkv
    num_blocks = jnp.where(key_end > 0, (key_end + bkv - 1) // bkv - blk_begin, 0)  # [NT]

    # Flash-decoding: about `target` items per KV head in all, none shorter than
    # min_split_blocks unless the tile itself is; every non-empty tile has >= 1 item.
    target = max(1, -(-cfg.num_ctas * cfg.waves // num_kv_heads))
    max_items = num_tiles + target  # sum(cdiv(n, chunk)) <= sum(n) / chunk + NT
    chunk = jnp.maximum(cfg.min_split_blocks, (jnp.sum(num_blocks) + target - 1) // target)
    splits = (num_blocks + chunk - 1) // chunk  # [NT]
    item_end = jnp.cumsum(splits)
    num_items = item_end[-1]

    ids = jnp.arange(max_items, dtype=jnp.int32)
    tile = jnp.minimum(jnp.searchsorted(item_end, ids, side="right"), num_tiles - 1).astype(jnp.int32)
    valid = ids < num_items
    part = ids - (item_end[tile] - splits[tile])
    n, k = num_blocks[tile], jnp.maximum(splits[tile], 1)
    b0 = blk_begin[tile] + part * n // k  # even split of the tile's blocks
    b1 = blk_begin[tile] + (part + 1) * n // k
    b1 = jnp.where(valid, b1, b0)

    # Longest first, so the round-robin over CTAs ends evenly.
    order = jnp.argsort(-(b1 - b0), stable=True)
    tile, b0, b1 = tile[order], b0[order], b1[order]
    item_tile = jnp.where(valid[order], tile, num_tiles)  # == NT: dropped in the combine
    zero = jnp.zeros_like(tile)
    meta = jnp.stack([tile, tiles.seq[tile], b0, b1, tiles.pos0[tile], kv_len[tile], zero, zero], axis=1)
    return meta.astype(jnp.int32), num_items.astype(jnp.int32).reshape(1), item_tile


def _gather_query_tiles(q, tiles: _Tiles, num_kv_heads: int, rows: int, pad_rows: int):
    """q [T, H, D] -> [NT * rows + pad_rows, KV * D]: row tile*rows + t*G + g, columns of KV head."""
    num_tokens, num_heads, head_dim = q.shape
    num_tiles, tq = tiles.tokens.shape
    groups = num_heads // num_kv_heads
    x = jnp.take(q, jnp.minimum(tiles.tokens, num_tokens - 1).reshape(-1), axis=0)  # [NT*TQ, H, D]
    x = jnp.where((tiles.tokens < num_tokens).reshape(-1, 1, 1), x, 0)
    x = x.reshape(num_tiles, tq, num_kv_heads, groups, head_dim).transpose(0, 1, 3, 2, 4)
    x = x.reshape(num_tiles, tq * groups, num_kv_heads * head_dim)
    x = jnp.pad(x, ((0, 0), (0, rows - tq * groups), (0, 0))).reshape(num_tiles * rows, -1)
    return jnp.pad(x, ((0, pad_rows), (0, 0)))  # TMA boxes of the last tile stay in bounds


# ------------------------------------------------------------------------------------
# 2. Kernel.
# ------------------------------------------------------------------------------------


def _build_kernel(*, cfg: TuningConfig, dtype, num_kv_heads: int, head_dim: int, page_size: int,
                  groups: int, rows: int, max_items: int, max_pages: int, sm_scale: float,
                  sliding_window: int | None, soft_cap: float | None, interpret):
    nwg, bkv, stages = cfg.num_compute_wgs, cfg.block_kv, cfg.max_concurrent_steps
    kv_heads, dim, num_ctas = num_kv_heads, head_dim, cfg.num_ctas
    pages_per_block = bkv // page_size
    wg_rows = [min(ROWS_PER_WG, rows - w * ROWS_PER_WG) for w in range(nwg)]  # rows each WG stores
    assert all(r > 0 and r % 8 == 0 for r in wg_rows), (rows, nwg)
    layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    i32 = jnp.int32

    def work_unit(meta_ref, n):
        """The n-th (item, kv head) unit of this CTA and the item's fields."""
        unit = lax.axis_index("sm") + n * num_ctas
        item, head = lax.div(unit, i32(kv_heads)), lax.rem(unit, i32(kv_heads))
        fields = {f: meta_ref[item, f] for f in (_TILE, _SEQ, _BLK_BEGIN, _BLK_END, _POS0, _KV_LEN)}
        return item, head, fields

    def num_units(num_items_ref):
        total = num_items_ref[0] * kv_heads
        cta = lax.axis_index("sm")
        return lax.div(jnp.maximum(total - cta + num_ctas - 1, 0), i32(num_ctas))

    def memory_wg(meta_ref, num_items_ref, tables_ref, k_ref, v_ref, k_smem, v_smem, k_full, v_full, k_free, v_free):
        """Streams each unit's K/V pages into the ring, one TMA per page."""

        def fetch(src_ref, dst_smem, full, free, step, slot, seq, head, blk, kv_len):
            @pl.when(step >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])  # slot's previous block consumed

            for p in range(pages_per_block):
                index = blk * pages_per_block + p
                page = tables_ref[seq, jnp.minimum(index, max_pages - 1)]
                live = index * page_size < kv_len

                @pl.when(live)
                def _():
                    plgpu.copy_gmem_to_smem(
                        src_ref.at[pl.ds(page * page_size, page_size), pl.ds(head * dim, dim)],
                        dst_smem.at[slot, pl.ds(p * page_size, page_size)],
                        full.at[slot])

                # A page wholly past the context is not read (its rows are masked and
                # zeroed later); arriving keeps the barrier's count of one per page.
                @pl.when(~live)
                def _():
                    plgpu.barrier_arrive(full.at[slot])

        def unit_body(n, step0):
            _, head, f = work_unit(meta_ref, n)

            def step_body(j, _):
                step = step0 + j
                slot = lax.rem(step, i32(stages))
                args = (step, slot, f[_SEQ], head, f[_BLK_BEGIN] + j, f[_KV_LEN])
                fetch(k_ref, k_smem, k_full, k_free, *args)
                fetch(v_ref, v_smem, v_full, v_free, *args)

            lax.fori_loop(0, f[_BLK_END] - f[_BLK_BEGIN], step_body, None)
            return step0 + f[_BLK_END] - f[_BLK_BEGIN]

        total = lax.fori_loop(0, num_units(num_items_ref), unit_body, i32(0))
        # Observe the last frees too, so no barrier completion is left unawaited.
        for k in range(stages):
            step = total - stages + k

            @pl.when(step >= 0)
            def _():
                slot = lax.rem(step, i32(stages))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

    def scores_to_log2(s):
        """Raw q.k -> scaled (and soft-capped) logits in base-2 units."""
        if soft_cap is None:
            return s * (sm_scale * _LOG2E)
        return jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * _LOG2E)

    def visible(blk, pos0, kv_len, wg):
        """[64, block_kv] mask: key visible from the row's query (causal, window, context)."""
        row = plgpu.broadcasted_iota(i32, (ROWS_PER_WG, bkv), 0, layout=layout) + wg * ROWS_PER_WG
        key = plgpu.broadcasted_iota(i32, (ROWS_PER_WG, bkv), 1, layout=layout) + blk * bkv
        q_pos = pos0 + (lax.div(row, i32(groups)) if groups > 1 else row)
        mask = (key <= q_pos) & (key < kv_len)
        if sliding_window is not None:
            mask &= key > q_pos - sliding_window
        return mask

    def zero_tail(v_slot, num_valid):
        """Zero rows >= num_valid of a V block (garbage past the context, maybe NaN)."""
        for c in range(bkv // ROWS_PER_WG):
            @pl.when(num_valid < (c + 1) * ROWS_PER_WG)
            def _():
                chunk = v_slot.at[pl.ds(c * ROWS_PER_WG, ROWS_PER_WG)]
                v = plgpu.load(chunk, layout=layout)
                row = plgpu.broadcasted_iota(i32, (ROWS_PER_WG, dim), 0, layout=layout) + c * ROWS_PER_WG
                chunk[...] = jnp.where(row < num_valid, v, jnp.zeros_like(v))

    def compute_wg(meta_ref, num_items_ref, q_ref, o_ref, lse_ref, qo_smem, k_smem, v_smem,
                   lse_smem, p_smem, q_bar, k_full, v_full, k_free, v_free, tail_bar):
        wg = lax.axis_index("wg")
        qo = qo_smem.at[wg]  # [64, D]: this WG's query rows, then its output rows

        def unit_body(n, step0):
            item, head, f = work_unit(meta_ref, n)
            plgpu.copy_gmem_to_smem(
                q_ref.at[pl.ds(f[_TILE] * rows + wg * ROWS_PER_WG, ROWS_PER_WG), pl.ds(head * dim, dim)],
                qo, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])

            def step_body(j, carry):
                acc, m, l = carry  # [64, D] f32, [64] f32 (base-2 running max), [64] f32
                step = step0 + j
                slot = lax.rem(step, i32(stages))
                blk = f[_BLK_BEGIN] + j

                plgpu.barrier_wait(k_full.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, qo, k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((ROWS_PER_WG, bkv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])

                s = scores_to_log2(s)
                s = jnp.where(visible(blk, f[_POS0], f[_KV_LEN], wg), s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)

                plgpu.barrier_wait(v_full.at[slot])
                num_valid = f[_KV_LEN] - blk * bkv

                @pl.when(num_valid < bkv)
                def _():
                    # The first compute WG cleans the block; all of them wait for it.
                    @pl.when(wg == 0)
                    def _():
                        zero_tail(v_smem.at[slot], num_valid)
                        plgpu.commit_smem()

                    plgpu.barrier_arrive(tail_bar)
                    plgpu.barrier_wait(tail_bar)

                if p_smem is None:
                    p_operand = p.astype(dtype)
                else:
                    p_operand = p_smem.at[wg]
                    p_operand[...] = p.astype(dtype)
                    plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_operand, v_smem.at[slot])
                    return acc_ref[...]

                # A fresh accumulator folded in with one FMA per element (the rescale
                # costs that anyway); unlike pl.run_state it also runs interpreted.
                pv_out = pl.run_scoped(pv, plgpu.ACC((ROWS_PER_WG, dim), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv_out
                return acc, m_new, l

            init = (
                plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, dim), jnp.float32), layout),
                plgpu.layout_cast(jnp.full((ROWS_PER_WG,), _NEG_BIG, jnp.float32), row_layout),
                plgpu.layout_cast(jnp.zeros((ROWS_PER_WG,), jnp.float32), row_layout),
            )
            num_steps = f[_BLK_END] - f[_BLK_BEGIN]
            acc, m, l = lax.fori_loop(0, num_steps, step_body, init)

            # Rows that saw no key (l == 0) give o = 0 and lse = -inf.
            acc = acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])
            qo[...] = acc.astype(dtype)
            lse_smem.at[wg][...] = m + jnp.log(l) * (1 / math.log(2))
            plgpu.commit_smem()
            for w in range(nwg):  # static row counts per WG
                @pl.when(wg == w)
                def _():
                    out_rows = pl.ds(item * rows + w * ROWS_PER_WG, wg_rows[w])
                    plgpu.copy_smem_to_gmem(qo.at[pl.ds(0, wg_rows[w])], o_ref.at[out_rows, pl.ds(head * dim, dim)])
                    plgpu.copy_smem_to_gmem(lse_smem.at[w, pl.ds(0, wg_rows[w])], lse_ref.at[head, out_rows])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # qo is reused by the next unit
            return step0 + num_steps

        lax.fori_loop(0, num_units(num_items_ref), unit_body, i32(0))
        plgpu.wait_smem_to_gmem(0)

    def body(meta_ref, num_items_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
             qo_smem, k_smem, v_smem, lse_smem, p_smem, q_bar, k_full, v_full, k_free, v_free, tail_bar):
        wg = lax.axis_index("wg")

        @pl.when(wg < nwg)
        def _():
            if nwg == 2:
                plgpu.set_max_registers(232, action="increase")
            compute_wg(meta_ref, num_items_ref, q_ref, o_ref, lse_ref, qo_smem, k_smem, v_smem,
                       lse_smem, p_smem, q_bar, k_full, v_full, k_free, v_free, tail_bar)

        @pl.when(wg == nwg)
        def _():
            if nwg == 2:
                plgpu.set_max_registers(40, action="decrease")
            memory_wg(meta_ref, num_items_ref, tables_ref, k_ref, v_ref, k_smem, v_smem,
                      k_full, v_full, k_free, v_free)

    tiled = (plgpu.TilingTransform((8, _SWIZZLE // 2)), plgpu.SwizzleTransform(_SWIZZLE))
    out_type = (
        jax.ShapeDtypeStruct((max_items * rows, kv_heads * dim), dtype),  # partial O
        jax.ShapeDtypeStruct((kv_heads, max_items * rows), jnp.float32),  # base-2 LSE
    )
    scratch = [
        plgpu.SMEM((nwg, ROWS_PER_WG, dim), dtype, transforms=tiled),
        plgpu.SMEM((stages, bkv, dim), dtype, transforms=tiled),
        plgpu.SMEM((stages, bkv, dim), dtype, transforms=tiled),
        plgpu.SMEM((nwg, ROWS_PER_WG), jnp.float32),
        plgpu.SMEM((nwg, ROWS_PER_WG, bkv), dtype, transforms=tiled) if cfg.p_via_smem else None,
        plgpu.Barrier(num_barriers=nwg),  # Q landed, per WG
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),  # K full
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),  # V full
        plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),  # K free
        plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),  # V free
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
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )


# ------------------------------------------------------------------------------------
# 3. Combine and the public entry point.
# ------------------------------------------------------------------------------------


def _combine(o_part, lse, item_tile, num_tiles: int, rows: int, num_kv_heads: int, head_dim: int):
    """Merge each tile's partial results by their log-sum-exps -> [NT, rows, KV, D] f32."""
    max_items = item_tile.shape[0]
    o = o_part.reshape(max_items, rows, num_kv_heads, head_dim).astype(jnp.float32)
    lse = lse.reshape(num_kv_heads, max_items, rows).transpose(1, 2, 0)  # [I, rows, KV]
    # Items past num_items point at segment NT and are dropped: their rows were never written.
    m = jax.ops.segment_max(lse, item_tile, num_segments=num_tiles)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp2(lse - m[jnp.minimum(item_tile, num_tiles - 1)])
    num = jax.ops.segment_sum(w[..., None] * o, item_tile, num_segments=num_tiles)
    den = jax.ops.segment_sum(w, item_tile, num_segments=num_tiles)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def _scatter_tokens(out_tiles, tiles: _Tiles, num_tokens: int, groups: int, dtype):
    """[NT, rows, KV, D] tile rows -> [T, H, D] in flat token order (padding tokens 0)."""
    num_tiles, _, num_kv_heads, head_dim = out_tiles.shape
    tq = tiles.tokens.shape[1]
    x = out_tiles[:, : tq * groups].reshape(num_tiles, tq, groups, num_kv_heads, head_dim)
    x = x.transpose(0, 1, 3, 2, 4).reshape(num_tiles * tq, num_kv_heads * groups, head_dim)
    result = jnp.zeros((num_tokens, num_kv_heads * groups, head_dim), dtype)
    return result.at[tiles.tokens.reshape(-1)].set(x.astype(dtype), mode="drop")


def ragged_paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: jax.Array,  # [num_pages, page_size, num_kv_heads, head_dim]
    kv_lens: jax.Array,  # int32 [S]
    block_tables: jax.Array,  # int32 [S, max_pages]
    query_start_loc: jax.Array,  # int32 [S + 1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    query_tile: int | None = None,
    kv_chunk_pages: int | None = None,
    config: TuningConfig | None = None,
    interpret=None,
) -> jax.Array:  # [T, num_heads, head_dim]; zeros for tokens past query_start_loc[S]
    """`ragged_paged_attention_reference` on a Hopper GPU (see the module docstring).

    `query_tile` overrides the config's tokens per tile; `kv_chunk_pages` is accepted
    for signature compatibility and ignored (the kernel's kv step is `config.block_kv`).
    `interpret=True` (or a `plgpu.InterpretGPUParams`) runs the Mosaic GPU interpreter.
    """
    del kv_chunk_pages
    if (reason := unsupported_reason(q, k_pages, v_pages)) is not None:
        raise NotImplementedError(f"ragged_paged_attention (Mosaic GPU): {reason}")
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, max_pages = block_tables.shape
    groups = num_heads // num_kv_heads
    if config is None:
        config = default_config(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, page_size)
    if query_tile is not None:
        config = dataclasses.replace(config, query_tile=query_tile)
    if (reason := unsupported_reason(q, k_pages, v_pages, config=config)) is not None:
        raise NotImplementedError(f"ragged_paged_attention (Mosaic GPU): {reason}")
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    if interpret:
        config = dataclasses.replace(config, p_via_smem=True)

    kv_lens = kv_lens.astype(jnp.int32)
    query_start_loc = query_start_loc.astype(jnp.int32)
    rows = config.rows_per_tile(groups)
    tiles = _cut_tiles(kv_lens, query_start_loc, num_tokens, config.query_tile)
    meta, num_items, item_tile = _plan_items(tiles, kv_lens, config, num_kv_heads, sliding_window)
    q_tiles = _gather_query_tiles(q, tiles, num_kv_heads, rows, ROWS_PER_WG * config.num_compute_wgs)

    kernel = _build_kernel(
        cfg=config, dtype=q.dtype, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
        groups=groups, rows=rows, max_items=meta.shape[0], max_pages=max_pages, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
    # Free reshapes: pages as 2D [pages * page_size, KV * D] so a page of one head is a
    # rectangular TMA box.
    k2d = k_pages.reshape(num_pages * page_size, num_kv_heads * head_dim)
    v2d = v_pages.reshape(num_pages * page_size, num_kv_heads * head_dim)
    o_part, lse = kernel(meta, num_items, block_tables.astype(jnp.int32), q_tiles, k2d, v2d)

    out_tiles = _combine(o_part, lse, item_tile, tiles.seq.shape[0], rows, num_kv_heads, head_dim)
    return _scatter_tokens(out_tiles, tiles, num_tokens, groups, q.dtype)
