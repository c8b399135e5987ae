"""A full waiting queue answers 503 at once; a client that goes away has its request aborted
and its KV blocks freed; a KV cache too small for the batch preempts without losing work.
These need a server of their own, with a tiny batch, queue and KV cache."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.api.conftest import MODEL, run_server

pytestmark = pytest.mark.default_model  # its server runs the default model (no --model)

MAX_NUM_SEQS = 2
MAX_WAITING = 2


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    # 8 MiB holds 10 usable blocks of 16 tokens (160 tokens) on the default model.
    args = [
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-num-batched-tokens",
        "64",
        "--kv-cache-memory",
        "8MiB",
        "--max-waiting",
        str(MAX_WAITING),
    ]
    with run_server(tmp_path_factory.mktemp("small"), *args, api_key=None) as s:
        yield s


LONG = 140  # tokens: seconds of decoding, and within the 160-token context


def long_request(max_tokens: int = LONG, stream: bool = False) -> dict:
    return {
        "model": MODEL,
        "prompt": "Count slowly:",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def test_full_queue_answers_503_at_once(small):
    before = small.wait_idle()
    num = 12

    async def burst():
        async with httpx.AsyncClient(base_url=small.url, timeout=300) as http:

            async def one(i):
                response = await http.post("/v1/completions", json=long_request(48))
                return response, time.monotonic()

            return await asyncio.gather(*(one(i) for i in range(num)))

    results = asyncio.run(burst())
    accepted = [(r, t) for r, t in results if r.status_code == 200]
    refused = [(r, t) for r, t in results if r.status_code == 503]
    assert len(accepted) + len(refused) == num
    assert refused, "no request was refused"
    assert len(accepted) >= MAX_NUM_SEQS + MAX_WAITING
    for response, _ in refused:
        assert response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "server_overloaded"
    # "At once": every refusal came back before the first accepted request was done.
    assert max(t for _, t in refused) < min(t for _, t in accepted)
    for response, _ in accepted:
        assert response.json()["usage"]["completion_tokens"] == 48
    after = small.wait_idle()
    assert after["jaxserve:num_requests_rejected_total"] - before.get("jaxserve:num_requests_rejected_total", 0) == len(
        refused
    )
    # And the server takes work again.
    assert httpx.post(f"{small.url}/v1/completions", json=long_request(2), timeout=60).status_code == 200


def aborts(metrics) -> float:
    return metrics['jaxserve:request_success_total{finished_reason="abort"}']


def test_disconnect_mid_stream_aborts_and_frees_blocks(small):
    before = small.wait_idle()
    chunks = 0
    with httpx.Client(base_url=small.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=long_request(stream=True)) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 3:
                    during = small.metrics()
                    break  # leaving the block closes the connection mid-stream
    assert during["jaxserve:num_requests_running"] == 1
    assert during["jaxserve:kv_cache_free_blocks"] < during["jaxserve:kv_cache_total_blocks"]
    assert during["jaxserve:kv_cache_usage_perc"] > 0
    after = small.wait_idle()  # free blocks back to the total
    assert after["jaxserve:kv_cache_free_blocks"] == before["jaxserve:kv_cache_free_blocks"]
    assert after["jaxserve:kv_cache_usage_perc"] == 0
    assert aborts(after) == aborts(before) + 1
    # It was aborted, not finished: far fewer tokens than asked for were made.
    assert after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"] < LONG


def test_openai_client_closing_a_stream_aborts(small):
    before = small.wait_idle()
    client = small.client()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell a long tale."}],
        max_tokens=100,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    after = small.wait_idle()
    assert aborts(after) == aborts(before) + 1


def test_disconnect_while_waiting_for_a_whole_response_aborts(small):
    before = small.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{small.url}/v1/completions", json=long_request(), timeout=httpx.Timeout(60, read=1.5))
    after = small.wait_idle()
    assert aborts(after) == aborts(before) + 1
    assert after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"] < LONG


def test_kv_cache_pressure_preempts_and_loses_nothing(small):
    """Two requests of about 100 tokens need 14 blocks; 10 exist, so one is preempted and recomputed."""
    before = small.wait_idle()

    async def pair():
        async with small.async_client() as client:
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model=MODEL, prompt=f"Story {i}:", max_tokens=96, temperature=0, extra_body={"ignore_eos": True}
                    )
                    for i in range(2)
                )
            )

    outs = asyncio.run(pair())
    assert [o.usage.completion_tokens for o in outs] == [96, 96]
    assert all(o.choices[0].finish_reason == "length" for o in outs)
    after = small.wait_idle()
    assert after["jaxserve:num_preemptions_total"] > before["jaxserve:num_preemptions_total"]
