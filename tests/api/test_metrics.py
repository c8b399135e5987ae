"""/metrics after known requests: vLLM's per-request histograms add up to what the API
reported (usage) and to each other (queue + prefill is the time to first token)."""

from __future__ import annotations

import pytest

from tests.api.conftest import MODEL

PHASES = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds")
PER_REQUEST = (
    *PHASES,
    "request_prompt_tokens",
    "request_generation_tokens",
    "e2e_request_latency_seconds",
    "time_to_first_token_seconds",
)


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def test_per_request_histograms_add_up_to_usage(server, client):
    before = server.wait_idle()
    usages = [
        client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0).usage,
        # Two prompts are two engine requests; n=2 is one request with both samples' tokens.
        client.completions.create(
            model=MODEL,
            prompt=["One, two,", "Red, green,"],
            max_tokens=4,
            temperature=0,
            extra_body={"ignore_eos": True},
        ).usage,
        client.completions.create(
            model=MODEL, prompt="My favourite food is", max_tokens=6, n=2, seed=3, extra_body={"ignore_eos": True}
        ).usage,
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0
        ).usage,
    ]
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=7,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages += [chunk.usage for chunk in stream if chunk.usage is not None]
    num_requests = 6
    g = grown(before, server.wait_idle())

    for name in PER_REQUEST:
        assert g[f"jaxserve:{name}_count"] == num_requests, name
        assert g[f'jaxserve:{name}_bucket{{le="+Inf"}}'] == num_requests, name
    assert (
        g["jaxserve:request_prompt_tokens_sum"]
        == sum(u.prompt_tokens for u in usages)
        == g["jaxserve:prompt_tokens_total"]
    )
    assert (
        g["jaxserve:request_generation_tokens_sum"]
        == sum(u.completion_tokens for u in usages)
        == g["jaxserve:generation_tokens_total"]
    )
    queue, prefill, decode = (g[f"jaxserve:{name}_sum"] for name in PHASES)
    assert queue > 0 and prefill > 0 and decode > 0
    # Arrival -> first scheduled -> first token is the time to first token; the last token
    # comes no later than the end.
    assert queue + prefill == pytest.approx(g["jaxserve:time_to_first_token_seconds_sum"], abs=1e-6)
    assert queue + prefill + decode <= g["jaxserve:e2e_request_latency_seconds_sum"] + 1e-9


def test_a_one_token_request_has_no_decode_time(server, client):
    before = server.wait_idle()
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0)
    g = grown(before, server.wait_idle())
    assert g["jaxserve:request_decode_time_seconds_count"] == 1
    assert g["jaxserve:request_decode_time_seconds_sum"] == 0
    assert g["jaxserve:request_generation_tokens_sum"] == 1
    assert g['jaxserve:request_generation_tokens_bucket{le="1.0"}'] == 1


def test_device_resident_bytes(server):
    """One device here: it holds the whole KV cache (cache_config_info's kv_cache_bytes) and
    every weight; the default model's Q4_1 GGUF dequantized to float32 is over 400 MiB."""
    m = server.metrics()
    info = next(k for k in m if k.startswith("jaxserve:cache_config_info"))
    kv_bytes = float(info.split('kv_cache_bytes="')[1].split('"')[0])
    assert m['jaxserve:device_kv_cache_bytes{device="0"}'] == kv_bytes
    assert m['jaxserve:device_weight_bytes{device="0"}'] > 400 * 2**20
    assert not any(k.startswith("jaxserve:device_weight_bytes") and 'device="1"' in k for k in m)
