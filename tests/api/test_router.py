"""Data-parallel replicas as processes: `python -m api --data-parallel-size 2` on the tiny
Llama, the router (api.router) in front, everything real over loopback.

Oracles: a single engine's greedy outputs (the replicas must give the same); the
`x-jaxserve-upstream` header and the router's /health and /metrics (which replica answered,
which is in rotation); real faults: a replica process SIGSTOPped (hung), SIGCONTed, and
SIGKILLed (the parent restarts it).

One server serves the module; the tests that stop and kill replicas run last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from api.router import UPSTREAM_HEADER, create_router, prompt_digests
from api.server import create_app
from tests.api.conftest import REPO, assert_same_where_clear, greedy_where_clear, run_server, serve_in_thread

pytestmark = pytest.mark.slow  # three processes

PROMPTS = ["the cat sat on the mat and the dog sat on the log", "one two three four five six seven eight nine ten"]
MAX_TOKENS = 8
FLAGS = [
    *(
        "--served-model-name",
        "tiny",
        "--data-parallel-size",
        "2",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
    ),
    *("--max-model-len", "256", "--num-blocks", "160", "--block-size", "4"),
    # A prefix goes back to its replica only while that one is least loaded; a hang shows in two
    # polls of 8 s (a busy replica on a loaded CI machine answers well within that, and the calls
    # the killed-replica test sends to a held one reach it before it is ejected; CI 2026-12-05).
    *("--router-load-bound", "0", "--health-interval", "0.3", "--health-timeout", "8"),
]


@pytest.fixture(scope="module")
def server(tiny_folder, tmp_path_factory):
    with run_server(tmp_path_factory.mktemp("router"), "--model", str(tiny_folder), *FLAGS) as s:
        yield s


def health(server) -> tuple[int, dict]:
    answer = httpx.get(f"{server.url}/health", timeout=10)
    return answer.status_code, answer.json()


def replicas(server) -> list[dict]:
    return health(server)[1]["upstreams"]


def greedy_texts_and_upstreams(client, prompts: list[str]) -> tuple[list[str], set[str]]:
    """Each prompt's greedy text through the router, and the upstreams that answered."""
    texts, served_by = [], set()
    for prompt in prompts:
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        texts.append(raw.parse().choices[0].text)
        served_by.add(raw.headers[UPSTREAM_HEADER])
    return texts, served_by


def wait_for(condition, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not {what} after {timeout} s"
        time.sleep(0.1)


def complete(server, prompt: str, **kw) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    return httpx.post(f"{server.url}/v1/completions", headers=server.headers, json=body, timeout=120)


def test_replica_processes_answer_as_one_engine_and_health_lists_them(server, tiny_engine):
    code, body = health(server)
    assert code == 200 and body["status"] == "ok"
    assert [r["replica"] for r in body["upstreams"]] == [0, 1] and all(r["healthy"] for r in body["upstreams"])
    pids = {r["pid"] for r in body["upstreams"]}
    assert len(pids) == 2 and server.process.pid not in pids  # two processes of their own
    client = server.client()
    texts, served_by = greedy_texts_and_upstreams(client, PROMPTS * 2)
    assert len(served_by) == 2  # equal loads alternate
    assert_same_where_clear(texts, greedy_where_clear(tiny_engine.loaded, PROMPTS * 2, MAX_TOKENS))
    assert [m.id for m in client.models.list().data] == ["tiny"]  # other routes pass through


def test_a_second_chat_turn_goes_to_the_replica_holding_its_history(server, tokenizer_of_tiny):
    system = "You are a careful assistant. " + " ".join(f"rule {i}: answer in short words." for i in range(22))
    assert len(tokenizer_of_tiny.encode(system).ids) > 128  # past the old router's 8 blocks of 16
    client = server.client()
    conversations = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"name a {animal}"}]
        for animal in ("cat", "dog")
    ]

    def chat(messages, **kw):
        return client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, **kw
        )

    # Two conversations on one system prompt at once: the second to arrive finds the first's
    # replica busy and goes to the other, so both replicas recently saw the system prompt and
    # only one of them each first turn.
    barrier = threading.Barrier(2)
    answers = [None, None]

    def first_turn(i):
        barrier.wait()
        answers[i] = chat(conversations[i], extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=first_turn, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    homes = [a.headers[UPSTREAM_HEADER] for a in answers]
    assert homes[0] != homes[1]
    for conversation, answer, home in zip(conversations, answers, homes):
        reply = answer.parse().choices[0].message.content
        second_turn = [*conversation, {"role": "assistant", "content": reply}, {"role": "user", "content": "why?"}]
        routed = f'jaxserve:router_routed_total{{reason="prefix",role="replica",upstream="{home}"}}'
        before = server.metrics()[routed]
        assert chat(second_turn).headers[UPSTREAM_HEADER] == home
        assert server.metrics()[routed] == before + 1


def test_200_concurrent_streams_all_complete(server):
    async def run():
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(limits=limits, timeout=300, headers=server.headers) as http:
            client = openai.AsyncOpenAI(
                base_url=f"{server.url}/v1", api_key=server.api_key, http_client=http, max_retries=0
            )

            async def one(i):
                stream = await client.completions.create(
                    model="tiny", prompt=f"{i} {PROMPTS[i % 2]}", max_tokens=2, temperature=0, stream=True
                )
                return [c async for c in stream]

            return await asyncio.gather(*(one(i) for i in range(200)))

    chunks = asyncio.run(run())
    assert all(c[-1].choices[0].finish_reason == "length" for c in chunks)
    assert sum(len(c) for c in chunks) >= 200 * 2


def test_a_hung_replica_leaves_the_rotation_and_comes_back(server):
    hung, well = replicas(server)
    os.kill(hung["pid"], signal.SIGSTOP)
    try:
        wait_for(lambda: not replicas(server)[0]["healthy"], "ejected")
        code, body = health(server)
        assert code == 200 and body["status"] == "degraded"
        for prompt in PROMPTS:
            answer = complete(server, prompt)
            assert answer.status_code == 200 and answer.headers[UPSTREAM_HEADER] == well["url"]
        os.kill(well["pid"], signal.SIGSTOP)  # now none can serve
        wait_for(lambda: health(server)[0] == 503, "unhealthy")
        assert "degraded" in health(server)[1]["error"]["message"]
        answer = complete(server, PROMPTS[0], stream=True)
        assert answer.status_code == 503 and "no replica server" in answer.json()["error"]["message"]
    finally:
        os.kill(hung["pid"], signal.SIGCONT)
        os.kill(well["pid"], signal.SIGCONT)
    wait_for(lambda: health(server)[1].get("status") == "ok", "readmitted")
    served_by = {complete(server, p).headers[UPSTREAM_HEADER] for p in PROMPTS}
    assert served_by == {hung["url"], well["url"]}


def long_stream(client, prompt: str):
    return client.completions.create(
        model="tiny", prompt=prompt, max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )


def held_with_calls_waiting(server, client, replica_of: dict):
    """A replica held (SIGSTOP) mid-stream, with calls that have streamed nothing waiting on it.

    A long stream starts; once its first chunk is here its replica is stopped, a second stream
    goes to the other replica (the least loaded) and calls are sent: equal loads alternate, so
    some wait on the held one. A loaded machine can lose two races: the tiny model
    writes the whole first stream before the stop, or the router's health poll ejects the held
    replica before a call reaches it (two polls of --health-timeout; every call then goes to
    the other). Then the replica is let go, everything finishes, and another try is made.

    Returns the held replica, the first stream's reader and what it got (its chunks, then the
    exception that ended them), the calls' threads and their results, the second stream, and
    the held replica's retry count before the calls."""
    lost = []
    for _ in range(3):
        stream = long_stream(client, PROMPTS[0])
        chunks = iter(stream)
        got: list = [next(chunks)]
        victim = replica_of[stream.response.headers[UPSTREAM_HEADER]]
        os.kill(victim["pid"], signal.SIGSTOP)
        stopped = time.monotonic()
        other = long_stream(client, PROMPTS[1])
        in_flight = f'jaxserve:router_upstream_in_flight{{role="replica",upstream="{victim["url"]}"}}'
        retries = f'jaxserve:router_retries_total{{role="replica",upstream="{victim["url"]}"}}'
        before = server.metrics()[retries]
        results: list = [None] * 4
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, complete(server, PROMPTS[i % 2])))
            for i in range(len(results))
        ]
        for t in threads:
            t.start()

        def read_rest(chunks=chunks, got=got):
            try:
                got.extend(chunks)
            except Exception as error:  # noqa: BLE001 - the test checks which
                got.append(error)

        reader = threading.Thread(target=read_rest, daemon=True)
        reader.start()
        # The stream and 1+ calls wait on it (or its hang was noticed first and they moved on).
        # What it wrote before the stop drains within a few seconds: a stream that ends in
        # them, and not with an error, raced the stop.
        routed = False
        while time.monotonic() < stopped + 12 and not (routed and time.monotonic() > stopped + 3):
            m = server.metrics()
            routed = routed or m[in_flight] >= 2 or m[retries] > before
            time.sleep(0.1)
        ended_cleanly = not reader.is_alive() and not isinstance(got[-1], Exception)
        if routed and not ended_cleanly and other.response.headers[UPSTREAM_HEADER] != victim["url"]:
            return victim, reader, got, threads, results, other, before
        other_url = other.response.headers[UPSTREAM_HEADER]
        lost.append(f"routed {routed}, first stream ended {not reader.is_alive()}, other on {other_url}")
        os.kill(victim["pid"], signal.SIGCONT)
        for t in threads:
            t.join(120)
        other.close()
        reader.join(60)
        wait_for(lambda: health(server)[1].get("status") == "ok", "readmitted")
    raise AssertionError(f"no try held a replica mid-stream with calls waiting on it: {lost}")


def test_a_killed_replica_is_retried_elsewhere_restarted_and_readmitted(server, tiny_engine):
    client = server.client()
    # A stream on each replica; the one on the victim has started, so its client must get a
    # clean error. Calls in flight on the victim that have streamed nothing: once it is killed,
    # the other replica must answer them.
    before_stop = {r["url"]: r for r in replicas(server)}
    victim, reader, victim_got, threads, results, other, before = held_with_calls_waiting(server, client, before_stop)
    retries = f'jaxserve:router_retries_total{{role="replica",upstream="{victim["url"]}"}}'
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(120)
    other.close()
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    want = greedy_where_clear(tiny_engine.loaded, PROMPTS, MAX_TOKENS)
    assert_same_where_clear([r.json()["choices"][0]["text"] for r in results], want * 2)
    assert server.metrics()[retries] > before
    reader.join(60)
    assert isinstance(victim_got[-1], openai.APIError) and "failed mid-stream" in str(victim_got[-1]), victim_got[-1]
    code, body = health(server)
    down = [r for r in body["upstreams"] if not r["healthy"]]
    assert code == 200 and [r["url"] for r in down] == [victim["url"]]
    # The parent starts it again on its port, and the router takes it back.
    index = victim["replica"]
    wait_for(lambda: replicas(server)[index]["restarts"] == 1 and replicas(server)[index]["healthy"], "back", 300)
    assert replicas(server)[index]["pid"] != victim["pid"]
    served_by = {complete(server, p).headers[UPSTREAM_HEADER] for p in PROMPTS}
    assert served_by == {r["url"] for r in replicas(server)}


@pytest.fixture(scope="module")
def tokenizer_of_tiny(tiny_folder):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_folder / "tokenizer.json"))


def test_a_prompt_digest_chain_covers_the_whole_prompt_and_the_chat_history():
    system = {"role": "system", "content": "x" * 5000}
    first = prompt_digests({"messages": [system, {"role": "user", "content": "hi"}]})
    second = prompt_digests(
        {"messages": [system, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    )
    assert len(first) > 8 * 4 and second[: len(first)] == first and len(second) == len(first) + 1
    salted = prompt_digests({"messages": [system], "cache_salt": "a"})
    assert not set(salted) & set(first)
    text = prompt_digests({"prompt": "y" * 1000})
    assert text == prompt_digests({"prompt": ["y" * 1000, "z"]}) and len(text) == 1000 // 128


def test_the_router_and_the_replica_parent_import_no_jax():
    code = "import sys, api.router, api.replica_processes, api.__main__; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_a_stalled_engine_turns_health_503_and_leaves_the_routers_rotation(tiny_engine):
    release = threading.Event()
    step = tiny_engine.step

    def stuck_step():  # the hang: a step that does not return
        release.wait(60)
        return step()

    # A step past 5 s is a stall; a real one on a loaded CI machine once took more than 0.5 s
    # after the release, turned /health 503 again and the router dropped the last call (CI 2026-12-06).
    app = create_app(tiny_engine, model_name="tiny", engine_step_timeout=5)
    with serve_in_thread(app) as url, serve_in_thread(create_router([url], health_interval=0.1)) as router_url:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        answers = []
        call = threading.Thread(
            target=lambda: answers.append(httpx.post(f"{router_url}/v1/completions", json=body, timeout=60))
        )
        tiny_engine.step = stuck_step
        try:
            call.start()
            wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, "stalled")
            assert httpx.get(f"{url}/health").json()["error"]["code"] == "engine_stalled"
            wait_for(lambda: httpx.get(f"{router_url}/health").status_code == 503, "out of rotation")
            call.join(60)
            # The call waited on the stalled server: it ends with a clean error, not a hang.
            assert answers[0].status_code == 503 and "no replica server" in answers[0].json()["error"]["message"]
        finally:
            del tiny_engine.step
            release.set()
        wait_for(lambda: httpx.get(f"{router_url}/health").status_code == 200, "back in rotation")
        assert httpx.post(f"{router_url}/v1/completions", json=body, timeout=60).status_code == 200


def test_the_announced_url_takes_connections_before_uvicorn_starts(monkeypatch, capsys):
    """A client that reads `router on URL` may connect at once: the socket listens before the
    line is printed (it had only been bound, and a busy machine refused the first call)."""
    import socket

    import uvicorn

    from api.router import serve

    connected = []

    class NotStarted:  # stands in for uvicorn: its Config would also take over logging
        def __init__(self, *args, **kwargs):
            pass

        def run(self, sockets):
            url = capsys.readouterr().out.split(" on ")[-1].strip()
            host, port = url.removeprefix("http://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5):
                connected.append(url)  # queued by the kernel; nobody has accepted yet
            sockets[0].close()

    monkeypatch.setattr(uvicorn, "Config", NotStarted)
    monkeypatch.setattr(uvicorn, "Server", NotStarted)
    serve(None, "127.0.0.1", 0, "jaxserve: router on {url}")
    assert connected
