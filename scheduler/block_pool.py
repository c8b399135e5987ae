"""The pool of KV-cache blocks: free list, reference counts and the prefix cache.

A block is free when no sequence references it. A free block that holds a full,
hashed run of tokens stays findable in the prefix cache until it is reused; free
blocks are reused least-recently-freed first, so cached prefixes survive as long as
there is room. Block 0 is the null block (padding writes there) and is never handed out.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Hashable, Iterable

NULL_BLOCK = 0


@dataclasses.dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and its tokens are known: (hash, tokens) of the chain
    # prefix ending in this block.
    block_hash: Hashable | None = None
    token_ids: tuple[int, ...] | None = None


def hash_block(parent_hash: Hashable | None, token_ids: tuple[int, ...]) -> Hashable:
    """Chained hash of a full block: equal only if every earlier block is equal too."""
    return hash((parent_hash, token_ids))


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"{num_blocks=}: block 0 is reserved, so at least 2 are needed")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in reuse order (least recently freed first). dict order is the queue.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[Hashable, int] = {}  # block hash -> block id
        self.hits = 0
        self.queries = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by some sequence."""
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def allocate(self, count: int) -> list[Block] | None:
        """`count` fresh blocks with one reference each, or None if the pool has fewer free."""
        if count > len(self.free):
            return None
        out = []
        for _ in range(count):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def lookup(self, block_hash: Hashable, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block for this hash, if its tokens match too (hashes can collide)."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == token_ids else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found in the cache (they may be sitting in the free list)."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the free list."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of block {block.block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block.block_id] = None

    def register(self, block: Block, block_hash: Hashable, token_ids: tuple[int, ...]) -> None:
        """Make a full block findable by the hash of its prefix (first writer wins)."""
        if block.block_hash is not None:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached.setdefault(block_hash, block.block_id)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self._evict(block)

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) == block.block_id:
            del self.cached[block.block_hash]
        block.block_hash = block.token_ids = None

    def check_integrity(self, table_refs: dict[int, int]) -> None:
        """Assert the pool agrees with the sequences' block tables.

        `table_refs` counts, for each block id, how many block tables hold it.
        """
        assert self.blocks[NULL_BLOCK].ref_count == 0 and NULL_BLOCK not in self.free
        assert NULL_BLOCK not in table_refs, "a sequence holds the null block"
        for block in self.blocks[1:]:
            refs = table_refs.get(block.block_id, 0)
            assert block.ref_count == refs, f"block {block.block_id}: ref_count {block.ref_count} != {refs} tables"
            assert (block.block_id in self.free) == (refs == 0), f"block {block.block_id} free-list state is wrong"
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash
