"""The engine runs in a thread of its own; the event loop talks to it by commands and queues.

    event loop (uvicorn)                          engine thread
    --------------------                          -------------
    await engine_loop.add(...)  --- command --->  engine.add_request()  (ValueError, QueueFull -> the caller)
    async for delta in generation  <-- queue ---  engine.step() outputs, as StepDeltas
    engine_loop.abort(id)       --- command --->  engine.abort_request()  (frees the KV blocks)

Only the engine thread touches the engine, so it needs no lock, and the event loop never
waits for a model step: `/health` and `/metrics` answer while the model computes. Commands
are applied between steps, so an add or an abort takes effect within one step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from typing import AsyncIterator

from api.metrics import Metrics
from jaxserve.outputs import RequestOutput
from scheduler import SamplingParams, SchedulerStats

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue is at its limit; the server answers 503."""


class EngineDeadError(RuntimeError):
    """The engine thread failed; every request in flight fails with this."""


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


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Stream:
    queue: asyncio.Queue
    finished_samples: set[int] = dataclasses.field(default_factory=set)


_STOP = object()


class EngineLoop:
    """Owns an `LLMEngine` and runs it in a daemon thread.

    `max_waiting` bounds the queue: a request is refused (QueueFullError) when the requests
    already waiting outnumber the free running slots by `max_waiting` or more, so a burst
    that fits in the next batch is never refused, but a backlog beyond it is.
    """

    def __init__(self, engine, metrics: Metrics, *, max_waiting: int | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.stats: SchedulerStats | None = None  # replaced (never mutated) by the engine thread
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle (event loop) ---------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; requests still in flight fail (not hang)."""
        if self._thread is not None:
            self.error = self.error or RuntimeError("the server is shutting down")
            self._commands.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine has stopped: {self.error!r}")

    # -- requests (event loop) ----------------------------------------------------------

    async def add(self, request_id: str, prompt: list[int], params: SamplingParams, *, arrival_time: float,
                  queue: asyncio.Queue, priority: int = 0, cache_salt: str | None = None) -> None:
        """Queue a request whose StepDeltas go to `queue`.

        Raises ValueError (bad input), QueueFullError or EngineDeadError; then nothing runs.
        """
        if self.error is not None:
            raise self.dead_error()
        future = self._loop.create_future()
        self._commands.put(_Add(request_id, prompt, params, arrival_time, priority, cache_salt, queue, future))
        await future

    def abort(self, request_id: str) -> None:
        """Stop a request (if it still runs) and free its blocks; does not wait."""
        self._commands.put(_Abort(request_id))

    def generation(self, request_ids: list[str]) -> Generation:
        return Generation(self, request_ids)

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            commands = self._next_commands()
            if any(c is _STOP for c in commands):
                self._fail_all(commands)
                return
            try:
                for command in commands:
                    self._apply(command)
                outputs = self.engine.step() if self.engine.has_unfinished() else []
            except Exception as e:  # a bug in the engine: fail everything rather than hang
                logger.exception("the engine loop failed")
                self.error = e
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
        if isinstance(command, _Abort):
            if self.engine.abort_request(command.request_id):
                self.metrics.request_aborted(command.request_id)
            self._streams.pop(command.request_id, None)
            return
        sched = self.engine.scheduler
        free_slots = max(0, sched.config.max_num_seqs - len(sched.running))
        if self.max_waiting is not None and len(sched.waiting) - free_slots >= self.max_waiting:
            self.metrics.request_rejected()
            self._resolve(command.future, QueueFullError(
                f"the server is overloaded: {len(sched.waiting)} requests are waiting; try again later"))
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, priority=command.priority,
                                    arrival_time=command.arrival_time, cache_salt=command.cache_salt)
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
        self.stats = self.engine.scheduler.stats()

    def _fail_all(self, commands: list) -> None:
        """Fail every request in flight, and the adds among `commands`, with EngineDeadError."""
        dead = self.dead_error()
        batch = [(s.queue, dead) for s in self._streams.values()]
        self._streams.clear()
        for command in commands:  # adds of this batch not answered yet (_settle skips answered ones)
            if isinstance(command, _Add):
                self._resolve(command.future, dead)
        if batch:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _refuse_forever(self) -> None:
        """After a failure: answer the adds queued behind it, and any that come later."""
        dead = self.dead_error()
        while (command := self._commands.get()) is not _STOP:
            if isinstance(command, _Add):
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

    async def add(self, prompts: list[list[int]], params: SamplingParams, *, arrival_time: float,
                  priority: int = 0, cache_salt: str | None = None) -> None:
        """Queue one engine request per prompt; raises the first error (the rest are aborted on exit)."""
        results = await asyncio.gather(*(
            self.engine_loop.add(rid, prompt, params, arrival_time=arrival_time, queue=self.queue,
                                 priority=priority, cache_salt=cache_salt)
            for rid, prompt in zip(self.request_ids, prompts)
        ), return_exceptions=True)
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
        logprobs = None if c.logprobs is None else list(c.logprobs[n - len(c.new_token_ids): n])
        samples.append(SampleDelta(
            index=c.index, new_text=c.new_text, new_token_ids=list(c.new_token_ids), new_logprobs=logprobs,
            finish_reason=c.finish_reason if newly_finished else None,
            stop_reason=c.stop_reason if newly_finished else None, text=c.text if newly_finished else None,
        ))
    return StepDelta(output.request_id, samples, output.finished, output.num_cached_tokens)


def _put_all(batch) -> None:
    for q, item in batch:
        q.put_nowait(item)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller went away while waiting
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
