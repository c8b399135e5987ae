"""The request fields that shape a prompt and its sampling, through the real `openai` client
(`extra_body` for the fields OpenAI does not have), against servers on the tiny model whose
tokenizer adds BOS: BOS exactly as transformers adds it (add_special_tokens), one BOS in a
chat (the template's), include_stop_str_in_output, cache_salt and the cached_tokens that
only --enable-prompt-tokens-details reports, and the defaults a model's
generation_config.json gives to fields a request leaves unset (--generation-config).

Oracles: transformers' own tokenizer and chat template on the same folder; the server's
own greedy output; the prefix-cache hits it reports in usage.
"""

from __future__ import annotations

import json
import re
import shutil

import openai
import pytest
from transformers import AutoTokenizer

from tests.api.conftest import REPO, run_server

NAME = "tiny"
TINY = [
    "--served-model-name",
    NAME,
    "--max-model-len",
    "64",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "32",
    "--block-size",
    "4",
    "--num-blocks",
    "64",
]
PROMPT = "the cat sat on the mat and the dog ran to the house"


@pytest.fixture(scope="module")
def folder(tiny_folder, tmp_path_factory):
    """The tiny model, with a generation_config.json that sets top_k 1 (and no temperature)."""
    folder = tmp_path_factory.mktemp("tiny-top-k-1") / "model"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "top_k": 1}))
    return folder


@pytest.fixture(scope="module")
def plain(folder, tmp_path_factory):
    """`--generation-config vllm`: the folder's sampling defaults are ignored; usage reports
    the prefix cache's hits (`--enable-prompt-tokens-details`)."""
    with run_server(
        tmp_path_factory.mktemp("plain"),
        "--model",
        str(folder),
        "--generation-config",
        "vllm",
        "--enable-prompt-tokens-details",
        *TINY,
        api_key=None,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    return AutoTokenizer.from_pretrained(folder)


def usage_of(client, **kw):
    return client.completions.create(model=NAME, max_tokens=1, **kw).usage


def test_a_text_prompt_gets_bos_as_transformers_adds_it(plain, hf_tokenizer):
    client = plain.client()
    want = hf_tokenizer(PROMPT).input_ids
    assert want[0] == hf_tokenizer.bos_token_id
    assert usage_of(client, prompt=PROMPT).prompt_tokens == len(want)
    without = usage_of(client, prompt=PROMPT, extra_body={"add_special_tokens": False}).prompt_tokens
    assert without == len(hf_tokenizer(PROMPT, add_special_tokens=False).input_ids) == len(want) - 1
    assert usage_of(client, prompt=[5, 6, 7]).prompt_tokens == 3  # token ids are used as they are


def test_a_chat_gets_exactly_one_bos_the_templates(plain, hf_tokenizer):
    client = plain.client()
    messages = [{"role": "system", "content": "you are a cat"}, {"role": "user", "content": "hello world"}]
    want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert want.count(hf_tokenizer.bos_token_id) == 1
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    assert out.usage.prompt_tokens == len(want)
    # Asking for the tokenizer's special tokens too gives the double BOS the default avoids.
    doubled = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=1, extra_body={"add_special_tokens": True}
    )
    assert doubled.usage.prompt_tokens == len(want) + 1


def test_a_request_cannot_bring_its_own_chat_template(plain):
    """Without --trust-request-chat-template a request's own template is a 400 naming it (as
    vLLM), so only the model's template renders, and only in transformers' sandbox (next test)."""
    client = plain.client()
    messages = [{"role": "user", "content": "hello world"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=1,
            extra_body={"chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"},
        )
    assert refused.value.body["param"] == "chat_template"


def test_templates_render_only_through_the_one_sandboxed_path():
    """jaxserve.engine.tokenization.render_chat calls transformers' apply_chat_template (sandboxed
    Jinja); no other code renders a template or imports jinja2 (keep it so)."""
    renderers = []
    for path in sorted(REPO.glob("*/**/*.py")):
        if path.parts[len(REPO.parts)] in ("tests", ".venv") or "site-packages" in path.parts:
            continue
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+jinja2", text, re.M), f"{path} imports jinja2"
        if "apply_chat_template(" in text:
            renderers.append(path.relative_to(REPO).as_posix())
    assert renderers == ["jaxserve/engine/tokenization.py"]


def test_include_stop_str_in_output_keeps_the_stop_string(plain):
    client = plain.client()
    kw = dict(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    # A later word whose first appearance is not at the start, so that text remains before it.
    stop = next(f" {w}" for w in whole.split()[2:] if whole.index(f" {w}") > 0)
    cut = whole.index(stop)  # greedy: the stop string ends the text where it first appears
    for include, want in ((False, whole[:cut]), (True, whole[: cut + len(stop)])):
        extra = {"ignore_eos": True, "include_stop_str_in_output": include}
        choice = client.completions.create(**{**kw, "extra_body": extra}, stop=[stop]).choices[0]
        assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (want, "stop", stop)
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(**{**kw, "extra_body": extra}, stop=[stop], stream=True)
            if c.choices
        )
        assert streamed == want


def test_cache_salt_keeps_prefix_cache_hits_within_one_salt(plain):
    client = plain.client()
    prompt = "one two three four five six seven eight nine ten sun moon star tree"  # 16 tokens with BOS

    def cached(**extra) -> int:
        return usage_of(client, prompt=prompt, extra_body=extra).prompt_tokens_details.cached_tokens

    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="bob") == 0  # the same prompt, another salt: nothing shared
    assert cached() == 0  # nor with unsalted requests
    assert cached(cache_salt="alice") >= 8  # the same salt: its full blocks are hits
    plain.wait_idle()


def every_usage(client) -> list:
    """The usage of a completion and a chat completion, whole and streamed, each run twice
    (the second finds the first's blocks in the prefix cache)."""
    prompt = "one two three four five six seven eight nine ten sun moon star tree"
    messages = [{"role": "user", "content": prompt}]
    usages = []
    for _ in range(2):
        usages.append(usage_of(client, prompt=prompt))
        usages.append(client.chat.completions.create(model=NAME, messages=messages, max_tokens=1).usage)
        stream = dict(max_tokens=1, stream=True, stream_options={"include_usage": True})
        usages.append(list(client.completions.create(model=NAME, prompt=prompt, **stream))[-1].usage)
        usages.append(list(client.chat.completions.create(model=NAME, messages=messages, **stream))[-1].usage)
    return usages


def test_cached_tokens_are_reported_only_with_the_flag(plain, folder, tmp_path_factory):
    """cached_tokens would tell any caller whether others sent its prefix: as in vLLM, usage has
    prompt_tokens_details only with --enable-prompt-tokens-details (which `plain` has)."""
    usages = every_usage(plain.client())
    assert all(u.prompt_tokens_details is not None for u in usages)
    assert all(u.prompt_tokens_details.cached_tokens >= 8 for u in usages[4:])  # the second round hits
    plain.wait_idle()
    args = ("--model", str(folder), "--generation-config", "vllm", *TINY)
    with run_server(tmp_path_factory.mktemp("no-details"), *args, api_key=None) as server:
        usages = every_usage(server.client())
        assert all(u.prompt_tokens_details is None and u.prompt_tokens > 0 for u in usages)


def sample_texts(client, n: int, extra: dict | None = None, **kw) -> list[str]:
    return [
        client.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=16, extra_body={"ignore_eos": True, **(extra or {})}, **kw
        )
        .choices[0]
        .text
        for _ in range(n)
    ]


def test_generation_config_defaults_fill_unset_fields(folder, plain, tmp_path_factory):
    """top_k 1 from generation_config.json makes temperature-1 sampling greedy, unless the
    request sets top_k itself or the server runs with --generation-config vllm."""
    greedy = sample_texts(plain.client(), 1, temperature=0)[0]
    # Without the defaults (vllm), seeded temperature-1 samples stray from greedy.
    plain_samples = sample_texts(plain.client(), 1, temperature=1.0, seed=1) + sample_texts(
        plain.client(), 1, temperature=1.0, seed=2
    )
    assert any(text != greedy for text in plain_samples), "temperature 1 sampled the greedy text twice"
    with run_server(tmp_path_factory.mktemp("defaults"), "--model", str(folder), *TINY, api_key=None) as server:
        client = server.client()
        assert sample_texts(client, 1, temperature=0) == [greedy]  # the same model
        # Unseeded, temperature 1, top_k left unset: the folder's top_k 1 makes it greedy.
        assert sample_texts(client, 3, temperature=1.0) == [greedy] * 3
        # A field the request sets wins over the default: top_k -1 (off) samples as vllm's does.
        assert sample_texts(client, 1, {"top_k": -1}, temperature=1.0, seed=1) == plain_samples[:1]
