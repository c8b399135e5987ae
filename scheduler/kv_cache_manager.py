"""Per-request block tables over the block pool: allocation, prefix hits, forks, copy-on-write.

Token `p` of a request lives in block `table[p // block_size]` at offset
`p % block_size`. Blocks are allocated as tokens are scheduled, so a request never holds
more than one partially filled block.

    tokens:  |0 1 2 3|4 5 6 7|8 9 . .|        block_size = 4, 10 tokens
    table:   [  17   ,   4   ,   9   ]        block 9 is the one partial block

Blocks may be shared: full blocks found in the prefix cache, and every block of a
parent whose samples were forked (n > 1). A request never writes into a block someone
else holds; before it does, it copies the block (copy-on-write), and the copy is done
on the device at the start of the step (`take_copies`).
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable

from scheduler.block_pool import Block, BlockPool, hash_block
from scheduler.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[Block]] = {}
        self.block_hashes: dict[str, list[Hashable]] = {}  # chained hashes of each request's full blocks
        self.copies: list[tuple[int, int]] = []  # (src, dst) block copies for the next step

    # -- queries --------------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    # -- prefix cache ---------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Cached blocks holding the longest prefix of the request's tokens.

        At least one token is always left to compute, since the step that computes it
        is the one that samples the next token.
        """
        if not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hashes = self._hashes(request, max_blocks)
        found = []
        for i, block_hash in enumerate(hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, tuple(tokens[i * self.block_size : (i + 1) * self.block_size]))
            if block is None:
                break
            found.append(block)
        self.pool.queries += len(tokens)
        self.pool.hits += len(found) * self.block_size
        return found

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed, full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        hashes = self._hashes(request, num_full)
        tokens = request.all_token_ids
        for i in range(num_full):
            if table[i].block_hash is None:
                self.pool.register(table[i], hashes[i], tuple(tokens[i * self.block_size : (i + 1) * self.block_size]))

    def _hashes(self, request: Request, num_blocks: int) -> list[Hashable]:
        hashes = self.block_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(hash_block(hashes[-1] if hashes else None, chunk))
        return hashes

    # -- allocation -----------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, cached: list[Block] = ()) -> list[Block] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `cached` are prefix-cache hits to adopt first (only when the request holds no
        blocks yet). Returns the newly allocated blocks, or None (and changes nothing)
        if the pool cannot serve the request now.
        """
        table = self.tables.get(request.request_id, [])
        assert not cached or not table, "prefix hits are adopted only by a request without blocks"
        first_write = request.num_computed_tokens + len(cached) * self.block_size
        new_total = first_write + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(new_total) - len(table) - len(cached))
        write_block = first_write // self.block_size
        cow = write_block < len(table) and table[write_block].ref_count > 1 and num_new_tokens > 0
        revived = sum(1 for b in cached if b.ref_count == 0)  # cached blocks now in the free list
        if num_new_blocks + cow + revived > self.pool.num_free:
            return None

        self.tables[request.request_id] = table
        self.pool.touch(cached)
        table.extend(cached)
        if cow:
            (copy,) = self.pool.allocate(1)
            shared = table[write_block]
            self.copies.append((shared.block_id, copy.block_id))
            self.pool.release([shared])
            table[write_block] = copy
        new_blocks = self.pool.allocate(num_new_blocks)
        table.extend(new_blocks)
        return new_blocks

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Let `child` share the parent's blocks holding its first `num_tokens` tokens."""
        assert child.request_id not in self.tables
        shared = self.tables[parent.request_id][: self.blocks_needed(num_tokens)]
        self.pool.touch(shared)
        self.tables[child.request_id] = list(shared)

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (so the tail is evicted first)."""
        table = self.tables.pop(request.request_id, [])
        self.pool.release(reversed(table))
        self.block_hashes.pop(request.request_id, None)
        # A copy into a block this request no longer holds must not run.
        freed = {b.block_id for b in table if b.ref_count == 0}
        self.copies = [(src, dst) for src, dst in self.copies if dst not in freed]

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def check_integrity(self) -> None:
        refs = Counter(b.block_id for table in self.tables.values() for b in table)
        self.pool.check_integrity(dict(refs))
