"""Prompts become exactly the token ids Hugging Face makes, and generation configs are read
as vLLM reads them. Oracle: transformers' own tokenizer, chat template and `generate` on
the same tiny folder (a random model with a real tokenizer.json that adds BOS)."""

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.engine.tokenization import PromptError, encode_chat, encode_prompt
from jaxserve.weights import load_model
from scheduler import SamplingParams

PROMPT = "the cat sat on the mat and the dog ran to the house"
SMALL = dict(
    max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32), block_size=4, num_blocks=64, max_model_len=64
)


@pytest.fixture(scope="module")
def bos_folder(tiny_llama_tok_dir):
    return tiny_llama_tok_dir


@pytest.fixture(scope="module")
def loaded(tiny_llama_tok):
    return tiny_llama_tok


@pytest.fixture(scope="module")
def hf(bos_folder):
    return AutoTokenizer.from_pretrained(bos_folder), AutoModelForCausalLM.from_pretrained(bos_folder).eval()


def hf_greedy(model, ids: list[int], max_new_tokens: int, **kw) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return out[0, len(ids) :].tolist()


def test_text_prompt_gets_bos_and_continues_like_transformers(loaded, hf):
    tokenizer, model = hf
    want_ids = tokenizer(PROMPT).input_ids
    assert want_ids[0] == tokenizer.bos_token_id == 1
    engine = LLMEngine(loaded, EngineConfig(**SMALL))
    engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=12))
    (out,) = engine.generate_all()
    assert out.prompt_token_ids == want_ids
    assert out.outputs[0].token_ids == hf_greedy(model, want_ids, 12)


def test_add_special_tokens_false_leaves_the_text_alone(loaded, hf):
    tokenizer, _ = hf
    ids = encode_prompt(loaded.tokenizer, PROMPT, 97, add_special_tokens=False)
    assert ids == tokenizer(PROMPT, add_special_tokens=False).input_ids and ids[0] != 1


def test_chat_template_decides_bos_alone(loaded, hf):
    tokenizer, _ = hf
    messages = [{"role": "system", "content": "you are a cat"}, {"role": "user", "content": "hello world"}]
    text, ids = encode_chat(loaded.tokenizer, messages, 97)
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert ids == want
    assert ids.count(1) == 1 and text.startswith("<s>"), "one BOS: the template's"


def test_chat_templates_render_in_a_sandbox(loaded):
    tokenizer = loaded.tokenizer
    hostile = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(PromptError, match="could not render"):
        encode_chat(tokenizer, [{"role": "user", "content": "hi"}], 97, chat_template=hostile)


def test_token_id_prompts_are_checked_not_re_tokenized(loaded):
    assert encode_prompt(loaded.tokenizer, [5, 6, 7], 97) == [5, 6, 7]
    for bad in ([5, 97], [-1], [True, 5], [1.5]):
        with pytest.raises(PromptError):
            encode_prompt(loaded.tokenizer, bad, 97)


def folder_with_generation_config(src, dst, config: dict):
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(config))
    return dst


def test_generation_config_eos_ids_stop_at_either(bos_folder, loaded, hf, tmp_path):
    """Pick two tokens of the greedy continuation, a (first seen at i) and b (first seen at
    j > i); eos [b, a] stops at i, eos [b, unseen] at j; transformers agrees on both."""
    tokenizer, _ = hf
    ids = tokenizer(PROMPT).input_ids
    engine = LLMEngine(loaded, EngineConfig(**SMALL))
    engine.add_request("free", PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    (out,) = engine.generate_all()
    free_run = out.outputs[0].token_ids
    before_eos = free_run[: free_run.index(2)] if 2 in free_run else free_run
    firsts = {}
    for pos, t in enumerate(before_eos):
        firsts.setdefault(t, pos)
    (a, i), (b, j) = sorted(firsts.items(), key=lambda kv: kv[1])[:2]
    unseen = next(t for t in range(3, 97) if t not in free_run)
    for eos, stop_at in (([b, a], i), ([b, unseen], j)):
        folder = folder_with_generation_config(bos_folder, tmp_path / f"eos-{eos[1]}", {"eos_token_id": eos})
        engine = LLMEngine(load_model(str(folder), use_cache=False, progress=False), EngineConfig(**SMALL))
        assert set(engine.eos_token_ids) == set(eos) | {2}  # config.json's stays
        engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=24))
        (out,) = engine.generate_all()
        got = out.outputs[0].token_ids
        assert got == free_run[: stop_at + 1] and out.outputs[0].finish_reason == "stop"
        assert got == hf_greedy(AutoModelForCausalLM.from_pretrained(folder).eval(), ids, 24)


def test_generation_config_sampling_defaults(bos_folder, tmp_path):
    folder = folder_with_generation_config(
        bos_folder,
        tmp_path / "defaults",
        {
            "eos_token_id": 2,
            "temperature": 0.6,
            "top_k": 7,
            "top_p": 0.8,
            "repetition_penalty": 1.1,
            "max_new_tokens": 5,
            "do_sample": True,
        },
    )
    loaded = load_model(str(folder), use_cache=False, progress=False)
    auto = LLMEngine(loaded, EngineConfig(**SMALL, warm_up=False))
    params = auto.default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty, params.max_tokens) == (
        0.6,
        7,
        0.8,
        1.1,
        5,
    )
    assert auto.default_sampling_params(temperature=0).temperature == 0  # a request's own value wins
    ignored = LLMEngine(loaded, EngineConfig(**SMALL, warm_up=False, generation_config="vllm"))
    assert ignored.default_sampling_params() == SamplingParams()
    # A folder given as --generation-config replaces the model's own file.
    other = folder_with_generation_config(bos_folder, tmp_path / "other", {"temperature": 0.1})
    elsewhere = LLMEngine(loaded, EngineConfig(**SMALL, warm_up=False, generation_config=str(other)))
    assert elsewhere.default_sampling_params().temperature == 0.1
    # Unset fields of a request with no params take the defaults: max_new_tokens=5 here.
    auto.add_request("r", PROMPT)
    assert np.all([len(o.outputs[0].token_ids) <= 5 for o in auto.generate_all()])
