"""LoRA over HTTP: --lora-modules names adapters a request's `model` picks, /v1/models lists
them with the base as `parent`, and each call gets peft's greedy tokens for its adapter."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

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
            assert reply["model"] == model  # an adapter's reply reports the adapter, as vLLM's
        missing = httpx.post(f"{url}/v1/completions", json=dict(model="nope", prompt=PROMPT, max_tokens=1))
        assert missing.status_code == 404


def completion_ids(url, model, max_tokens=NEW_TOKENS, **headers):
    body = dict(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True, return_token_ids=True
    )
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def streamed_ids(url, model, max_tokens, between):
    """A streamed completion's token ids; `between()` runs once the first ones have come."""
    body = dict(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True, return_token_ids=True
    )
    ids = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            ids += json.loads(line[len("data: ") :])["choices"][0].get("token_ids") or []
            if ids and between is not None:
                between()
                between = None
    return ids


def runtime_server(tiny_folder, *flags):
    args = parse_args(["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8", *flags])
    config = EngineConfig(**{**TINY_ENGINE, **lora_engine_kwargs(args)})
    engine = LLMEngine(load_model(str(tiny_folder), use_cache=False, progress=False), config)
    app = create_app(
        engine,
        model_name="tiny",
        lora_modules=lora_requests(args),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        api_key=args.api_key,
        log_requests=False,
    )
    return serve_in_thread(app)


def test_adapters_load_and_unload_at_run_time(tiny_folder, adapters):
    root, want = adapters
    auth = {"Authorization": "Bearer k"}
    with runtime_server(tiny_folder, "--allow-runtime-lora-updating", "--api-key", "k") as url:

        def post(route, **body):
            return httpx.post(f"{url}/v1/{route}", json=body, headers=auth, timeout=60)

        unauthorized = httpx.post(
            f"{url}/v1/load_lora_adapter", json=dict(lora_name="sql", lora_path=str(root / "sql"))
        )
        assert unauthorized.status_code == 401
        loaded = post("load_lora_adapter", lora_name="sql", lora_path=str(root / "sql"))
        assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
        models = httpx.get(f"{url}/v1/models", headers=auth).json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("sql", "tiny")]
        assert completion_ids(url, "sql", **auth) == want["sql"]

        again = post("load_lora_adapter", lora_name="sql", lora_path=str(root / "chat"))
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        base_name = post("load_lora_adapter", lora_name="tiny", lora_path=str(root / "sql"))
        assert base_name.status_code == 400 and base_name.json()["error"]["param"] == "lora_name"
        no_folder = post("load_lora_adapter", lora_name="x", lora_path=str(root / "missing"))
        assert no_folder.status_code == 400 and "adapter_config.json" in no_folder.json()["error"]["message"]
        assert "x" not in [m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth).json()["data"]]

        unloaded = post("unload_lora_adapter", lora_name="sql")
        assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth).json()["data"]] == ["tiny"]
        gone = httpx.post(f"{url}/v1/completions", json=dict(model="sql", prompt=PROMPT, max_tokens=1), headers=auth)
        assert gone.status_code == 404
        assert post("unload_lora_adapter", lora_name="sql").status_code == 404

        # The name again, now for other weights: the same prompt must not meet the old adapter's
        # KV in the prefix cache (each load is a new id, a key of the cache).
        assert post("load_lora_adapter", lora_name="sql", lora_path=str(root / "chat")).status_code == 200
        assert completion_ids(url, "sql", **auth) == want["chat"]
        assert completion_ids(url, "tiny", **auth) == want["base"]


def test_runtime_updates_are_off_unless_allowed(tiny_folder, adapters, monkeypatch):
    root, _ = adapters
    with runtime_server(tiny_folder) as url:
        refused = httpx.post(f"{url}/v1/load_lora_adapter", json=dict(lora_name="sql", lora_path=str(root / "sql")))
        assert refused.status_code == 404 and "--allow-runtime-lora-updating" in refused.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json=dict(lora_name="sql")).status_code == 404
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")  # vLLM's switch turns the flag's default on
    assert parse_args(["--enable-lora"]).allow_runtime_lora_updating
    engine_without_lora = LLMEngine(
        load_model(str(tiny_folder), use_cache=False, progress=False), EngineConfig(**TINY_ENGINE)
    )
    with pytest.raises(ValueError, match="needs --enable-lora"):
        create_app(engine_without_lora, allow_runtime_lora_updating=True)


def test_loading_and_unloading_under_load_loses_nothing(tiny_folder, adapters):
    """Requests of the base model and two adapters (one device slot, so they queue for it)
    run while a third name is loaded and unloaded over and over, and one adapter is unloaded
    while its request runs: every reply equals the same request run alone."""
    root, want = adapters
    long = 40
    with runtime_server(tiny_folder, "--allow-runtime-lora-updating", "--lora-modules", f"sql={root / 'sql'}") as url:

        def load(name, folder):
            return httpx.post(f"{url}/v1/load_lora_adapter", json=dict(lora_name=name, lora_path=str(root / folder)))

        def unload(name):
            assert httpx.post(f"{url}/v1/unload_lora_adapter", json=dict(lora_name=name)).status_code == 200

        assert load("chat", "chat").status_code == 200
        alone = {model: completion_ids(url, model, long) for model in ("tiny", "sql", "chat")}
        assert [ids[:NEW_TOKENS] for ids in alone.values()] == [want["base"], want["sql"], want["chat"]]

        stop = threading.Event()

        def churn():
            while not stop.is_set():
                assert load("extra", "sql").status_code == 200
                unload("extra")

        churner = threading.Thread(target=churn)
        churner.start()
        try:
            with ThreadPoolExecutor(6) as pool:
                models = ["tiny", "sql", "chat"] * 3
                replies = list(pool.map(lambda model: completion_ids(url, model, long), models))
                # An adapter unloaded while its request runs (its first tokens came): the request finishes with it.
                last = streamed_ids(url, "chat", long, between=lambda: unload("chat"))
        finally:
            stop.set()
            churner.join()
        assert [r == alone[m] for r, m in zip(replies, models)] == [True] * len(models)
        assert last == alone["chat"]
