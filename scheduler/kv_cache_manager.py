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
from collections.abc import Sequence

from scheduler.block_pool import HANDOFF_DIGEST_KEY, Block, BlockKey, BlockPool, ExtraKeys, hash_block
from scheduler.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[str, list[int]] = {}  # request id -> block ids, in token order
        self.block_digests: dict[str, list[bytes]] = {}  # chained digests of each request's full blocks
        self.num_registered: dict[str, int] = {}  # leading full blocks already offered to the cache
        self.copies: list[tuple[int, int]] = []  # (src, dst) block copies for the next step

    # -- queries --------------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

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
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self._cached_run(request.all_token_ids, self._extra(request), self._digests(request, max_blocks))

    def lookup_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> list[Block]:
        """The blocks a request of these tokens would find cached (find_cached_prefix), for
        handing their KV to another engine (prefill/decode disaggregation)."""
        if not self.enable_prefix_caching:
            return []
        extra: ExtraKeys = (cache_salt,) if cache_salt is not None else ()
        max_blocks = (len(token_ids) - 1) // self.block_size
        return self._cached_run(token_ids, extra, self._chain(token_ids, extra, max_blocks, []))

    def adopt_prefix(self, token_ids: list[int], cache_salt: str | None, num_blocks: int) -> list[tuple[int, int]]:
        """Make the first `num_blocks` full blocks of `token_ids` cached here, for KV computed
        by another engine: (position, block id) of each block whose KV the caller must write
        now; blocks cached already are skipped. They are registered and left unreferenced,
        as a finished request leaves its blocks, so the request that adds these tokens next
        finds them (or, should they be evicted first, computes them again). Only as many as
        the free blocks allow."""
        if not self.enable_prefix_caching:
            return []
        extra: ExtraKeys = (cache_salt,) if cache_salt is not None else ()
        num_blocks = min(num_blocks, (len(token_ids) - 1) // self.block_size)
        digests = self._chain(token_ids, extra, num_blocks, [])
        chain = self._cached_run(token_ids, extra, digests)
        first = len(chain)
        fresh = self._allocate(min(num_blocks - first, self.pool.num_free))
        for i, block in enumerate(fresh, start=first):
            parent = chain[-1].prefix_id if chain else None
            self.pool.register(block, digests[i], self._key(token_ids, extra, i, parent))
            chain.append(block)
        self.pool.release(fresh)
        return [(i, block.block_id) for i, block in enumerate(fresh, start=first)]

    def handoff_digests(self, token_ids: list[int], cache_salt: str | None, num_blocks: int) -> list[str]:
        """handoff_digests for this cache's block size."""
        return handoff_digests(token_ids, self.block_size, cache_salt, num_blocks)

    def _cached_run(self, token_ids: list[int], extra: ExtraKeys, digests: list[bytes]) -> list[Block]:
        """The cached blocks of the longest run of `digests` from the first."""
        found: list[Block] = []
        for i, digest in enumerate(digests):
            parent = found[-1].prefix_id if found else None
            block = self.pool.lookup(digest, self._key(token_ids, extra, i, parent))
            if block is None:
                break
            found.append(block)
        return found

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed, full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self.tables.get(rid, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        done = self.num_registered.get(rid, 0)
        if num_full <= done:
            return  # the common case: no block filled up this step
        digests = self._digests(request, num_full)
        for i in range(done, num_full):
            parent = self.pool.blocks[table[i - 1]].prefix_id if i else None
            if i and parent is None:
                break  # the cache was reset under this request: its later blocks stay unregistered
            self.pool.register(
                self.pool.blocks[table[i]],
                digests[i],
                self._key(request.all_token_ids, self._extra(request), i, parent),
            )
        self.num_registered[rid] = num_full

    def _key(self, token_ids: list[int], extra: ExtraKeys, i: int, parent: int | None) -> BlockKey:
        tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
        return BlockKey(parent, tokens, extra if i == 0 else ())

    @staticmethod
    def _extra(request: Request) -> ExtraKeys:
        # NOTE: the adapter id goes in as a tuple, which no string salt can equal.
        salt = (request.cache_salt,) if request.cache_salt is not None else ()
        return salt + ((("lora", request.lora_id),) if request.lora_id is not None else ())

    def _digests(self, request: Request, num_blocks: int) -> list[bytes]:
        digests = self.block_digests.setdefault(request.request_id, [])
        return self._chain(request.all_token_ids, self._extra(request), num_blocks, digests)

    def _chain(self, token_ids: list[int], extra: ExtraKeys, num_blocks: int, digests: list[bytes]) -> list[bytes]:
        """The chained digests of the first `num_blocks` full blocks, extending `digests`."""
        while len(digests) < num_blocks:
            i = len(digests)
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            digests.append(hash_block(digests[-1] if digests else None, chunk, extra if i == 0 else ()))
        return digests[:num_blocks]

    # -- allocation -----------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, cached: Sequence[Block] = ()) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `cached` are prefix-cache hits to adopt first (only when the request holds no
        blocks yet). Returns the ids of newly allocated blocks, or None (and changes
        nothing) if the pool cannot serve the request now.
        """
        table = self.tables.get(request.request_id, [])
        bs = self.block_size
        first_write = request.num_computed_tokens + len(cached) * bs
        num_new_blocks = max(0, -(-(first_write + num_new_tokens) // bs) - len(table) - len(cached))
        write_block = first_write // bs
        cow = num_new_tokens > 0 and write_block < len(table) and self.pool.blocks[table[write_block]].ref_count > 1
        if not (num_new_blocks or cow or cached) and table:
            return []  # the common decode step: room in the last block, which is ours alone
        assert not cached or not table, "prefix hits are adopted only by a request without blocks"
        revived = sum(1 for b in cached if b.ref_count == 0)  # cached blocks now in the free list
        if num_new_blocks + cow + revived > self.pool.num_free:
            return None

        self.tables[request.request_id] = table
        self.pool.touch(cached)
        table.extend(b.block_id for b in cached)
        if cow:
            (copy,) = self._allocate(1)
            shared = self.pool.blocks[table[write_block]]
            self.copies.append((shared.block_id, copy.block_id))
            self.pool.release([shared])
            table[write_block] = copy.block_id
        new_ids = [b.block_id for b in self._allocate(num_new_blocks)]
        table.extend(new_ids)
        return new_ids

    def _allocate(self, count: int) -> list[Block]:
        """`count` fresh blocks, where the caller has checked that the pool has them."""
        blocks = self.pool.allocate(count)
        assert blocks is not None, f"{count=} > {self.pool.num_free=}"
        return blocks

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Let `child` share the parent's blocks holding its first `num_tokens` tokens."""
        assert child.request_id not in self.tables
        shared = self.tables[parent.request_id][: self.blocks_needed(num_tokens)]
        self.pool.touch(self.pool.blocks[i] for i in shared)
        self.tables[child.request_id] = list(shared)

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (so the tail is evicted first)."""
        rid = request.request_id
        table = self.tables.pop(rid, [])
        self.pool.release(self.pool.blocks[i] for i in reversed(table))
        self.block_digests.pop(rid, None)
        self.num_registered.pop(rid, None)
        # A copy into a block this request no longer holds must not run.
        freed = {i for i in table if self.pool.blocks[i].ref_count == 0}
        if freed:
            self.copies = [(src, dst) for src, dst in self.copies if dst not in freed]

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def check_integrity(self) -> None:
        refs = Counter(i for table in self.tables.values() for i in table)
        self.pool.check_integrity(dict(refs))


def handoff_digests(token_ids: list[int], block_size: int, cache_salt: str | None, num_blocks: int) -> list[str]:
    """The hex digests of the first `num_blocks` full blocks of `token_ids` (at most the blocks
    lookup_prefix could find: the last token is always computed), chained with the cache salt
    folded into the first, as the prefix cache chains them, but keyed alike in every process
    (HANDOFF_DIGEST_KEY): what binds handed-over KV to its prompt (prefill/decode disaggregation)."""
    extra: ExtraKeys = (cache_salt,) if cache_salt is not None else ()
    digests: list[bytes] = []
    for i in range(min(num_blocks, max(0, (len(token_ids) - 1) // block_size))):
        chunk = tuple(token_ids[i * block_size : (i + 1) * block_size])
        digests.append(hash_block(digests[-1] if digests else None, chunk, extra if i == 0 else (), HANDOFF_DIGEST_KEY))
    return [d.hex() for d in digests]
