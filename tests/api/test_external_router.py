"""jaxserve servers behind vllm-router (vLLM's router, a Rust binary from PyPI), all real
processes on loopback, with the real openai client.

Two tiny servers, one `--role prefill` and one `--role decode`: without kv_transfer_params
both serve calls whole, so the router's regular mode balances over them as two replicas,
and its PD mode (`--vllm-pd-disaggregation`) drives them as a prefill/decode pair with
vLLM's kv_transfer_params. Oracle: the same call straight to one server (same weights, one
device each, so greedy text is identical), and the servers' own /metrics counters (prompt
tokens, prefix-cache hits, KV transfers) for where calls went and that the KV moved.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from api.replica_processes import free_port
from tests.api.conftest import run_server
from tests.api.test_disagg import transfer_counters

pytestmark = pytest.mark.server

PROMPTS = ["the cat sat on the mat and the dog sat on the log", "one two three four five six seven eight"]
CHAT = [{"role": "user", "content": "one two three four"}]
MAX_TOKENS = 6
# Signed offers: vllm-router re-serializes kv_transfer_params (serde_json) on the way to the
# decode server; the signature must survive that (the offer carries no floats).
ENGINE_FLAGS = [
    *("--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "64"),
    *("--num-blocks", "64", "--block-size", "4", "--kv-transfer-timeout", "10"),
    *("--kv-transfer-secret", "router-test-secret"),
]


def router_binary() -> str:
    """vllm-router from the test extra (next to this Python, or on PATH)."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if found is None:
        pytest.fail("vllm-router is not installed: pip install -e '.[test]' (it is in the test extra)")
    return found


@contextlib.contextmanager
def run_router(log_dir: Path, *args: str):
    """vllm-router on a free loopback port (and its own Prometheus port); yields its URL once ready."""
    port = free_port()
    log = log_dir / f"router-{port}.log"
    cmd = [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()), *args]
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/readiness", timeout=2).status_code == 200:
                    break
            assert process.poll() is None, log.read_text()[-4000:]
            time.sleep(0.1)
        else:
            raise AssertionError(f"vllm-router never became ready:\n{log.read_text()[-4000:]}")
        yield url
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture(scope="module")
def servers(tiny_folder, tmp_path_factory):
    dirs = [tmp_path_factory.mktemp(name) for name in ("prefill", "decode")]
    flags = ["--model", str(tiny_folder), *ENGINE_FLAGS]
    with (
        run_server(dirs[0], *flags, "--role", "prefill", api_key=None) as prefill,
        run_server(dirs[1], *flags, "--role", "decode", api_key=None) as decode,
    ):
        yield prefill, decode


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def answers(url: str) -> list[str]:
    """Completions and a chat, each whole and streamed, greedy."""
    c = client(url)
    model = c.models.list().data[0].id
    out = []
    for prompt in PROMPTS:
        call = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        out.append(c.completions.create(**call).choices[0].text)
        stream = c.completions.create(**call, stream=True)
        out.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    chat = dict(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    out.append(c.chat.completions.create(**chat).choices[0].message.content)
    stream = c.chat.completions.create(**chat, stream=True)
    out.append("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))
    return out


def test_two_replicas_behind_the_router(servers, tmp_path):
    prefill, decode = servers
    direct = answers(decode.url)
    with run_router(tmp_path, "--worker-urls", prefill.url, decode.url, "--policy", "cache_aware") as router:
        assert httpx.get(f"{router}/health").status_code == 200
        model = client(decode.url).models.list().data[0].id
        assert [m.id for m in client(router).models.list().data] == [model]
        assert httpx.get(f"{router}/get_model_info").json()["model_path"] == model  # passed to a server
        loads = httpx.get(f"{router}/get_loads").json()["workers"]  # read from each server's /get_load
        assert sorted(w["load"] for w in loads) == [0, 0]
        assert answers(router) == direct

        # Calls sharing a long prefix all go to the server that holds it: only its prompt-token
        # and prefix-cache counters move.
        before = [s.metrics() for s in servers]
        shared = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi"
        for word in ["rho", "sigma", "tau", "upsilon"]:
            client(router).completions.create(model=model, prompt=f"{shared} {word}", max_tokens=2, temperature=0)
        after = [s.metrics() for s in servers]
        prompt_tokens, hits = (
            [a[f"jaxserve:{name}"] - b[f"jaxserve:{name}"] for a, b in zip(after, before)]
            for name in ("prompt_tokens_total", "prefix_cache_hits_total")
        )
        holder = max(range(2), key=lambda i: prompt_tokens[i])
        assert prompt_tokens[1 - holder] == 0 and hits[1 - holder] == 0
        assert hits[holder] >= 3 * 16  # each later call found the shared prefix's whole blocks


def test_prefill_decode_mode_drives_the_role_servers(servers, tmp_path):
    prefill, decode = servers
    direct = answers(decode.url)
    offered, pulled = transfer_counters(prefill), transfer_counters(decode)
    args = ["--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url, "--policy", "cache_aware"]
    # The router's prefill call adds min_tokens 1; with ignore_eos that once left nothing to
    # ban and stopped the engine.
    ignore_eos = dict(prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    model = client(decode.url).models.list().data[0].id
    direct.append(client(decode.url).completions.create(model=model, **ignore_eos).choices[0].text)
    with run_router(tmp_path, *args) as router:
        assert httpx.get(f"{router}/health").status_code == 200
        through = answers(router) + [client(router).completions.create(model=model, **ignore_eos).choices[0].text]
    assert through == direct
    offered_now, pulled_now = transfer_counters(prefill), transfer_counters(decode)
    calls = len(direct)
    assert offered_now["offers"] - offered["offers"] == pulled_now["pulls"] - pulled["pulls"] == calls
    assert pulled_now["failed_pulls"] == pulled["failed_pulls"]
    moved = pulled_now["pulled_bytes"] - pulled["pulled_bytes"]
    assert moved == offered_now["offered_bytes"] - offered["offered_bytes"] > 0
    prefill.wait_idle()
    decode.wait_idle()  # every block free again on both sides
