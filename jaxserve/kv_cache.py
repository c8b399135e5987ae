"""The paged KV cache: its layout, defined here and nowhere else, and its sizing.

    k, v: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]

Every layer has its own `num_blocks` pages, but the host block manager hands out one
block id that is valid in all layers. The model folds the layer axis into the page axis
(`[num_layers * num_blocks, ...]`, a free reshape) and offsets block ids by
`layer * num_blocks`, so attention sees one flat pool of pages and never a per-layer
slice (which would cost a copy of the layer's cache every step).

Block 0 is the null block: padding tokens write into slot 0 and no sequence owns it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig

NULL_BLOCK = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, num_blocks, block_size, KV, D]
    v: jax.Array  # [L, num_blocks, block_size, KV, D]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype) -> KVCache:
    """Zero-filled cache of `num_blocks` blocks per layer (block 0 is the null block)."""
    if num_blocks < 2:
        raise ValueError(f"{num_blocks=} is too small: block 0 is reserved, so at least 2 are needed")
    shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def num_blocks_for_memory(cfg: ModelConfig, memory_bytes: int, block_size: int, dtype) -> int:
    """How many blocks per layer fit in `memory_bytes` of K and V together."""
    per_block = block_size * cfg.kv_bytes_per_token(jnp.dtype(dtype).itemsize)
    return int(memory_bytes // per_block)
