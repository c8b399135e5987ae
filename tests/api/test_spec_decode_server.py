"""`python -m api --speculative-config ...`: a real server with n-gram speculation answers
the real openai client exactly as an engine without it does, streamed or not, /metrics
carries vLLM's spec_decode counters, and each call's usage its own (which add up to them)."""

from __future__ import annotations

import json
import subprocess
import sys

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.weights import load_model
from scheduler import SamplingParams
from tests.api.conftest import run_server

PROMPTS = ["the cat sat on the mat and the cat sat on the", "a dog and a dog and a dog and a"]
# Every draft verified (not only where the measured step times say drafts pay).
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_measured_cost": False,
}


def test_server_with_ngram_speculation(tiny_folder, tmp_path):
    plain = LLMEngine(
        load_model(str(tiny_folder), use_cache=False, progress=False),
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, warm_up=False),
    )
    for i, prompt in enumerate(PROMPTS):
        plain.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    want = {o.request_id: o.outputs[0].text for o in plain.generate_all()}

    args = [
        "--model",
        str(tiny_folder),
        "--speculative-config",
        json.dumps(SPEC),
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
        "--max-model-len",
        "64",
        "--block-size",
        "4",
    ]
    with run_server(tmp_path, *args) as server:
        client = server.client()
        model = client.models.list().data[0].id
        usages = []  # each call's usage.speculative_decoding
        for i, prompt in enumerate(PROMPTS):
            kw = dict(model=model, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
            reply = client.completions.create(**kw)
            assert reply.choices[0].text == want[str(i)]
            usages.append(reply.usage.model_extra["speculative_decoding"])
            # each verification yields its accepted drafts and one more token
            assert reply.usage.completion_tokens >= usages[-1]["num_drafts"] + usages[-1]["num_accepted_tokens"]
            chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want[str(i)]
            usages.append(chunks[-1].usage.model_extra["speculative_decoding"])
        m = server.metrics()
        log = server.log.read_text()
    assert m["jaxserve:spec_decode_num_drafts_total"] > 0
    accepted = m["jaxserve:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= m["jaxserve:spec_decode_num_draft_tokens_total"]
    # The calls' own counters add up to the server's.
    for field in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert sum(u[field] for u in usages) == m[f"jaxserve:spec_decode_{field}_total"], field
    assert all(sum(u["num_accepted_tokens_per_pos"]) == u["num_accepted_tokens"] for u in usages)
    per_position = sum(v for k, v in m.items() if k.startswith("jaxserve:spec_decode_num_accepted_tokens_per_pos"))
    assert per_position == accepted
    assert "speculative decoding: ngram, 3 tokens per step" in log


def test_bad_speculative_config_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "api", "--speculative-config", '{"method": "eagle9"}'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--speculative-config: speculative method must be one of ngram, draft_model" in proc.stderr
