"""Prefill/decode disaggregation across processes on loopback: a prefill server (one
device), a decode server (the model split over two devices) and `python -m api.router` in
front, all real, with the real openai client.

Oracle: the one-device engine in this process, colocated (prefill and decode in one engine),
on the same weights; greedy text agrees wherever its top-2 margin is clear (the decode
server's split reorders sums). The decode server's prefix-cache hits and both servers'
transfer counters show the KV really moved; every block is free on both sides after a
call, an abandoned stream, and a prefill server killed before its offer was pulled (the
router then answers 503: no prefill server).
"""

import contextlib
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.api.conftest import REPO, assert_same_where_clear, greedy_where_clear, run_server

pytestmark = pytest.mark.slow  # a prefill and a decode server in subprocesses

PROMPTS = ["the cat sat on the mat and the dog sat on the log", "one two three four five six seven eight nine ten"]
MAX_TOKENS = 8
SECRET = "a shared secret"
ENGINE_FLAGS = [
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "32",
    "--max-model-len",
    "64",
    "--num-blocks",
    "64",
    "--block-size",
    "4",
    "--kv-transfer-secret",
    SECRET,
    "--kv-transfer-timeout",
    "10",
]


@contextlib.contextmanager
def run_proxy(log_dir, prefill_url, *decode_urls):
    log = log_dir / "proxy.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "api.router",
                "--port",
                "0",
                "--prefill",
                prefill_url,
                "--decode",
                *decode_urls,
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        for _ in range(300):
            match = re.search(r"jaxserve: router on (http://\S+)", log.read_text())
            if match:
                break
            assert process.poll() is None, log.read_text()
            time.sleep(0.1)
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture(scope="module")
def servers(tiny_folder, tmp_path_factory):
    dirs = [tmp_path_factory.mktemp(name) for name in ("prefill", "decode", "proxy")]
    with (
        run_server(dirs[0], "--model", str(tiny_folder), *ENGINE_FLAGS, "--role", "prefill") as prefill,
        run_server(dirs[1], "--model", str(tiny_folder), *ENGINE_FLAGS, "--role", "decode", "-tp", "2") as decode,
        run_proxy(dirs[2], prefill.url, decode.url) as proxy_url,
    ):
        yield prefill, decode, proxy_url


def proxy_client(servers) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{servers[2]}/v1", api_key=servers[0].api_key, max_retries=0, timeout=120)


def transfer_counters(server) -> dict[str, float]:
    m = server.metrics()
    return {
        k.removeprefix("jaxserve:kv_transfer_").removesuffix("_total"): v
        for k, v in m.items()
        if k.startswith("jaxserve:kv_transfer_") and k.endswith("_total")
    }


def test_disaggregated_output_equals_colocated_and_the_kv_moved(servers, tiny_engine):
    prefill, decode, _ = servers
    client = proxy_client(servers)
    model = client.models.list().data[0].id
    hits = decode.metrics()["jaxserve:prefix_cache_hits_total"]
    sent, got = transfer_counters(prefill), transfer_counters(decode)
    texts = [
        client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
        for p in PROMPTS
    ]
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=4, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert_same_where_clear(texts, greedy_where_clear(tiny_engine.loaded, PROMPTS, MAX_TOKENS))

    sent_now, got_now = transfer_counters(prefill), transfer_counters(decode)
    assert sent_now["offers"] - sent["offers"] == got_now["pulls"] - got["pulls"] == 3
    moved = got_now["pulled_bytes"] - got["pulled_bytes"]
    assert moved > 0 and moved == sent_now["offered_bytes"] - sent["offered_bytes"]
    assert got_now["failed_pulls"] == got["failed_pulls"]
    assert decode.metrics()["jaxserve:prefix_cache_hits_total"] - hits >= 3 * 8  # whole blocks of each prompt
    prefill.wait_idle()
    decode.wait_idle()  # every block free again on both sides


def test_an_abandoned_stream_frees_the_blocks_on_both_sides(servers):
    prefill, decode, _ = servers
    client = proxy_client(servers)
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=PROMPTS[1],
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()
    prefill.wait_idle()
    decode.wait_idle()


def test_wrong_roles_and_unsigned_offers_are_refused(servers):
    prefill, decode, _ = servers
    headers = decode.headers
    body = {"prompt": PROMPTS[0], "max_tokens": 1}
    answer = httpx.post(
        f"{decode.url}/v1/completions", headers=headers, json={**body, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert answer.status_code == 400 and "--role prefill" in answer.json()["error"]["message"]
    offer = httpx.post(
        f"{prefill.url}/v1/completions",
        headers=headers,
        json={**body, "kv_transfer_params": {"do_remote_decode": True}},
    ).json()["kv_transfer_params"]
    forged = {**offer, "transfer_id": "1"}
    answer = httpx.post(f"{decode.url}/v1/completions", headers=headers, json={**body, "kv_transfer_params": forged})
    assert answer.status_code == 400 and "not signed" in answer.json()["error"]["message"]
    assert (
        httpx.post(
            f"{decode.url}/v1/completions", headers=headers, json={**body, "kv_transfer_params": offer}
        ).status_code
        == 200
    )


def test_a_killed_prefill_server_leaves_the_decode_server_computing_the_prompt(tiny_folder, tiny_engine, tmp_path):
    with run_server(tmp_path, "--model", str(tiny_folder), *ENGINE_FLAGS, "--role", "decode") as decode:
        prefill_dir = tmp_path / "prefill"
        prefill_dir.mkdir()
        with run_server(prefill_dir, "--model", str(tiny_folder), *ENGINE_FLAGS, "--role", "prefill") as prefill:
            offer = httpx.post(
                f"{prefill.url}/v1/completions",
                headers=prefill.headers,
                timeout=60,
                json={"prompt": PROMPTS[0], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            ).json()["kv_transfer_params"]
            prefill.process.kill()
            prefill.process.wait()
        client = decode.client()
        answer = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"kv_transfer_params": offer},
        )
        want = greedy_where_clear(tiny_engine.loaded, PROMPTS[:1], MAX_TOKENS)
        assert_same_where_clear([answer.choices[0].text], want)
        assert transfer_counters(decode)["failed_pulls"] == 1
        decode.wait_idle()
        with run_proxy(tmp_path, prefill.url, decode.url) as proxy_url:  # the prefill server is gone
            answer = httpx.post(
                f"{proxy_url}/v1/completions",
                headers=decode.headers,
                timeout=60,
                json={"prompt": PROMPTS[0], "max_tokens": 2},
            )
        assert answer.status_code == 503 and "no prefill server" in answer.json()["error"]["message"]
