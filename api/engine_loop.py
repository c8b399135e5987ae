"""The engine runs in a thread of its own; the event loop talks to it by commands and queues.

    event loop (uvicorn)                          engine thread
    --------------------                          -------------
    engine_loop.admit(k)   (QueueFull -> 503, decided here, on arrival)
    await generation.add(...)   --- command --->  engine.add_request()  (ValueError -> the caller)
    async for delta in generation  <-- queue ---  engine.step() outputs, as StepDeltas
    engine_loop.abort(id)       --- command --->  engine.abort_request()  (frees the KV blocks)
                                <-- snapshot --   scheduler stats after each step

Only the engine thread touches the engine, so it needs no lock, and the event loop never
waits for a model step: `/health` and `/metrics` answer while the model computes. Commands
are applied between steps, so an add or an abort takes effect within one step; admission
does not wait for that, so a burst is refused the moment it arrives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from api.admission import Admitted, EngineDeadError, QueueFullError, Reservation
from api.metrics import Metrics
from jaxserve.engine.outputs import RequestOutput
from jaxserve.lora.request import LoRARequest
from scheduler import SamplingParams, SchedulerStats, SpecDecodingStats

if TYPE_CHECKING:
    from jaxserve.model.kv_cache import KVHandoff

logger = logging.getLogger(__name__)


class EngineSnapshot(NamedTuple):
    """What the engine thread publishes after each step, replaced whole (never mutated)."""

    stats: SchedulerStats
    sequences_taken: int  # sequences of all the adds the engine thread has applied (queued or refused)


@dataclasses.dataclass(frozen=True)
class SampleDelta:
    """What one of a request's n samples gained in one step."""

    index: int
    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None  # one {token_id: logprob} per new token
    finish_reason: str | None  # set on the one delta where the sample finished
    stop_reason: int | str | None
    text: str | None  # the engine's whole text, on the finishing delta only


@dataclasses.dataclass(frozen=True)
class StepDelta:
    """One engine request's progress in one step: only the samples that changed."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    num_cached_tokens: int
    prompt_logprobs: list | None = None  # RequestOutput.prompt_logprobs, on the request's first delta
    kv_handoff: KVHandoff | None = None  # RequestOutput.kv_handoff, on the finishing delta
    spec_decoding: SpecDecodingStats | None = None  # RequestMetrics.spec_decoding, on the finishing delta


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int
    cache_salt: str | None
    queue: asyncio.Queue
    future: asyncio.Future
    kv_handoff: KVHandoff | None = None  # the prompt's KV from a prefill server (api.disagg)
    export_kv: bool = False  # hand the prompt's KV over when done
    lora_request: LoRARequest | None = None  # the LoRA adapter the request's `model` names


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Call:
    fn: Callable[[Any], Any]  # called with the engine, between steps
    future: asyncio.Future


@dataclasses.dataclass
class _Stream:
    queue: asyncio.Queue
    finished_samples: set[int] = dataclasses.field(default_factory=set)
    sent_prompt_logprobs: bool = False


_STOP = object()
_FAILED = object()  # fail() was called: the engine thread stops stepping


class EngineLoop:
    """Owns an `LLMEngine` and runs it in a daemon thread.

    `max_waiting` bounds the queue, in engine sequences (a prompt with `n` samples is n): a
    call is refused (QueueFullError) when the sequences already waiting outnumber the free
    running slots by `max_waiting` or more, so a burst that fits in the next batch is never
    refused, but a backlog beyond it is, and an idle server admits any call.
    """

    def __init__(self, engine, metrics: Metrics, *, max_waiting: int | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.max_num_seqs = engine.scheduler.config.max_num_seqs
        self.snapshot: EngineSnapshot | None = None  # replaced (never mutated) by the engine thread
        # Event loop only: sequences admitted so far, less reservations given back. Those not
        # yet taken by the engine thread (admitted - snapshot.sequences_taken) are in transit:
        # waiting, though no published stats count them yet.
        self.admitted = Admitted()
        self._taken = 0  # engine thread only; published in the snapshot
        self.error: BaseException | None = None
        # When a step raises, what else may have caused it, asked before the requests fail: over
        # several nodes a lost node breaks the step's collectives a moment before the watchdog
        # names it (jaxserve.parallel.multihost.Leader.wait_failure).
        self.explain_failure: Callable[[], str | None] | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._step_started: float | None = None  # engine thread: monotonic time of the step it is in

    # -- lifecycle (event loop) ---------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, daemon=True, name="engine-loop")
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; requests still in flight fail (not hang)."""
        if self._thread is not None:
            self.error = self.error or RuntimeError("the server is shutting down")
            self._commands.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    def fail(self, reason: str) -> None:
        """Stop serving from another thread, now: the engine cannot go on (a node of several was
        lost, jaxserve.parallel.multihost) and its thread may wait in a step that never finishes.
        Every request in flight gets EngineDeadError with `reason`; `/health` turns 503."""
        self.error = RuntimeError(reason)
        if self._loop is None:  # not started: nothing in flight
            return
        dead = self.dead_error()
        streams = list(self._streams.values())  # a copy: the engine thread, if it ever returns, fails them too
        self._loop.call_soon_threadsafe(_put_all, [(s.queue, dead) for s in streams])
        self._refuse_queued()  # adds the engine thread has not taken: it may never take them
        self._commands.put(_FAILED)  # wakes an idle engine thread, which then refuses every add

    def _refuse_queued(self) -> None:
        """Answer every add still queued with EngineDeadError (any thread; after a failure)."""
        dead = self.dead_error()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is _STOP:  # for the engine thread
                self._commands.put(_STOP)
                return
            if isinstance(command, (_Add, _Call)):
                self._resolve(command.future, dead)

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def stalled_for(self) -> float:
        """Seconds the engine thread has been inside one step (0 between steps): a hung
        engine has work and makes no progress."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine has stopped: {self.error!r}")

    @property
    def stats(self) -> SchedulerStats | None:
        return self.snapshot.stats if self.snapshot is not None else None

    # -- requests (event loop) ----------------------------------------------------------

    def admit(self, num_sequences: int) -> Reservation:
        """Decide, on arrival, whether a call of `num_sequences` engine sequences may queue.

        Raises QueueFullError. The decision reads the engine's last snapshot plus the
        sequences admitted since (in transit), never the engine itself, so it is immediate
        even while the engine thread is busy with a step. (A dead engine is reported when the
        requests are sent, so a request that is wrong anyway still gets its 400.)
        """
        if self.max_waiting is not None:
            stats, taken = self.snapshot
            waiting = stats.num_waiting + self.admitted.count - taken
            free_slots = max(0, self.max_num_seqs - stats.num_running)
            if waiting - free_slots >= self.max_waiting:
                self.metrics.request_rejected()
                raise QueueFullError(f"the server is overloaded: {waiting} sequences are waiting; try again later")
        return self.admitted.reserve(num_sequences)

    @property
    def backlog(self) -> int:
        """Sequences waiting (in transit included) beyond the free running slots, as `admit` counts them."""
        stats, taken = self.snapshot
        return stats.num_waiting + self.admitted.count - taken - max(0, self.max_num_seqs - stats.num_running)

    @property
    def load(self) -> int:
        """Running + waiting sequences, in transit included: what a router balances."""
        stats, taken = self.snapshot
        return stats.num_running + stats.num_waiting + self.admitted.count - taken

    def _submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        arrival_time: float,
        queue: asyncio.Queue,
        priority: int,
        cache_salt: str | None,
        kv_handoff: KVHandoff | None = None,
        export_kv: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> asyncio.Future:
        """Send a request to the engine thread now; the future fails with ValueError (bad
        input) or EngineDeadError, and then nothing runs."""
        future = self._loop.create_future()
        if self.error is not None:
            future.set_exception(self.dead_error())
            return future
        self._commands.put(
            _Add(
                request_id,
                prompt,
                params,
                arrival_time,
                priority,
                cache_salt,
                queue,
                future,
                kv_handoff,
                export_kv,
                lora_request,
            )
        )
        if self.error is not None:  # fail() ran meanwhile, from another thread
            self._refuse_queued()
        return future

    def abort(self, request_id: str) -> None:
        """Stop a request (if it still runs) and free its blocks; does not wait."""
        self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[Any], Any]) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread between two steps (the engine is not
        thread-safe); the future gets its result or its exception."""
        future = self._loop.create_future()
        if self.error is not None:
            future.set_exception(self.dead_error())
            return future
        self._commands.put(_Call(fn, future))
        if self.error is not None:  # fail() ran meanwhile, from another thread
            self._refuse_queued()
        return future

    def generation(self, request_ids: list[str]) -> Generation:
        return Generation(self, request_ids)

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            commands = self._next_commands()
            if any(c is _STOP for c in commands):
                self._fail_all(commands)
                return
            if self.error is not None:  # fail() from another thread
                self._fail_all(commands)
                return self._refuse_forever()
            try:
                for command in commands:
                    self._apply(command)
                outputs = []
                if self.engine.has_unfinished():
                    self._step_started = time.monotonic()
                    outputs = self.engine.step()
                    self._step_started = None
            except Exception as e:  # a bug in the engine: fail everything rather than hang
                logger.exception("the engine loop failed")
                cause = self.explain_failure() if self.explain_failure is not None else None
                # fail() from another thread may have said why first
                self.error = self.error or (RuntimeError(cause) if cause else e)
                self._fail_all(commands)
                return self._refuse_forever()
            self._deliver(outputs)
            self._publish_stats()

    def _next_commands(self) -> list:
        """Everything queued; when the engine is idle, block until something arrives."""
        commands = []
        if not self.engine.has_unfinished():
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command) -> None:
        if command is _FAILED:  # the next turn of _run sees the error
            return
        if isinstance(command, _Abort):
            if self.engine.abort_request(command.request_id):
                self.metrics.request_aborted(command.request_id)
            self._streams.pop(command.request_id, None)
            return
        if isinstance(command, _Call):
            try:
                result = command.fn(self.engine)
            except Exception as e:  # the caller's to report
                self._resolve(command.future, e)
            else:
                self._loop.call_soon_threadsafe(_settle, command.future, None, result)
            return
        self._taken += command.params.n  # queued or refused below, it is no longer in transit
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                priority=command.priority,
                arrival_time=command.arrival_time,
                cache_salt=command.cache_salt,
                kv_handoff=command.kv_handoff,
                export_kv=command.export_kv,
                lora_request=command.lora_request,
            )
        except Exception as e:  # ValueError is the client's fault; anything else is reported as ours
            self._resolve(command.future, e)
            return
        self._streams[command.request_id] = _Stream(command.queue)
        self.metrics.request_added(command.request_id, len(command.prompt))
        self._resolve(command.future, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for output in outputs:
            self.metrics.record(output)
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            batch.append((stream.queue, _delta(output, stream)))
            if output.finished:
                del self._streams[output.request_id]
        if batch:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _publish_stats(self) -> None:
        self.snapshot = EngineSnapshot(self.engine.scheduler.stats(), self._taken)

    def _fail_all(self, commands: list) -> None:
        """Fail every request in flight, and the adds among `commands`, with EngineDeadError."""
        dead = self.dead_error()
        batch = [(s.queue, dead) for s in self._streams.values()]
        self._streams.clear()
        for command in commands:  # adds of this batch not answered yet (_settle skips answered ones)
            if isinstance(command, (_Add, _Call)):
                self._resolve(command.future, dead)
        if batch:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _refuse_forever(self) -> None:
        """After a failure: answer the adds queued behind it, and any that come later."""
        dead = self.dead_error()
        while (command := self._commands.get()) is not _STOP:
            if isinstance(command, (_Add, _Call)):
                self._resolve(command.future, dead)

    def _resolve(self, future: asyncio.Future, error: BaseException | None) -> None:
        self._loop.call_soon_threadsafe(_settle, future, error)


class Generation:
    """The StepDeltas of one API call's engine requests (one per prompt), as they come.

    Use as `async with`: leaving early (an error, a client that went away) aborts every
    request that has not finished, which frees its KV blocks.
    """

    def __init__(self, engine_loop: EngineLoop, request_ids: list[str]):
        self.engine_loop = engine_loop
        self.request_ids = list(request_ids)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(request_ids)

    async def add(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        reservation: Reservation,
        *,
        arrival_time: float,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_handoff: KVHandoff | None = None,
        export_kv: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue one engine request per prompt, in the room `reservation` holds for them;
        raises the first error (the rest are aborted on exit). `kv_handoff`, `export_kv`:
        LLMEngine.add_request's, for a single prompt."""
        reservation.spend(len(prompts) * params.n)
        # NOTE: every command is sent before the first await, so a call cancelled while it
        # waits has sent all its requests, and `close` aborts every one of them.
        futures = [
            self.engine_loop._submit(
                rid,
                prompt,
                params,
                arrival_time=arrival_time,
                queue=self.queue,
                priority=priority,
                cache_salt=cache_salt,
                kv_handoff=kv_handoff,
                export_kv=export_kv,
                lora_request=lora_request,
            )
            for rid, prompt in zip(self.request_ids, prompts)
        ]
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def __aiter__(self) -> AsyncIterator[StepDelta]:
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield item

    def close(self) -> None:
        """Abort whatever has not finished (idempotent)."""
        for request_id in self.unfinished:
            self.engine_loop.abort(request_id)
        self.unfinished.clear()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


def _delta(output: RequestOutput, stream: _Stream) -> StepDelta:
    """Copy what the step changed, so the event loop never reads lists the engine still appends to."""
    samples = []
    for c in output.outputs:
        newly_finished = c.finished and c.index not in stream.finished_samples
        if not (c.new_token_ids or c.new_text or newly_finished):
            continue
        if newly_finished:
            stream.finished_samples.add(c.index)
        n = len(c.token_ids)
        logprobs = None if c.logprobs is None else list(c.logprobs[n - len(c.new_token_ids) : n])
        samples.append(
            SampleDelta(
                index=c.index,
                new_text=c.new_text,
                new_token_ids=list(c.new_token_ids),
                new_logprobs=logprobs,
                finish_reason=c.finish_reason if newly_finished else None,
                stop_reason=c.stop_reason if newly_finished else None,
                text=c.text if newly_finished else None,
            )
        )
    prompt_logprobs = None
    if output.prompt_logprobs is not None and not stream.sent_prompt_logprobs:
        stream.sent_prompt_logprobs = True  # complete once a token is out; never appended to again
        prompt_logprobs = list(output.prompt_logprobs)
    return StepDelta(
        output.request_id,
        samples,
        output.finished,
        output.num_cached_tokens,
        prompt_logprobs,
        output.kv_handoff,
        output.metrics.spec_decoding,
    )


def _put_all(batch) -> None:
    for q, item in batch:
        q.put_nowait(item)


def _settle(future: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
    if future.done():  # the caller went away while waiting
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
