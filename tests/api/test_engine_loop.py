"""The engine thread's contract, with a scripted stand-in for the engine (no model, fast):
an engine failure fails every request in flight and turns /health to 503 instead of
hanging; closing a generation aborts its requests; the queue limit refuses on arrival,
even while the engine thread is stuck in a step."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from api.admission import EngineDeadError, QueueFullError
from api.engine_loop import EngineLoop
from api.metrics import Metrics
from api.server import create_app
from jaxserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from scheduler import SamplingParams, SchedulerStats
from tests.api.conftest import serve_in_thread


class ScriptedScheduler:
    """The queue counts the engine loop reads; tests set `waiting` by hand."""

    def __init__(self, max_num_seqs: int):
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs, num_blocks=9)
        self.running: list = []
        self.waiting: list = []

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), 8, 8, 0.0, 0, 0, 0)


class ScriptedEngine:
    """One token ("a") per request per step; `fail_at_step` makes step() raise; with a
    `gate`, every step waits for it (and `in_step` tells that one has begun)."""

    def __init__(self, fail_at_step: int | None = None, max_num_seqs: int = 4, gate: threading.Event | None = None):
        self.fail_at_step = fail_at_step
        self.gate = gate
        self.in_step = threading.Event()
        self.steps = 0
        self.requests: dict[str, list] = {}
        self.aborted: list[str] = []
        self.tokenizer = None
        self.max_model_len = 64
        self.loaded = SimpleNamespace(source="/models/scripted-model", config=SimpleNamespace(vocab_size=100))
        self.generation = SimpleNamespace(sampling={})  # no generation_config.json defaults
        self.scheduler = ScriptedScheduler(max_num_seqs)

    def add_request(
        self,
        request_id,
        prompt,
        params,
        *,
        priority=0,
        arrival_time=None,
        cache_salt=None,
        kv_handoff=None,
        export_kv=False,
        lora_request=None,
    ):
        if not prompt:
            raise ValueError("the prompt is empty")
        self.requests[request_id] = [params, [], arrival_time]

    def has_unfinished(self):
        return bool(self.requests)

    def cache_config_info(self):
        return {"block_size": "4", "cache_dtype": "auto", "num_gpu_blocks": "8"}

    def device_bytes(self):
        return {"weights": {0: 1024}, "kv_cache": {0: 512}}

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        return self.requests.pop(request_id, None) is not None

    def step(self):
        self.in_step.set()
        if self.gate is not None and not self.gate.wait(60):
            raise RuntimeError("the test never opened the gate")
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("device fell over")
        time.sleep(0.01)
        outputs = []
        for request_id, (params, tokens, arrival) in list(self.requests.items()):
            tokens.append(7)
            done = len(tokens) >= params.max_tokens
            now = time.monotonic()
            completion = CompletionOutput(
                0,
                "a" * len(tokens),
                list(tokens),
                0.0,
                None,
                "length" if done else None,
                None,
                new_text="a",
                new_token_ids=[7],
            )
            metrics = RequestMetrics(arrival, now, now, now if done else None, [now])
            outputs.append(RequestOutput(request_id, None, [1, 2], [completion], done, 0, metrics))
            if done:
                del self.requests[request_id]
        return outputs


async def _started(engine, **kw) -> EngineLoop:
    loop = EngineLoop(engine, Metrics("scripted"), **kw)
    loop.start()
    return loop


def test_engine_failure_fails_requests_in_flight_and_later_ones():
    async def scenario():
        engine = ScriptedEngine(fail_at_step=3)
        loop = await _started(engine)
        generation = loop.generation(["r1"])
        await generation.add([[1, 2]], SamplingParams(max_tokens=10), loop.admit(1), arrival_time=time.monotonic())
        deltas = []
        with pytest.raises(EngineDeadError):
            async with generation:
                async for delta in generation:
                    deltas.append(delta)
        assert len(deltas) == 2  # the two steps before the failure
        assert not loop.is_alive
        with pytest.raises(EngineDeadError):
            await loop.generation(["r2"]).add([[1]], SamplingParams(), loop.admit(1), arrival_time=0.0)
        loop.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_failed_step_is_explained_by_what_broke_it():
    # Over several nodes a lost node breaks the step's collectives a moment before the
    # watchdog names it: the requests get the watchdog's reason, not the collective's error.
    async def scenario():
        loop = await _started(ScriptedEngine(fail_at_step=2))
        loop.explain_failure = lambda: "node 1 of 2 closed its control connection"
        generation = loop.generation(["r1"])
        await generation.add([[1, 2]], SamplingParams(max_tokens=10), loop.admit(1), arrival_time=time.monotonic())
        with pytest.raises(EngineDeadError, match="node 1 of 2 closed its control connection"):
            async with generation:
                async for _ in generation:
                    pass
        loop.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_closing_a_generation_aborts_it():
    async def scenario():
        engine = ScriptedEngine()
        loop = await _started(engine)
        generation = loop.generation(["a", "b"])
        await generation.add([[1], [2]], SamplingParams(max_tokens=1000), loop.admit(2), arrival_time=time.monotonic())
        async with generation:
            async for _ in generation:
                break  # the caller goes away after the first delta
        for _ in range(200):
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
        assert sorted(engine.aborted) == ["a", "b"] and not engine.requests
        assert loop.metrics.finished["abort"] == 2
        loop.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_shutdown_fails_requests_in_flight():
    async def scenario():
        loop = await _started(ScriptedEngine())
        generation = loop.generation(["long"])
        await generation.add([[1]], SamplingParams(max_tokens=10**6), loop.admit(1), arrival_time=time.monotonic())
        await asyncio.sleep(0.05)
        loop.stop()
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in generation:
                pass
        with pytest.raises(EngineDeadError):
            await loop.generation(["late"]).add([[1]], SamplingParams(), loop.admit(1), arrival_time=0.0)

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_queue_limit_counts_waiting_and_in_transit_beyond_free_slots():
    async def scenario():
        engine = ScriptedEngine(max_num_seqs=4)
        engine.scheduler.waiting = ["w"] * 5  # published at start: 4 free slots, 1 waiting beyond them
        loop = await _started(engine, max_waiting=2)
        held = loop.admit(1)  # 1 beyond the free slots: under the limit of 2
        with pytest.raises(QueueFullError):
            loop.admit(1)  # the one admitted is in transit, so 2 wait beyond the free slots: full
        held.release()  # a call that fails before reaching the engine gives its room back
        reservation = loop.admit(1)
        with pytest.raises(ValueError, match="empty"):  # the engine takes it, and refuses it
            await loop.generation(["bad"]).add([[]], SamplingParams(max_tokens=1), reservation, arrival_time=0.0)
        while loop.snapshot.sequences_taken < 1:  # no longer in transit once a snapshot says so
            await asyncio.sleep(0.01)
        loop.admit(1)
        with pytest.raises(QueueFullError):
            loop.admit(3)
        assert loop.metrics.rejected == 2
        loop.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_burst_is_refused_on_arrival_while_the_engine_is_stuck_in_a_step():
    """The 503s are decided on the event loop, so they come back while the engine thread
    cannot apply anything; and exactly the calls beyond max_waiting are refused."""
    engine = ScriptedEngine(max_num_seqs=2, gate=threading.Event())
    body = {"prompt": [1, 2], "max_tokens": 2}

    async def scenario(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            first = asyncio.create_task(http.post("/v1/completions", json=body))
            while not engine.in_step.is_set():  # the engine thread is now held in a step with `first`
                await asyncio.sleep(0.01)
            burst = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(10)]
            # `first` in transit, 2 free slots, max_waiting 2: three more fit, seven are refused.
            deadline = time.monotonic() + 10
            while sum(t.done() for t in burst) < 7 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # and no others come back while the engine is held
            refused = [t.result() for t in burst if t.done()]
            assert engine.steps == 0 and not first.done()
            engine.gate.set()
            accepted = await asyncio.gather(first, *(t for t in burst if not t.done()))
        return refused, accepted

    with serve_in_thread(create_app(engine, max_waiting=2)) as url:
        refused, accepted = asyncio.run(scenario(url))
        assert [r.status_code for r in refused] == [503] * 7
        for r in refused:
            assert r.json()["error"]["code"] == "server_overloaded" and r.headers["retry-after"] == "1"
        assert [r.status_code for r in accepted] == [200] * 4
        assert all(r.json()["choices"][0]["text"] == "aa" for r in accepted)


def test_failing_from_another_thread_answers_every_request_while_the_engine_is_stuck_in_a_step():
    """What a lost node of several does (jaxserve.parallel.multihost): the engine thread waits
    in a step that will never finish; the request in that step, one queued behind it and a
    later one all get the reason at once, and /health turns 503 with it."""
    engine = ScriptedEngine(gate=threading.Event())  # never set: the step never ends
    body = {"prompt": [1, 2], "max_tokens": 2}
    reason = "node 1 of 2 did not finish step 7 within 3 s"

    async def scenario(url, loop):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            in_step = asyncio.create_task(http.post("/v1/completions", json=body))
            while not engine.in_step.is_set():
                await asyncio.sleep(0.01)
            queued = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.sleep(0.2)  # taken by no one: the engine thread is in its step
            await asyncio.to_thread(loop.fail, reason)
            answers = await asyncio.gather(in_step, queued)
            later = await http.post("/v1/completions", json=body)
            health = await http.get("/health")
        return answers, later, health

    app = create_app(engine)
    with serve_in_thread(app) as url:
        answers, later, health = asyncio.run(scenario(url, app.state.server.engine_loop))
        engine.gate.set()  # lets the engine thread go, so the server stops at once
    assert [a.status_code for a in answers] == [500, 503] and later.status_code == 503
    for response in (*answers, later, health):
        assert response.json()["error"]["code"] == "engine_dead" and reason in response.json()["error"]["message"]
    assert health.status_code == 503


def test_server_reports_a_dead_engine():
    app = create_app(ScriptedEngine(fail_at_step=1))
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        response = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 5})
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_dead"
        assert http.get("/health").status_code == 503
        response = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 5})
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        # Without a tokenizer, text prompts are a client error, not a crash.
        assert http.post("/v1/completions", json={"prompt": "hi"}).status_code == 400


def test_metrics_page_parses_and_counts():
    from tests.api.conftest import parse_metrics

    app = create_app(ScriptedEngine(), model_name="scripted")
    with TestClient(app) as http:
        out = http.post("/v1/completions", json={"model": "scripted", "prompt": [1, 2], "max_tokens": 3}).json()
        assert out["choices"][0]["text"] == "aaa" and out["usage"]["completion_tokens"] == 3
        m = parse_metrics(http.get("/metrics").text)
    assert m["jaxserve:generation_tokens_total"] == 3 and m["jaxserve:prompt_tokens_total"] == 2
    assert m['jaxserve:request_success_total{finished_reason="length"}'] == 1
    assert m["jaxserve:inter_token_latency_seconds_count"] == 0  # the script records one token time
    assert m["jaxserve:time_to_first_token_seconds_count"] == 1
    assert m['jaxserve:e2e_request_latency_seconds_bucket{le="+Inf"}'] == 1
    assert m['jaxserve:cache_config_info{block_size="4",cache_dtype="auto",num_gpu_blocks="8"}'] == 1
