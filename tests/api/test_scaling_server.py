"""`python -m api --tensor-parallel-size 2 --data-parallel-size 2`: two replica processes,
each with a model split over two CPU devices (each asks jax for them before it starts) and
its own device group (CUDA_VISIBLE_DEVICES 0,1 and 2,3), behind the router, answering as the
one-device engine does."""

from pathlib import Path

import httpx
import pytest

from jaxserve.engine import EngineConfig, LLMEngine
from scheduler import SamplingParams
from tests.api.conftest import TINY_ENGINE, run_server

pytestmark = pytest.mark.slow  # servers in subprocesses over several devices

PROMPTS = ["the cat sat on the mat", "hello world", "one two three four five six seven eight nine ten"]


def environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def test_server_splits_the_model_and_serves_replicas(tiny_folder, tmp_path, tiny_engine):
    args = [
        "--model",
        str(tiny_folder),
        "--tensor-parallel-size",
        "2",
        "--data-parallel-size",
        "2",
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
    ]
    with run_server(tmp_path, *args) as server:
        client = server.client()
        model = client.models.list().data[0].id
        got = [
            client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in PROMPTS
        ]
        health = httpx.get(f"{server.url}/health").json()
        groups = [environ(r["pid"]).get("CUDA_VISIBLE_DEVICES") for r in health["upstreams"]]
        log = server.log.read_text()
    assert health["status"] == "ok" and [(r["replica"], r["healthy"]) for r in health["upstreams"]] == [
        (0, True),
        (1, True),
    ]
    assert groups == ["0,1", "2,3"]
    assert log.count("tensor parallel 2 over devices [0, 1]") == 2  # one per replica process
    engine = LLMEngine(tiny_engine.loaded, EngineConfig(**{**TINY_ENGINE, "block_size": 4}))
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=8))
    want = {o.request_id: o.outputs[0].text for o in engine.generate_all()}
    assert got == [want[str(i)] for i in range(len(PROMPTS))]
