"""The paged KV cache: its layout, defined here and nowhere else, its sizing and its write.

    k, v:             [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    k_scale, v_scale: [num_layers, num_blocks, num_kv_heads, block_size]   (8-bit caches only)

Every layer has its own `num_blocks` pages, but the host block manager hands out one
block id that is valid in all layers. Each layer writes its tokens into the cache as it
is (`write_kv`); for attention the model folds the layer axis into the page axis
(`[num_layers * num_blocks, ...]`, a free reshape: `fold_layers`) and offsets block ids by
`layer * num_blocks`, so attention sees one flat pool of pages and never a per-layer
slice (which would cost a copy of the layer's cache every step).

`--kv-cache-dtype` fp8 or int8 stores K and V in 8 bits with a float32 scale per token
and KV head beside the pages (see `pallas_kernels.quantized_kv`): quantized as they are
written, dequantized by attention right after it loads a page. A checkpoint's calibrated
scales (ModelConfig.kv_scales), where it ships them, take the place of each token's own.
Every per-block array has the block axis second, so copy-on-write and prefix caching move
scales with their block.

Block 0 is the null block: padding tokens write into slot 0 and no sequence owns it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.model.config import ModelConfig
from pallas_kernels.quantized_kv import KV_DTYPES, is_quantized_kv, quantize_kv, quantize_kv_calibrated

NULL_BLOCK = 0
KV_CACHE_DTYPES = ("auto", *KV_DTYPES)
_SCALE_DTYPE = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, num_blocks, block_size, KV, D]
    v: jax.Array  # [L, num_blocks, block_size, KV, D]
    k_scale: jax.Array | None = None  # [L, num_blocks, KV, block_size]; None: K and V unquantized
    v_scale: jax.Array | None = None

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))

    @property
    def dtype(self):
        return self.k.dtype

    def scales(self) -> dict[str, jax.Array]:
        """The attention functions' scale arguments: none for an unquantized cache."""
        return {} if self.k_scale is None else {"k_scales": self.k_scale, "v_scales": self.v_scale}


@dataclasses.dataclass(frozen=True)
class KVHandoff:
    """A prompt prefix's KV as one engine hands it to another (prefill/decode
    disaggregation): its first `num_blocks` full blocks, exactly, in rows 0.. of `kv`, and
    their `digests` (scheduler.kv_cache_manager.handoff_digests of the prompt they were
    computed for, with its `cache_salt`: the importing engine writes them only for a prompt
    with the same digests)."""

    num_blocks: int
    kv: KVCache  # [L, num_blocks, block_size, KV, D] per array
    digests: tuple[str, ...] = ()
    cache_salt: str | None = None  # the prompt's, folded into the digests

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.kv.block_size

    @property
    def nbytes(self) -> int:
        """The bytes of its blocks: all of `kv`, what a transfer moves."""
        return self.kv.nbytes


def fold_layers(kv: KVCache) -> KVCache:
    """The cache as one pool of pages: every array's [L, num_blocks] axes merged."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), kv)


def resolve_kv_cache_dtype(name: str | None, model_dtype) -> jnp.dtype:
    """The storage dtype for `--kv-cache-dtype` (auto or None: the model's dtype)."""
    if name in (None, "auto"):
        return jnp.dtype(model_dtype)
    if name not in KV_DTYPES:
        raise ValueError(f"kv cache dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return jnp.dtype(KV_DTYPES[name])


def kv_dtype_label(dtype, calibrated: str | None = None) -> str:
    """How a cache of code dtype `dtype` stores K and V, in words; `calibrated`: the model's
    kv_scales (the 8-bit type its checkpoint's scales were calibrated for)."""
    dtype = jnp.dtype(dtype)
    if not is_quantized_kv(dtype):
        return dtype.name
    codes = "fp8 e4m3 (uint8 bit patterns)" if dtype == jnp.uint8 else dtype.name
    if calibrated is not None:
        return f"{codes} with the checkpoint's scales (calibrated for {calibrated})"
    return f"{codes} with float32 scales per token and KV head"


def kv_bytes_per_token(cfg: ModelConfig, dtype) -> int:
    """Cache bytes one token occupies over all layers, K and V, scales included."""
    dtype = jnp.dtype(dtype)
    per_head = cfg.head_dim * dtype.itemsize + (jnp.dtype(_SCALE_DTYPE).itemsize if is_quantized_kv(dtype) else 0)
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype) -> KVCache:
    """Zero-filled cache of `num_blocks` blocks per layer (block 0 is the null block)."""
    if num_blocks < 2:
        raise ValueError(f"{num_blocks=} is too small: block 0 is reserved, so at least 2 are needed")
    shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    kv = KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    if is_quantized_kv(dtype):
        scale_shape = (cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size)
        kv.k_scale, kv.v_scale = jnp.zeros(scale_shape, _SCALE_DTYPE), jnp.zeros(scale_shape, _SCALE_DTYPE)
    return kv


def num_blocks_for_memory(cfg: ModelConfig, memory_bytes: int, block_size: int, dtype) -> int:
    """How many blocks per layer fit in `memory_bytes` of K and V (and their scales) together."""
    return int(memory_bytes // (block_size * kv_bytes_per_token(cfg, dtype)))


def copy_blocks(kv: KVCache, pairs: jax.Array) -> KVCache:
    """kv[:, dst] = kv[:, src] for each (src, dst) row, in every layer and every array,
    scales included (copy-on-write)."""
    src, dst = pairs[:, 0], pairs[:, 1]
    return jax.tree.map(lambda x: x.at[:, dst].set(x[:, src]), kv)


def read_blocks(kv: KVCache, block_ids: jax.Array) -> KVCache:
    """kv[:, block_ids] in every array: whole blocks, to hand to another engine."""
    return jax.tree.map(lambda x: x[:, block_ids], kv)


def write_blocks(kv: KVCache, blocks: KVCache, rows: jax.Array, block_ids: jax.Array) -> KVCache:
    """kv[:, block_ids[i]] = blocks[:, rows[i]] in every array: blocks from read_blocks,
    possibly another engine's whose tensor parallelism repeated its KV heads differently
    (jaxserve.parallel.sharding.replicate_kv_heads); they are repeated or thinned to this cache's."""

    def write(x, b, head_axis):
        have, want = b.shape[head_axis], x.shape[head_axis]
        if want > have:
            b = jnp.repeat(b, want // have, axis=head_axis)
        elif have > want:
            b = jax.lax.slice_in_dim(b, 0, have, have // want, axis=head_axis)
        return x.at[:, block_ids].set(b[:, rows])

    out = KVCache(write(kv.k, blocks.k, 3), write(kv.v, blocks.v, 3))
    if kv.k_scale is not None:
        out.k_scale, out.v_scale = write(kv.k_scale, blocks.k_scale, 2), write(kv.v_scale, blocks.v_scale, 2)
    return out


def move_slots(kv: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """kv[slot dst[i]] = kv[slot src[i]] in every layer and array, scales included, all
    read before any is written (a tree's accepted drafts moved next to each other)."""
    k, v = (x.reshape(x.shape[0], -1, *x.shape[3:]) for x in (kv.k, kv.v))  # [L, slots, KV, D]
    out = KVCache(k.at[:, dst].set(k[:, src]).reshape(kv.k.shape), v.at[:, dst].set(v[:, src]).reshape(kv.v.shape))
    if kv.k_scale is not None:
        block_size = kv.block_size

        def move_scales(x):  # [L, num_blocks, KV, block_size]
            values = x[:, src // block_size, :, src % block_size]
            return x.at[:, dst // block_size, :, dst % block_size].set(values)

        out.k_scale, out.v_scale = move_scales(kv.k_scale), move_scales(kv.v_scale)
    return out


def write_kv(
    kv: KVCache,
    layer: jax.Array,
    slots: jax.Array,
    k: jax.Array,
    v: jax.Array,
    calibrated: tuple[jax.Array, jax.Array] | None = None,
) -> KVCache:
    """Store each token's K and V [T, KV, D] at its slot (`block * block_size + offset`) of
    layer `layer`, quantizing them first if the cache is 8-bit: with `calibrated` (this
    layer's fixed K and V scales per KV head [KV], for the cache's dtype), else with each
    token's own.

    NOTE: it writes the unfolded cache [L, num_blocks, ...], not the folded pages attention
    reads: XLA gives a scatter into a reshaped view a layout of its own when an axis has
    size one (one KV head per device: MQA, or tensor parallelism), and then copies the
    whole cache twice a step to and from it."""
    if kv.k_scale is None:
        return KVCache(
            _write_slots(kv.k, layer, slots, k.astype(kv.dtype)), _write_slots(kv.v, layer, slots, v.astype(kv.dtype))
        )
    if calibrated is None:
        (k, k_scale), (v, v_scale) = quantize_kv(k, kv.dtype), quantize_kv(v, kv.dtype)
    else:
        (k, k_scale), (v, v_scale) = (quantize_kv_calibrated(x, s, kv.dtype) for x, s in zip((k, v), calibrated))
    return KVCache(
        _write_slots(kv.k, layer, slots, k),
        _write_slots(kv.v, layer, slots, v),
        _write_scales(kv.k_scale, layer, slots, k_scale),
        _write_scales(kv.v_scale, layer, slots, v_scale),
    )


def _one_row_guard(slots: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
    # NOTE: XLA on the CPU turns a one-row scatter into a dynamic-update-slice that copies
    # the whole cache; a second row, into the null slot 0, keeps it a scatter (in place).
    if slots.shape[0] != 1:
        return slots, values
    return jnp.concatenate([slots, jnp.zeros(1, slots.dtype)]), jnp.concatenate([values, jnp.zeros_like(values)])


def _write_slots(cache: jax.Array, layer: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """cache[layer, slot // block_size, slot % block_size] = values, for each token."""
    slots, values = _one_row_guard(slots, values)
    block_size = cache.shape[2]
    return cache.at[layer, slots // block_size, slots % block_size].set(values, mode="promise_in_bounds")


def _write_scales(scales: jax.Array, layer: jax.Array, slots: jax.Array, values: jax.Array) -> jax.Array:
    """scales[layer, slot // block_size, :, slot % block_size] = values [T, KV], for each token."""
    slots, values = _one_row_guard(slots, values)
    block_size = scales.shape[-1]
    return scales.at[layer, slots // block_size, :, slots % block_size].set(values, mode="promise_in_bounds")
