"""Prefill/decode disaggregation across processes on loopback: a prefill server (one
device), a decode server (the model split over two devices) and `python -m api.router` in
front, all real, with the real openai client.

Oracle: the one-device engine in this process, colocated (prefill and decode in one engine),
on the same weights; greedy text agrees wherever its top-2 margin is clear (the decode
server's split reorders sums). The decode server's prefix-cache hits and both servers'
transfer counters show the KV really moved; every block is free on both sides after a
call, an abandoned stream, and a prefill server killed before its offer was pulled (the
router then answers 503: no prefill server).

Offers that must not be taken are not, and the decode server then answers as the colocated
engine does: an offer for another prompt or cache salt (the prefix cache is not poisoned:
later calls without an offer still answer right), an offer pulled already (by this decode
server, or claimed at its source by another), an expired one, one whose prefill server is
gone; each refusal is counted by reason, and no pull thread is left running. A prefill
server's pending offers stop at --kv-offer-memory (503) and take more once one is pulled.
Only the offered blocks travel: the bytes moved are num_blocks times one block's bytes, as
the model's config gives them.
"""

import concurrent.futures
import contextlib
import json
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
OTHER_PROMPT = "a bird flew over the old house and the fox ran under the fence"  # as many blocks as PROMPTS[0]
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
def run_router(log_dir, prefill_url, *decode_urls):
    log = log_dir / "router.log"
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
    dirs = [tmp_path_factory.mktemp(name) for name in ("prefill", "decode", "router")]
    with (
        run_server(dirs[0], "--model", str(tiny_folder), *ENGINE_FLAGS, "--role", "prefill") as prefill,
        run_server(dirs[1], "--model", str(tiny_folder), *ENGINE_FLAGS, "--role", "decode", "-tp", "2") as decode,
        run_router(dirs[2], prefill.url, decode.url) as router_url,
    ):
        yield prefill, decode, router_url


def router_client(servers) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{servers[2]}/v1", api_key=servers[0].api_key, max_retries=0, timeout=120)


def transfer_counters(server) -> dict[str, float]:
    m = server.metrics()
    return {
        k.removeprefix("jaxserve:kv_transfer_").removesuffix("_total"): v
        for k, v in m.items()
        if k.startswith("jaxserve:kv_transfer_") and k.endswith("_total")
    }


def refused(server, reason: str) -> float:
    return server.metrics()[f'jaxserve:kv_transfer_refused_total{{reason="{reason}"}}']


def get_offer(prefill, prompt: str, **fields) -> dict:
    answer = httpx.post(
        f"{prefill.url}/v1/completions",
        headers=prefill.headers,
        timeout=60,
        json={"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}, **fields},
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def complete(server, prompt: str, offer: dict | None = None, **fields) -> str:
    client = server.client()
    extra = {"kv_transfer_params": offer} if offer else {}
    answer = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={**extra, **fields},
    )
    return answer.choices[0].text


def test_disaggregated_output_equals_colocated_and_the_kv_moved(servers, tiny_engine):
    prefill, decode, _ = servers
    client = router_client(servers)
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
    client = router_client(servers)
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
    bad = refused(decode, "bad_signature")
    answer = httpx.post(f"{decode.url}/v1/completions", headers=headers, json={**body, "kv_transfer_params": forged})
    assert answer.status_code == 400 and "not signed" in answer.json()["error"]["message"]
    assert refused(decode, "bad_signature") - bad == 1
    claim = httpx.post(f"{decode.url}/kv_transfer/claim", json={"transfer_id": offer["transfer_id"]})
    assert claim.status_code == 404  # only a prefill server takes claims
    assert (
        httpx.post(
            f"{decode.url}/v1/completions", headers=headers, json={**body, "kv_transfer_params": offer}
        ).status_code
        == 200
    )


def test_offers_that_cannot_be_had_fall_back_at_once_and_pending_offers_are_capped(
    servers, tiny_folder, tiny_engine, tmp_path
):
    """A second decode server and a second prefill server (offers kept 8 s, room for one
    offer of PROMPTS[0]): a replayed offer, a call over the cap that waits for room, an
    expired offer, one claimed by a decode server that then vanished (its bytes count until
    it expires; a call meanwhile is a 503 after its wait), and one whose prefill server was
    killed before it was pulled (the router then answers 503)."""
    want = greedy_where_clear(tiny_engine.loaded, PROMPTS, MAX_TOKENS)
    one_offer = get_offer(servers[0], PROMPTS[0])["kv_transfer_params"]["num_bytes"]
    small = ["--kv-transfer-timeout", "8", "--kv-offer-memory", str(one_offer * 3 // 2)]
    with run_server(tmp_path, "--model", str(tiny_folder), *ENGINE_FLAGS, "--role", "decode") as decode:
        # Replayed: pulled by the first decode server, then sent to this one, which the source refuses.
        offer = get_offer(servers[0], PROMPTS[1])["kv_transfer_params"]
        replays = refused(servers[1], "replayed")
        assert_same_where_clear([complete(servers[1], PROMPTS[1], offer)], want[1:])
        assert_same_where_clear([complete(servers[1], PROMPTS[1], offer)], want[1:])  # and again to the same one
        assert_same_where_clear([complete(decode, PROMPTS[1], offer)], want[1:])
        assert refused(servers[1], "replayed") - replays == 1 and refused(decode, "replayed") == 1

        prefill_dir = tmp_path / "prefill"
        prefill_dir.mkdir()
        flags = [*ENGINE_FLAGS, *small, "--role", "prefill"]
        with run_server(prefill_dir, "--model", str(tiny_folder), *flags) as prefill:

            def wait_pending(offers: int) -> None:
                for _ in range(150):
                    if prefill.metrics()["jaxserve:kv_transfer_offers_pending"] == offers:
                        break
                    time.sleep(0.1)
                assert prefill.metrics()["jaxserve:kv_transfer_offers_pending_bytes"] == offers * one_offer

            # At the cap a call waits for room: the decode server pulling and releasing the offer makes it.
            offer = get_offer(prefill, PROMPTS[0])["kv_transfer_params"]
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(get_offer, prefill, PROMPTS[0])
                time.sleep(0.5)
                assert not waiting.done() and prefill.metrics()["jaxserve:kv_transfer_offers_pending"] == 1
                assert_same_where_clear([complete(decode, PROMPTS[0], offer)], want[:1])  # pulled, then released
                second = waiting.result(timeout=60)["kv_transfer_params"]
            assert_same_where_clear([complete(decode, PROMPTS[0], second)], want[:1])
            wait_pending(0)

            expiring = get_offer(prefill, PROMPTS[0])["kv_transfer_params"]  # room again
            time.sleep(6.5)  # within 2 s of its expiry: no longer pulled
            assert_same_where_clear([complete(decode, PROMPTS[0], expiring)], want[:1])
            assert refused(decode, "expired") == 1
            wait_pending(0)  # expired: room again

            # A decode server that claimed an offer and died mid-transfer never releases it:
            # its bytes count until it expires; a call meanwhile waits, then is a 503.
            vanished = get_offer(prefill, PROMPTS[0])["kv_transfer_params"]
            claim = httpx.post(f"{vanished['kv_transfer_url']}/claim", json={"transfer_id": vanished["transfer_id"]})
            assert claim.status_code == 200
            wait_pending(1)
            full = httpx.post(
                f"{prefill.url}/v1/completions",
                headers=prefill.headers,
                timeout=60,
                json={"prompt": PROMPTS[0], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            )
            assert full.status_code == 503 and full.json()["error"]["code"] == "kv_offers_full"
            wait_pending(0)  # expired: the room is back
            offer = get_offer(prefill, PROMPTS[0])["kv_transfer_params"]
            prefill.process.kill()
            prefill.process.wait()
        assert_same_where_clear([complete(decode, PROMPTS[0], offer)], want[:1])
        assert refused(decode, "unreachable") == 1
        assert transfer_counters(decode)["failed_pulls"] == 3 and transfer_counters(decode)["pulls"] == 2
        for server in (decode, servers[1]):
            assert server.metrics()["jaxserve:kv_transfer_pulls_in_flight"] == 0  # no thread left behind
        decode.wait_idle()
        with run_router(tmp_path, prefill.url, decode.url) as router_url:  # the prefill server is gone
            answer = httpx.post(
                f"{router_url}/v1/completions",
                headers=decode.headers,
                timeout=60,
                json={"prompt": PROMPTS[0], "max_tokens": 2},
            )
        assert answer.status_code == 503 and "no prefill server" in answer.json()["error"]["message"]


def test_an_offer_for_another_prompt_is_refused_and_the_cache_stays_clean(servers, tiny_engine):
    prefill, decode, _ = servers
    offer = get_offer(prefill, PROMPTS[0])["kv_transfer_params"]  # genuine, signed
    want = greedy_where_clear(tiny_engine.loaded, [OTHER_PROMPT, PROMPTS[0]], MAX_TOKENS)
    mismatches, pulls = refused(decode, "mismatch"), transfer_counters(decode)["pulls"]
    poisoned = complete(decode, OTHER_PROMPT, offer)  # A's KV offered for B
    salted = complete(decode, PROMPTS[0], offer, cache_salt="another tenant")  # A's KV, another salt
    assert refused(decode, "mismatch") - mismatches == 2 and transfer_counters(decode)["pulls"] == pulls
    assert_same_where_clear([poisoned, salted], want)
    later = [complete(decode, OTHER_PROMPT), complete(decode, PROMPTS[0], cache_salt="another tenant")]
    through_router = router_client(servers).completions.create(
        model=offer["model"], prompt=OTHER_PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert_same_where_clear([*later, through_router.choices[0].text], [want[0], want[1], want[0]])
    decode.wait_idle()


def test_only_the_offered_blocks_travel(servers, tiny_folder):
    prefill, decode, _ = servers
    answer = get_offer(prefill, PROMPTS[1])
    offer = answer["kv_transfer_params"]
    config = json.loads((tiny_folder / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_size = 4  # ENGINE_FLAGS
    (dtype,) = {dtype for _, dtype in offer["arrays"].values()}
    per_block = 2 * config["num_hidden_layers"] * block_size * config["num_key_value_heads"] * head_dim
    per_block *= int(re.search(r"\d+", dtype).group()) // 8
    num_blocks = (answer["usage"]["prompt_tokens"] - 1) // block_size
    assert offer["num_blocks"] == num_blocks and len(offer["block_digests"]) == num_blocks
    assert offer["num_bytes"] == num_blocks * per_block
    assert all(shape[1] == num_blocks for shape, _ in offer["arrays"].values())  # no padding rows
    pulled = transfer_counters(decode)
    complete(decode, PROMPTS[1], offer)
    now = transfer_counters(decode)
    assert (
        now["pulls"] - pulled["pulls"] == 1 and now["pulled_bytes"] - pulled["pulled_bytes"] == num_blocks * per_block
    )
    m = decode.metrics()
    assert (
        m["jaxserve:kv_transfer_pull_seconds_count"] == now["pulls"] and m["jaxserve:kv_transfer_pulls_in_flight"] == 0
    )
