"""Continuous batching: every step retires finished requests and admits waiting ones.

    batch = scheduler.schedule()              # which tokens run this step (a StepBatch)
    sampled = runner.dispatch(batch).fetch()  # one token per scheduled row
    results = scheduler.update(batch, sampled)

There are no prefill and decode phases: each running request has uncomputed tokens
(a whole prompt, the rest of a chunked prompt, or the one token sampled last step) and
gets as many as the token budget allows. Running decodes are served first, so their
inter-token latency stays bounded while long prompts are prefilled in chunks. When the
block pool runs dry, the latest-admitted request is preempted: its blocks are freed and
it is recomputed later (the prefix cache often makes that cheap).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from scheduler.batch_builder import banned_token_ids, build_step_batch
from scheduler.draft_tree import DraftTree
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.lora_slots import LoRASlots
from scheduler.request import Request, RequestStatus
from scheduler.spec_stats import SpecDecodingStats
from scheduler.step_batch import MAX_BANNED_TOKENS, StepBatch


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int  # per layer, the null block included
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    # Most tokens one request's prefill may take in a step (0: whatever budget is left).
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    # The most draft tokens a request may verify in one step (speculative decoding; 0: off).
    num_speculative_tokens: int = 0
    # Their shape: a tree of candidates (None: a chain of num_speculative_tokens).
    draft_tree: DraftTree | None = None
    # LoRA adapters resident on the device at once (0: LoRA off; see scheduler/lora_slots.py).
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"{self.max_num_batched_tokens=} must be >= {self.max_num_seqs=}")
        if self.block_size < 1 or self.num_blocks < 2:
            raise ValueError(f"{self.block_size=} must be >= 1 and {self.num_blocks=} >= 2")
        if self.draft_tree is not None and self.draft_tree.num_nodes != self.num_speculative_tokens:
            raise ValueError(
                f"a draft tree of {self.draft_tree.num_nodes} nodes verifies that many tokens, "
                f"not {self.num_speculative_tokens=}"
            )

    @property
    def tree(self) -> DraftTree | None:
        """The drafts' shape, a chain unless a tree was given (None: no speculation)."""
        if self.draft_tree is not None or not self.num_speculative_tokens:
            return self.draft_tree
        return DraftTree.chain(self.num_speculative_tokens)


class SchedulerStats(NamedTuple):
    """A snapshot for metrics: queue lengths, KV-cache occupancy, prefix-cache counters."""

    num_running: int
    num_waiting: int  # forked samples waiting for their parent's prompt included
    num_free_blocks: int
    num_total_blocks: int  # usable blocks (the null block excluded)
    kv_cache_usage: float  # fraction of usable blocks held by some request
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int
    num_preemptions: int
    spec_decoding: SpecDecodingStats | None = None  # a copy; None without speculative decoding

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class StepResult(NamedTuple):
    """A request that sampled tokens this step (`row` indexes the step's outputs; its last
    `num_tokens` outputs are new), or that the scheduler ended without one (`row` is None)."""

    request: Request
    row: int | None
    num_tokens: int = 1  # more than one when draft tokens were accepted


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: list[Request] = []  # sorted by Request.sort_key
        self.running: list[Request] = []  # in admission order
        self.forks: dict[str, list[Request]] = {}  # parent id -> samples waiting for its prompt
        self.ended_without_token: list[Request] = []  # reported by the next update()
        self._step_id = 0
        self._in_flight: dict[int, list[Request]] = {}  # step id -> its rows' requests, until update()
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache and found there, once per admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.spec_stats = SpecDecodingStats()
        self._tree = config.tree
        self.lora_slots = LoRASlots(config.max_loras) if config.max_loras else None

    # -- requests in and out ----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError (and queues nothing) if it can never run."""
        self.check_request(request)
        self.requests[request.request_id] = request
        parent = request.fork_of
        if parent is not None and parent.request_id in self.requests and parent.num_output_tokens == 0:
            self.forks.setdefault(parent.request_id, []).append(request)
        else:
            self._enqueue(request)

    def check_request(self, request: Request) -> None:
        cfg = self.config
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError("the prompt is empty")
        if self.kv.blocks_needed(n + 1) > cfg.num_blocks - 1:
            raise ValueError(
                f"the prompt has {n} tokens, but the KV cache holds at most "
                f"{(cfg.num_blocks - 1) * cfg.block_size} tokens in all; raise the KV-cache memory"
            )
        if n >= cfg.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, but the model's context is {cfg.max_model_len} tokens "
                "(prompt plus at least one generated token)"
            )
        if request.lora_id is not None and self.lora_slots is None:
            raise ValueError("the request asks for a LoRA adapter, but LoRA is not enabled (max_loras=0)")
        if request.sampling_params.min_tokens and len(banned_token_ids(request)) > MAX_BANNED_TOKENS:
            raise ValueError(f"with min_tokens, at most {MAX_BANNED_TOKENS} stop_token_ids (with eos) are supported")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks; False if it is unknown or done."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.stop_reason = stop_reason
        self._finish(request, status)
        return True

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ---------------------------------------------------------------------

    def schedule(self) -> StepBatch | None:
        """Pick this step's tokens; None when nothing can run."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[str, tuple[Request, int]] = {}
        preempted = False

        # Running requests: decodes first, then prefill chunks, each in admission order. A
        # request whose pending token already ends it by length is not run again.
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1 and not self._at_length(r)]
        chunks = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + chunks:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk(req, budget)
            req.spec_token_ids = self._drafts(req, n, budget)
            n += len(req.spec_token_ids)
            while self.kv.allocate_slots(req, n) is None:
                victim = self._pick_victim()
                if victim is req and len(self.running) == 1:
                    # Alone and still out of room: its context outgrew the whole KV cache.
                    self._finish(req, RequestStatus.FINISHED_LENGTH)
                    self.ended_without_token.append(req)
                    break
                preempted = True
                self._preempt(victim)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)[1]
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = (req, n)
                budget -= n

        # Admit waiting requests in service order while there is room.
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not preempted:
            req = self.waiting[0]
            if req.lora_id is not None and self.lora_slots and not self.lora_slots.can_acquire(req.lora_id):
                break  # every adapter slot is pinned by running requests: it waits for one (first come first served)
            holds_blocks = bool(self.kv.tables.get(req.request_id))  # a forked sample
            # Prompt logprobs need every prompt position's logits: computed, not taken from the cache.
            cached = [] if holds_blocks or req.needs_prompt_logprobs else self.kv.find_cached_prefix(req)
            num_cached = len(cached) * cfg.block_size
            n = min(req.num_uncomputed_tokens - num_cached, budget, self._chunk_limit)
            while (allocated := self.kv.allocate_slots(req, n, cached)) is None:
                holders = [r for r in self._provisional_holders() if r is not req]
                if not holders:
                    break
                self._preempt(holders[-1])
            if allocated is None:
                break  # first come first served: nobody overtakes the head of the queue
            self.waiting.pop(0)
            if req.lora_id is not None and self.lora_slots:
                self.lora_slots.acquire(req.lora_id)
            req.spec_token_ids = []
            req.num_computed_tokens += num_cached
            if self.kv.enable_prefix_caching and not holds_blocks:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_cached
            if req.num_preemptions == 0 and not holds_blocks:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = (req, n)
            budget -= n

        if not scheduled:
            return None  # NOTE: requests ended above are reported by the next update()
        rows = list(scheduled.values())
        tables = [self.kv.tables[r.request_id] for r, _ in rows]
        self._step_id += 1
        batch = build_step_batch(self._step_id, rows, tables, cfg.block_size, self.kv.take_copies(), self._tree)
        if self.lora_slots is not None:
            row_slots = [0 if r.lora_id is None else self.lora_slots.slot_of(r.lora_id) for r, _ in rows]
            batch.lora_slots = np.repeat(np.asarray(row_slots, np.int32), batch.num_scheduled_tokens)
            batch.lora_loads = self.lora_slots.take_loads()
        # The step's tokens count as computed now, and a row that reaches the end of its
        # request samples a pending token: the next step can be scheduled at once. Draft
        # tokens count once they are verified (update()); rejected ones are simply
        # overwritten later, never erased.
        for row, (req, n) in enumerate(rows):
            req.num_computed_tokens += n - len(req.spec_token_ids)
            req.spec_token_ids = []
            if req.num_computed_tokens == req.num_tokens:
                req.num_pending += 1
                req.pending_row = row
        self._in_flight[self._step_id] = [req for req, _ in rows]
        return batch

    def update(
        self, batch: StepBatch | None, sampled_token_ids: npt.ArrayLike = (), num_sampled: npt.ArrayLike | None = None
    ) -> list[StepResult]:
        """Write a step's results back: the sampled tokens' ids, finished requests.

        `sampled_token_ids` has one token per row, or with draft tokens in the step a row
        of tokens per row of which the first `num_sampled[row]` are real: the accepted
        drafts and the token sampled after them.

        Call it once for every batch schedule() returned, in order (with the overlapped
        loop, after the next step has been scheduled), and with None when schedule()
        returned None, to collect requests that ended without a token.
        """
        results = [StepResult(req, None) for req in self.ended_without_token]
        self.ended_without_token.clear()
        if batch is None:
            return results
        tokens = np.asarray(sampled_token_ids).tolist()  # Python ints, once, not per row
        counts = None if num_sampled is None else np.asarray(num_sampled).tolist()
        num_drafts = batch.num_spec_tokens.tolist()
        for row, (req, samples) in enumerate(zip(self._in_flight.pop(batch.step_id), batch.samples.tolist())):
            if req.is_finished:
                continue  # ended (EOS, a stop string, an abort) after this step was scheduled
            if not samples:
                self.kv.cache_full_blocks(req)
                continue  # a prefill chunk that did not reach the end: nothing sampled
            new = [tokens[row]] if counts is None else tokens[row][: counts[row]]
            if num_drafts[row]:
                self.spec_stats.observe(num_drafts[row], len(new) - 1)
                req.spec_stats.observe(num_drafts[row], len(new) - 1)
                req.draft_length.observe(num_drafts[row], len(new) - 1)
            req.num_pending += len(new) - 1  # accepted drafts arrive like sampled tokens
            status, appended = None, 0
            for token in new:
                req.append_output(token)
                appended += 1
                status = self._stop_status(req, token)
                if status is not None:
                    break
            req.num_pending -= len(new) - appended  # tokens after a stop are dropped
            # Accepted drafts were computed by this step (their K/V is written).
            req.num_computed_tokens += min(len(new) - 1, appended)
            self.kv.cache_full_blocks(req)
            if self.forks:
                # A preempted parent has no blocks to share: its samples start from scratch.
                self._release_forks(req, fork=req.status == RequestStatus.RUNNING)
            if status is not None:
                self._finish(req, status)
            results.append(StepResult(req, row, appended))
        return results

    # -- helpers ----------------------------------------------------------------------

    @property
    def _chunk_limit(self) -> int:
        return self.config.long_prefill_token_threshold or self.config.max_num_batched_tokens

    def _chunk(self, req: Request, budget: int) -> int:
        return min(req.num_tokens - req.num_computed_tokens, budget, self._chunk_limit)

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The request's draft tokens that fit this step: after its one decode token, within
        the token budget, max_tokens, the context, and room in the block pool."""
        if not req.spec_token_ids or n != 1 or req.num_tokens - req.num_computed_tokens != 1:
            return []
        assert self._tree is not None, "requests carry draft tokens only when speculating"
        # A tree keeps a BFS prefix: its nodes within the depth that max_tokens and the
        # context leave, as many as the budget has room for.
        depth = min(
            req.sampling_params.max_tokens - req.num_output_tokens - 1, self.config.max_model_len - req.num_tokens
        )
        # Each node also takes a KV slot of its own after the last token (siblings share a
        # depth, not a slot), and the slots end with the context's last block.
        bs = self.config.block_size
        slots = -(-self.config.max_model_len // bs) * bs - req.num_tokens
        limit = min(self._tree.nodes_within(depth), budget - 1, slots)
        if req.max_drafts is not None:
            limit = min(limit, req.max_drafts)
        drafts = req.spec_token_ids[: max(limit, 0)]
        if drafts and self.kv.allocate_slots(req, 1 + len(drafts)) is None:
            return []  # no room to speculate: a plain decode step, no preemption for drafts
        return drafts

    def _at_length(self, req: Request) -> bool:
        """Its pending tokens reach max_tokens or the context: it ends when they arrive."""
        return req.num_output_tokens >= req.sampling_params.max_tokens or req.num_tokens >= self.config.max_model_len

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        p = req.sampling_params
        if req.grammar is not None and req.grammar.error is not None:
            return RequestStatus.FINISHED_ABORTED  # its grammar engine gave up (logged): no unconstrained text
        num_output = len(req.output_token_ids)
        if num_output >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= p.max_tokens or len(req.all_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _pick_victim(self) -> Request:
        """Who gives up its blocks: a forked sample still waiting to run, else the least
        important running request, and among equals the latest admitted."""
        holders = self._provisional_holders()
        if holders:
            return holders[-1]
        return max(reversed(self.running), key=lambda r: r.priority)

    def _provisional_holders(self) -> list[Request]:
        """Forked samples that have not run yet: they hold their parent's blocks only provisionally."""
        return [r for r in self.waiting if self.kv.tables.get(r.request_id)]

    def _preempt(self, req: Request) -> None:
        """Free the request's blocks; it is recomputed from its first token when readmitted."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._unpin_lora(req)
            req.status = RequestStatus.PREEMPTED
            self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._unpin_lora(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:  # a sample still waiting for its parent's prompt
            siblings = self.forks.get(req.fork_of.request_id, []) if req.fork_of else []
            if req in siblings:
                siblings.remove(req)
        self._release_forks(req, fork=False)
        self.kv.free(req)
        req.status = status
        del self.requests[req.request_id]

    def _unpin_lora(self, req: Request) -> None:
        """A request leaves the running set: its adapter's slot may be reused once nobody runs it."""
        if req.lora_id is not None and self.lora_slots:
            self.lora_slots.release(req.lora_id)

    def _release_forks(self, parent: Request, fork: bool) -> None:
        """Start the samples waiting on `parent`: sharing its prompt's blocks once the prompt
        is computed (`fork`), or from scratch if the parent ends before that."""
        for child in self.forks.pop(parent.request_id, []):
            if fork:
                # The child re-runs the last prompt token to sample its own first token; its
                # write goes to a copy of the shared last block (copy-on-write).
                child.num_computed_tokens = parent.num_prompt_tokens - 1
                self.kv.fork(parent, child, parent.num_prompt_tokens)
            self._enqueue(child)

    # -- introspection ----------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + sum(len(f) for f in self.forks.values()),
            num_free_blocks=pool.num_free,
            num_total_blocks=pool.num_blocks - 1,
            kv_cache_usage=pool.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decoding=dataclasses.replace(
                self.spec_stats, accepted_per_position=list(self.spec_stats.accepted_per_position)
            )
            if self.config.num_speculative_tokens
            else None,
        )

    def check_integrity(self) -> None:
        """Assert the invariants the property tests rely on."""
        self.kv.check_integrity()
        if self.lora_slots is not None:
            self.lora_slots.check_integrity()
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in self.waiting)
        assert len(self.running) <= self.config.max_num_seqs
        holders = {r.request_id for r in self.running} | {r.request_id for r in self.waiting}
        assert set(self.kv.tables) <= holders, "a request that is not queued holds blocks"
        queued = self.running + self.waiting + [c for cs in self.forks.values() for c in cs]
        assert sorted(r.request_id for r in queued) == sorted(self.requests), "request bookkeeping is off"
