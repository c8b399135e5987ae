"""200 concurrent requests, streamed and not: every one completes with the right token count,
the server keeps answering /health meanwhile, and no KV block is left held afterwards."""

from __future__ import annotations

import asyncio

import httpx

from tests.api.conftest import MODEL, parse_metrics

NUM_REQUESTS = 200


async def one_request(client, i: int) -> dict:
    max_tokens = 1 + i % 8
    kw = dict(model=MODEL, max_tokens=max_tokens, temperature=0.8, seed=i, extra_body={"ignore_eos": True, "top_k": 50})
    if i % 4 == 3:  # some chats too
        kw["messages"] = [{"role": "user", "content": f"Request {i}: name a colour."}]
        create = client.chat.completions.create
    else:
        kw["prompt"] = f"Request number {i} says:" + " and so on" * (i % 5)
        create = client.completions.create
    if i % 2 == 0:
        stream = await create(stream=True, stream_options={"include_usage": True}, **kw)
        text, reasons, usage = "", [], None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                text += c.text if hasattr(c, "text") else (c.delta.content or "")
                if c.finish_reason:
                    reasons.append(c.finish_reason)
        return dict(
            i=i, want=max_tokens, got=usage.completion_tokens, prompt_tokens=usage.prompt_tokens, reasons=reasons
        )
    out = await create(**kw)
    return dict(
        i=i,
        want=max_tokens,
        got=out.usage.completion_tokens,
        prompt_tokens=out.usage.prompt_tokens,
        reasons=[c.finish_reason for c in out.choices],
    )


async def watch_health(server, done: asyncio.Event) -> tuple[int, int]:
    """Probe /health and /metrics while the load runs: (probes answered, probes that saw the engine busy)."""
    answered = busy = 0
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        while not done.is_set():
            assert (await http.get("/health")).status_code == 200
            metrics = parse_metrics((await http.get("/metrics")).text)
            answered += 1
            busy += metrics["jaxserve:num_requests_running"] > 0
            await asyncio.sleep(0.05)
    return answered, busy


async def run_load(server):
    done = asyncio.Event()
    watcher = asyncio.create_task(watch_health(server, done))
    async with server.async_client() as client:
        results = await asyncio.gather(*(one_request(client, i) for i in range(NUM_REQUESTS)))
    done.set()
    return results, await watcher


def test_200_concurrent_requests(server):
    before = server.wait_idle()
    results, (answered, busy) = asyncio.run(run_load(server))
    assert sorted(r["i"] for r in results) == list(range(NUM_REQUESTS)), "a request was lost"
    wrong = [r for r in results if r["got"] != r["want"] or r["reasons"] != ["length"]]
    assert not wrong, wrong[:5]
    assert answered > 0 and busy > 0, "/health and /metrics must answer while the engine computes"

    after = server.wait_idle()  # nothing running or waiting, every block free again
    assert after["jaxserve:kv_cache_free_blocks"] == after["jaxserve:kv_cache_total_blocks"]
    # The counters agree with what the clients were told.
    grew = {k: after[k] - before.get(k, 0) for k in after}
    assert grew["jaxserve:generation_tokens_total"] == sum(r["got"] for r in results)
    assert grew["jaxserve:prompt_tokens_total"] == sum(r["prompt_tokens"] for r in results)
    assert grew['jaxserve:request_success_total{finished_reason="length"}'] == NUM_REQUESTS
    assert grew["jaxserve:time_to_first_token_seconds_count"] == NUM_REQUESTS
    assert grew["jaxserve:e2e_request_latency_seconds_count"] == NUM_REQUESTS
    assert grew["jaxserve:inter_token_latency_seconds_count"] == sum(r["got"] - 1 for r in results)
    # Every chat prompt starts with the template's system turn: full blocks the prefix cache shares.
    assert grew["jaxserve:prefix_cache_hits_total"] > 0
    assert (
        after["jaxserve:prefix_cache_hit_rate"]
        == after["jaxserve:prefix_cache_hits_total"] / after["jaxserve:prefix_cache_queries_total"]
    )
    assert (
        after['jaxserve:time_to_first_token_seconds_bucket{le="+Inf"}']
        == after["jaxserve:time_to_first_token_seconds_count"]
    )
