"""vLLM's offline API on `LLM`: `chat`, `{"prompt_token_ids": [...]}` prompts, `dtype="auto"`,
and the CPU XLA flags `import jaxserve` sets.

Oracles: transformers' `apply_chat_template` (token ids) for chat prompts, the same
prompts given as plain text or ids, and the flags jaxserve documents."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from jaxserve import LLM
from jaxserve.weights.default_model import default_model_path
from jaxserve.weights.dtype import checkpoint_dtype, choose_dtype, config_dtype
from scheduler import SamplingParams
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
CHAT = [{"role": "system", "content": "you are a big cat"}, {"role": "user", "content": "hello the dog sat"}]


@pytest.fixture(scope="module")
def llm(tiny_llama_tok_dir, weights_cache):
    return LLM(
        str(tiny_llama_tok_dir),
        cache_dir=weights_cache,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=(32,),
        max_model_len=96,
        num_blocks=64,
    )


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_tok_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_tok_dir)


def hf_chat_ids(tokenizer, messages, **kwargs) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# -- LLM.chat ---------------------------------------------------------------------------


def test_chat_equals_generate_on_the_template_rendered_by_transformers(llm, hf_tokenizer):
    ids = hf_chat_ids(hf_tokenizer, CHAT, add_generation_prompt=True)
    (out,) = llm.chat(CHAT, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert tokens([out]) == tokens(llm.generate([ids], GREEDY, use_tqdm=False))
    assert len(out.outputs[0].token_ids) == 6


def test_chat_takes_a_list_of_conversations(llm, hf_tokenizer):
    other = [{"role": "user", "content": "one two three"}]
    outs = llm.chat([CHAT, other], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        hf_chat_ids(hf_tokenizer, c, add_generation_prompt=True) for c in (CHAT, other)
    ]
    assert tokens(outs) == tokens(llm.generate([o.prompt_token_ids for o in outs], GREEDY, use_tqdm=False))


def test_chat_switches_reach_the_template(llm, hf_tokenizer):
    ongoing = [*CHAT, {"role": "assistant", "content": "yes the cat"}]
    (cont,) = llm.chat(ongoing, GREEDY, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    assert cont.prompt_token_ids == hf_chat_ids(hf_tokenizer, ongoing, continue_final_message=True)
    (plain,) = llm.chat(CHAT, GREEDY, add_generation_prompt=False, use_tqdm=False)
    assert plain.prompt_token_ids == hf_chat_ids(hf_tokenizer, CHAT, add_generation_prompt=False)
    assert plain.prompt_token_ids != llm.chat(CHAT, GREEDY, use_tqdm=False)[0].prompt_token_ids


def test_chat_template_and_its_variables(llm, hf_tokenizer):
    template = "{{ bos_token }}{{ mood }} {% for m in messages %}{{ m['content'] }} {% endfor %}assistant :"
    (out,) = llm.chat(CHAT, GREEDY, chat_template=template, chat_template_kwargs={"mood": "good"}, use_tqdm=False)
    expected = hf_chat_ids(hf_tokenizer, CHAT, chat_template=template, mood="good")
    assert out.prompt_token_ids == expected and hf_tokenizer.decode(expected[1:3]) == "good you"


def test_chat_refuses_both_generation_prompt_and_continuation(llm):
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(CHAT, GREEDY, continue_final_message=True, use_tqdm=False)


# -- prompt forms -----------------------------------------------------------------------


def test_prompt_token_ids_dicts_mix_with_text(llm, hf_tokenizer):
    text, ids = "the big dog ran to the house", [1, 20, 21, 22]
    outs = llm.generate([{"prompt_token_ids": ids}, text, {"prompt": text}], GREEDY, use_tqdm=False)
    assert outs[0].prompt_token_ids == ids
    assert outs[1].prompt_token_ids == outs[2].prompt_token_ids == hf_tokenizer.encode(text)
    assert tokens(outs) == tokens(llm.generate([ids, text, text], GREEDY, use_tqdm=False))
    (single,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert tokens([single]) == tokens(outs[:1])


@pytest.mark.parametrize("prompt", [{"prompt_token_ids": [1, 2], "multi_modal_data": {}}, {"tokens": [1, 2]}, {}])
def test_a_prompt_dict_with_other_keys_is_refused(llm, prompt):
    with pytest.raises(ValueError, match='"prompt_token_ids" .* or "prompt"'):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


# -- dtype="auto" -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "requested,checkpoint,backend,expected",
    [
        ("auto", "bfloat16", "gpu", "bfloat16"),
        ("auto", "float16", "gpu", "float16"),
        ("auto", "bfloat16", "tpu", "bfloat16"),
        ("auto", "bfloat16", "cpu", "float32"),
        ("float16", "bfloat16", "cpu", "float16"),
        ("float32", "bfloat16", "gpu", "float32"),
    ],
)
def test_auto_dtype_choice(requested, checkpoint, backend, expected):
    assert choose_dtype(requested, checkpoint, backend) == expected


def test_checkpoint_dtype_is_what_transformers_saved(tmp_path):
    make_tiny_model("llama", tmp_path, dtype="bfloat16")  # transformers writes dtype (or torch_dtype)
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    assert config_dtype({"torch_dtype": "float16"}) == "float16"
    assert config_dtype({}) == config_dtype({"torch_dtype": "int8"}) == "float32"
    # The default model is a Q4_1 GGUF file: no 16-bit float tensors, so float16.
    assert checkpoint_dtype(default_model_path()) == "float16"


def test_auto_is_the_default_and_runs_float32_on_the_cpu(llm):
    from api.__main__ import parse_args as api_args
    from jaxserve.generate import parse_args as generate_args

    assert api_args([]).dtype == generate_args(["hi"]).dtype == "auto"
    assert str(llm.engine.loaded.model.dtype) == "float32"


# -- XLA flags --------------------------------------------------------------------------

FLAG_NAMES = [
    "xla_cpu_enable_fast_math",
    "xla_cpu_fast_math_honor_infs",
    "xla_cpu_fast_math_honor_nans",
    "xla_cpu_fast_math_honor_division",
    "xla_cpu_fast_math_honor_functions",
]


def xla_flags_after_import(**env) -> str | None:
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXSERVE_NO_XLA_FLAGS")}
    code = "import jaxserve, os; print(repr(os.environ.get('XLA_FLAGS')))"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return ast.literal_eval(out)


def test_xla_flags_are_appended_only_where_the_user_set_none():
    assert xla_flags_after_import().split() == [f"--{n}=true" for n in FLAG_NAMES]
    mine = "--xla_cpu_fast_math_honor_nans=false --xla_force_host_platform_device_count=2"
    flags = xla_flags_after_import(XLA_FLAGS=mine).split()
    assert flags[:2] == mine.split()
    assert sorted(flags[2:]) == sorted(f"--{n}=true" for n in FLAG_NAMES if n != "xla_cpu_fast_math_honor_nans")
    assert xla_flags_after_import(XLA_FLAGS="--xla_cpu_enable_fast_math=false").split() == [
        "--xla_cpu_enable_fast_math=false",
        *[f"--{n}=true" for n in FLAG_NAMES[1:]],
    ]


def test_no_xla_flags_when_asked():
    assert xla_flags_after_import(JAXSERVE_NO_XLA_FLAGS="1") is None
    assert xla_flags_after_import(JAXSERVE_NO_XLA_FLAGS="1", XLA_FLAGS="--xla_dump_to=/tmp/x") == "--xla_dump_to=/tmp/x"
