"""Pick a data-parallel replica for each request, preferring one that saw its prefix.

The router front end (api.router, which `python -m api --data-parallel-size M` starts in
front of M engine processes) sends each call to one of several upstream servers, each with
its own prefix cache. Sending a prompt to the replica that recently served the same prefix turns
a prefill into a cache hit; sending everything there would overload it. This is SGLang's
cache-aware routing, simplified: the router does not see the replicas' real caches, it
remembers which prefixes it recently *sent* to each replica (an LRU of block digests), and
that is a good guess of what is cached there.

The rule, per request:
  best = the alive replica with the longest recently-seen leading prefix (ties: lower load,
  then lower index). Take it if that prefix is non-empty and its load is within `load_bound`
  of the least loaded alive replica; otherwise take the least loaded (ties round-robin).

A prompt is a chain of digests over its whole prefix (no cap on its length: a second chat
turn behind a long system prompt must find the replica holding its history). Token prompts
use the block pool's digests (`prefix_digests`: `hash_block` over full blocks, the cache
salt folded into the first); any other canonical form of a prompt (api.router routes on the
request's text) chains its own chunks with `chain_digests`. Either way the salt starts the
chain, so requests with different salts never match.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from scheduler.block_pool import hash_block


def chain_digests(chunks: Iterable[bytes], cache_salt: str | None = None) -> list[bytes]:
    """Chained digests of a prompt's chunks in order: digest i covers chunks 0..i (and the salt)."""
    digests: list[bytes] = []
    parent = hashlib.blake2b(repr(cache_salt).encode(), digest_size=32).digest()
    for chunk in chunks:
        h = hashlib.blake2b(parent, digest_size=32)
        h.update(len(chunk).to_bytes(8, "little"))
        h.update(chunk)
        parent = h.digest()
        digests.append(parent)
    return digests


class NoReplicaAvailable(RuntimeError):
    """Every replica is dead; the API server answers 503."""


@dataclasses.dataclass(frozen=True)
class Route:
    replica: int
    matched_blocks: int  # leading full blocks of this prompt the replica recently saw
    reason: str  # "prefix" (sent for its cached prefix) or "least_loaded"


class PrefixRouter:
    """Cache-aware replica choice within a load bound; remembers recent prefixes per replica."""

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        load_bound: int,
        *,
        max_digests: int = 4096,
        max_prefix_blocks: int | None = None,
    ):
        if num_replicas < 1:
            raise ValueError(f"{num_replicas=} must be at least 1")
        if block_size < 1:
            raise ValueError(f"{block_size=} must be at least 1")
        if load_bound < 0:
            raise ValueError(f"{load_bound=} must be non-negative")
        if max_digests < 1:
            raise ValueError(f"{max_digests=} must be at least 1")
        if max_prefix_blocks is not None and max_prefix_blocks < 1:
            raise ValueError(f"{max_prefix_blocks=} must be at least 1")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.load_bound = load_bound
        self.max_digests = max_digests
        self.max_prefix_blocks = max_prefix_blocks
        # Per replica: digests of prefix blocks recently routed there, oldest first.
        self.recent: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._next = 0  # round-robin cursor for ties among the least loaded

    def pick(self, prompt_ids: Sequence[int], loads: Sequence[int | None], cache_salt: str | None = None) -> Route:
        """Choose a replica for this prompt and remember its prefix there.

        `loads[i]` is replica i's running + waiting sequences, or None if it is dead.
        Raises NoReplicaAvailable when every replica is dead.
        """
        return self.pick_digests(self.prefix_digests(prompt_ids, cache_salt), loads)

    def pick_digests(self, digests: Sequence[bytes], loads: Sequence[int | None]) -> Route:
        """`pick` for a prompt already turned into its digest chain (`prefix_digests` or `chain_digests`)."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"{len(loads)=} != {self.num_replicas=}")
        alive_loads = {i: load for i, load in enumerate(loads) if load is not None}
        alive = list(alive_loads)
        if not alive:
            raise NoReplicaAvailable(f"all {self.num_replicas} replicas are dead")
        matches = {i: self._match(i, digests) for i in alive}
        min_load = min(alive_loads.values())

        best = min(alive, key=lambda i: (-matches[i], alive_loads[i], i))
        if matches[best] > 0 and alive_loads[best] <= min_load + self.load_bound:
            choice, reason = best, "prefix"
        else:
            choice, reason = self._least_loaded(alive_loads, min_load), "least_loaded"
        self._record(choice, digests)
        return Route(choice, matches[choice], reason)

    def forget(self, replica: int) -> None:
        """Drop a replica's recent prefixes (it died or restarted with an empty cache)."""
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"{replica=} not in [0, {self.num_replicas})")
        self.recent[replica].clear()

    def prefix_digests(self, prompt_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """Chained digests of the prompt's full blocks (the first `max_prefix_blocks` if set)."""
        num_blocks = len(prompt_ids) // self.block_size
        if self.max_prefix_blocks is not None:
            num_blocks = min(self.max_prefix_blocks, num_blocks)
        digests: list[bytes] = []
        for i in range(num_blocks):
            chunk = tuple(int(t) for t in prompt_ids[i * self.block_size : (i + 1) * self.block_size])
            # Same extra key as KVCacheManager: the salt on the first block, the chain carries it on.
            extra = (cache_salt,) if cache_salt is not None and i == 0 else ()
            digests.append(hash_block(digests[-1] if digests else None, chunk, extra))
        return digests

    def _match(self, replica: int, digests: Sequence[bytes]) -> int:
        recent = self.recent[replica]
        n = 0
        while n < len(digests) and digests[n] in recent:
            n += 1
        return n

    def _least_loaded(self, alive_loads: dict[int, int], min_load: int) -> int:
        # The first least-loaded replica at or after the cursor, so equal-load replicas alternate.
        tied = [i for i, load in alive_loads.items() if load == min_load]
        choice = next((i for i in tied if i >= self._next), tied[0])
        self._next = (choice + 1) % self.num_replicas
        return choice

    def _record(self, replica: int, digests: Sequence[bytes]) -> None:
        recent = self.recent[replica]
        # Deepest block first, so a prompt's leading blocks are the most recent and a
        # replica's LRU sheds the tails of prefixes before their (more shared) heads.
        for d in reversed(digests):
            recent[d] = None
            recent.move_to_end(d)
        while len(recent) > self.max_digests:
            recent.popitem(last=False)
