"""LoRA over HTTP: --lora-modules names adapters a request's `model` picks, /v1/models lists
them with the base as `parent`, and each call gets peft's greedy tokens for its adapter."""

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from api.__main__ import parse_args
from api.server import create_app
from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.flags import lora_engine_kwargs, lora_requests
from jaxserve.weights import load_model
from tests.api.conftest import TINY_ENGINE, serve_in_thread
from tests.tiny_lora import ALL_SEVEN, make_peft_adapter

PROMPT = [1, 5, 17, 33, 8, 41, 9]
NEW_TOKENS = 5


def greedy(model, prompt):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def adapters(tiny_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = AutoModelForCausalLM.from_pretrained(tiny_folder, torch_dtype=torch.float32).eval()
    want = {"base": greedy(base, PROMPT)}
    for name, r, targets in [("sql", 4, ["q_proj", "v_proj"]), ("chat", 8, ALL_SEVEN)]:
        want[name] = greedy(make_peft_adapter(base, root / name, r=r, seed=len(name), targets=targets), PROMPT)
    assert want["sql"] != want["base"] and want["chat"] != want["base"], "adapters that change nothing prove little"
    return root, want


def test_lora_flags_parse_to_engine_fields_and_requests():
    args = parse_args(
        ["--enable-lora", "--lora-modules", "a=/x/a", "b=/y/b", "--max-loras", "2", "--max-lora-rank", "8"]
    )
    assert lora_engine_kwargs(args) == dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=None)
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in lora_requests(args)] == [
        ("a", 1, "/x/a"),
        ("b", 2, "/y/b"),
    ]
    with pytest.raises(ValueError, match="needs --enable-lora"):
        lora_requests(parse_args(["--lora-modules", "a=/x/a"]))
    with pytest.raises(SystemExit):
        parse_args(["--enable-lora", "--lora-modules", "no-path"])


def test_the_request_model_picks_the_adapter(tiny_folder, adapters):
    root, want = adapters
    args = parse_args(
        ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", "--lora-modules"]
        + [f"{name}={root / name}" for name in ("sql", "chat")]
    )
    config = EngineConfig(**{**TINY_ENGINE, **lora_engine_kwargs(args)})
    engine = LLMEngine(load_model(str(tiny_folder), use_cache=False, progress=False), config)
    app = create_app(engine, model_name="tiny", lora_modules=lora_requests(args), log_requests=False)
    with serve_in_thread(app) as url:
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m.get("parent"), m.get("root")) for m in models] == [
            ("tiny", None, None),
            ("sql", "tiny", str(root / "sql")),
            ("chat", "tiny", str(root / "chat")),
        ]
        for model in ["sql", "tiny", "chat", "sql"]:  # one device slot: each adapter change refills it
            body = dict(
                model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, return_token_ids=True
            )
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            assert reply["choices"][0]["token_ids"] == want["base" if model == "tiny" else model], model
        missing = httpx.post(f"{url}/v1/completions", json=dict(model="nope", prompt=PROMPT, max_tokens=1))
        assert missing.status_code == 404
