"""The pool of KV-cache blocks: free list, reference counts and the prefix cache.

A block is free when no sequence references it. A free block that holds a full run of
tokens stays findable in the prefix cache until it is reused; free blocks are reused
least-recently-freed first, so cached prefixes survive as long as there is room. Block 0
is the null block (padding writes there) and is never handed out.

Finding a cached block takes two things. The index is a keyed blake2b digest chained
over the blocks (`hash_block`), so a lookup is one dict access. The match is exact: a
cached block keeps its `BlockKey` (its own tokens, the prefix id of the block before it,
any extra keys such as a cache salt), and a hit needs the whole key to be equal. Prefix
ids name whole prefixes: two blocks get the same id only if their keys are equal, so by
induction a hit means every earlier token is equal too, whatever the digests do. A digest
collision costs a cache miss, never another request's KV.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from collections import OrderedDict
from collections.abc import Hashable, Iterable

NULL_BLOCK = 0

# Digests are keyed per process: nobody outside can precompute colliding prompts.
_DIGEST_KEY = os.urandom(32)
# Digests of KV handed between servers (prefill/decode disaggregation) are the same in every
# process, so the decode server can check an offer against its own prompt; the offer's
# signature (a shared secret), not this key, is what stops a forged one.
HANDOFF_DIGEST_KEY = b"jaxserve kv handoff"


ExtraKeys = tuple[Hashable, ...]  # what a block's KV depends on besides its tokens


@dataclasses.dataclass(frozen=True)
class BlockKey:
    """Everything a cached block's KV depends on, compared exactly on every hit."""

    parent: int | None  # prefix id of the previous block; None for a sequence's first block
    token_ids: tuple[int, ...]
    extra: ExtraKeys = ()  # e.g. the request's cache salt (first block only: the chain carries it)


def hash_block(
    parent_digest: bytes | None, token_ids: tuple[int, ...], extra: ExtraKeys = (), key: bytes = _DIGEST_KEY
) -> bytes:
    """Chained digest of a full block: the parent's digest, the token ids as bytes, extra keys.
    `key`: this process's own by default; another (HANDOFF_DIGEST_KEY) for digests that other
    processes must reproduce."""
    h = hashlib.blake2b(key=key, digest_size=32)
    h.update(parent_digest or b"\0" * 32)
    h.update(len(token_ids).to_bytes(4, "little"))
    for t in token_ids:
        h.update(t.to_bytes(8, "little", signed=True))
    h.update(repr(extra).encode())
    return h.digest()


@dataclasses.dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full and registered; cleared when it is reused.
    digest: bytes | None = None
    key: BlockKey | None = None
    prefix_id: int | None = None  # equal for two blocks iff their whole prefixes are equal


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"{num_blocks=}: block 0 is reserved, so at least 2 are needed")
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in reuse order (least recently freed first). dict order is the queue.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[bytes, int] = {}  # digest -> block id
        self._prefix_ids = itertools.count()

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

    def lookup(self, digest: bytes, key: BlockKey) -> Block | None:
        """The cached block for this digest, if its key is equal too (digests can collide)."""
        block_id = self.cached.get(digest)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.key == key else None

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

    def register(self, block: Block, digest: bytes, key: BlockKey) -> None:
        """Make a full block findable (the first block registered under a digest wins)."""
        if block.key is not None:
            return
        owner_id = self.cached.get(digest)
        owner = self.blocks[owner_id] if owner_id is not None else None
        if owner is not None and owner.key == key:
            block.prefix_id = owner.prefix_id  # the same prefix computed twice
        else:
            block.prefix_id = next(self._prefix_ids)
            if owner is None:
                self.cached[digest] = block.block_id
        block.digest, block.key = digest, key

    def _evict(self, block: Block) -> None:
        if block.digest is not None and self.cached.get(block.digest) == block.block_id:
            del self.cached[block.digest]
        block.digest = block.key = block.prefix_id = None

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
            assert (block.key is None) == (block.prefix_id is None) == (block.digest is None)
        for digest, block_id in self.cached.items():
            assert self.blocks[block_id].digest == digest
