"""The router in prefill/decode mode (`python -m api.router --prefill URL --decode URL URL`)
when a decode server dies: one prefill and two decode servers on the tiny Llama, all real
processes on loopback, the real openai client.

Oracles: the colocated one-device engine's greedy text; the `x-jaxserve-upstream` header (the
decode server that answered) and the router's /health; a decode server SIGKILLed mid-stream.
"""

import os
import signal

import httpx
import openai
import pytest

from api.router import UPSTREAM_HEADER
from tests.api.conftest import assert_same_where_clear, greedy_where_clear, run_server
from tests.api.test_disagg import ENGINE_FLAGS, PROMPTS, run_router
from tests.api.test_router import MAX_TOKENS, greedy_texts_and_upstreams

pytestmark = pytest.mark.slow  # three servers and the router in subprocesses


@pytest.fixture(scope="module")
def servers(tiny_folder, tmp_path_factory):
    dirs = [tmp_path_factory.mktemp(name) for name in ("prefill", "decode0", "decode1", "router")]
    flags = ["--model", str(tiny_folder), "--served-model-name", "tiny", *ENGINE_FLAGS]
    with (
        run_server(dirs[0], *flags, "--role", "prefill") as prefill,
        run_server(dirs[1], *flags, "--role", "decode") as decode0,
        run_server(dirs[2], *flags, "--role", "decode") as decode1,
        run_router(dirs[3], prefill.url, decode0.url, decode1.url) as router_url,
    ):
        yield prefill, [decode0, decode1], router_url


def test_a_decode_server_killed_mid_stream_ends_the_stream_cleanly_and_calls_fail_over(servers, tiny_engine):
    prefill, decodes, router_url = servers
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key=prefill.api_key, max_retries=0, timeout=120)
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    next(chunks)
    victim = next(d for d in decodes if d.url == stream.response.headers[UPSTREAM_HEADER])
    survivor = next(d for d in decodes if d is not victim)
    os.kill(victim.process.pid, signal.SIGSTOP)  # frozen before it can finish the stream, then killed
    os.kill(victim.process.pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        list(chunks)
    # Later calls, streamed or not, go to the other decode server (retried there if they
    # first went to the dead one) and give the colocated text.
    texts, served_by = greedy_texts_and_upstreams(client, PROMPTS * 2)
    assert served_by == {survivor.url}
    assert_same_where_clear(texts, greedy_where_clear(tiny_engine.loaded, PROMPTS * 2, MAX_TOKENS))
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0, stream=True)
    assert list(streamed)[-1].choices[0].finish_reason == "length"
    health = httpx.get(f"{router_url}/health", timeout=10)
    down = [u["url"] for u in health.json()["upstreams"] if not u["healthy"]]
    assert health.status_code == 200 and down == [victim.url]
