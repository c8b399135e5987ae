"""vLLM's offline API on `LLM`: `chat`, `{"prompt_token_ids": [...]}` prompts, `dtype="auto"`,
and the CPU XLA options the engine compiles with (`import jaxserve` sets none).

Oracles: transformers' `apply_chat_template` (token ids) for chat prompts, the same
prompts given as plain text or ids, a fresh interpreter's environment before and after
the import, and XLA's own dump of the options each program was compiled with."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from jaxserve import LLM
from jaxserve.runner.compile_options import engine_compiler_options
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


# -- XLA options ------------------------------------------------------------------------

FLAG_NAMES = [
    "xla_cpu_enable_fast_math",
    "xla_cpu_fast_math_honor_infs",
    "xla_cpu_fast_math_honor_nans",
    "xla_cpu_fast_math_honor_division",
    "xla_cpu_fast_math_honor_functions",
]
REPO = Path(__file__).resolve().parents[3]


def run_python(code: str, **env) -> str:
    """`code` run by a fresh interpreter from the repository's root, its environment without
    the XLA variables but for `env`; its stdout."""
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXSERVE_NO_XLA_FLAGS")}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout


@pytest.mark.parametrize("xla_flags", [None, "--xla_cpu_fast_math_honor_nans=false"])
def test_importing_jaxserve_changes_no_environment_variable(xla_flags):
    code = (
        "import os; before = dict(os.environ); import jaxserve; from jaxserve import LLM, LLMEngine, SamplingParams; "
        "import jaxserve.engine, jaxserve.runner.model_runner, api.server; print(repr(before == dict(os.environ)))"
    )
    env = {} if xla_flags is None else {"XLA_FLAGS": xla_flags}
    assert ast.literal_eval(run_python(code, **env)) is True


def test_loading_a_tokenizer_without_torch_gives_no_advice_and_leaves_the_environment(tiny_llama_tok_dir):
    """transformers advises at import that torch is missing (torch hidden here, as in an
    install without it); jaxserve silences that for the one import and restores the environment."""
    code = (
        "import os, sys; sys.modules['torch'] = None; before = dict(os.environ); "
        "from jaxserve.weights.load import load_tokenizer; "
        f"load_tokenizer({str(tiny_llama_tok_dir)!r}); print(repr(before == dict(os.environ)))"
    )
    base = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=base, capture_output=True, text=True, check=True, timeout=300
    )
    assert ast.literal_eval(out.stdout) is True
    assert "PyTorch was not found" not in out.stderr
    hidden = code.replace("from jaxserve.weights.load", "import transformers; from jaxserve.weights.load")
    assert (
        "PyTorch was not found"
        in subprocess.run(  # the oracle: the advice, when transformers comes first
            [sys.executable, "-c", hidden], cwd=REPO, env=base, capture_output=True, text=True, timeout=300
        ).stderr
    )


def test_engine_options_leave_out_what_xla_flags_sets():
    assert engine_compiler_options("cpu", {}) == dict.fromkeys(FLAG_NAMES, True)
    mine = {"XLA_FLAGS": "--xla_cpu_fast_math_honor_nans=false --xla_force_host_platform_device_count=2"}
    assert engine_compiler_options("cpu", mine) == {n: True for n in FLAG_NAMES if n != "xla_cpu_fast_math_honor_nans"}
    assert engine_compiler_options("cpu", {"XLA_FLAGS": " ".join(f"--{n}=false" for n in FLAG_NAMES)}) is None
    assert engine_compiler_options("cpu", {"JAXSERVE_NO_XLA_FLAGS": "1"}) is None
    assert engine_compiler_options("gpu", {}) is None  # XLA's CPU options


ENGINE_AND_ANOTHER_PROGRAM = """
import sys
import jax, jax.numpy as jnp
from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.weights import load_model

loaded = load_model(sys.argv[1], use_cache=False, progress=False)
config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=8, token_buckets=(8,), max_model_len=32, num_blocks=16)
LLMEngine(loaded, config)

def someone_elses(x):  # other JAX code in the same process, compiled after the engine's
    return jnp.sum(x * x)

jax.jit(someone_elses)(jnp.ones(8)).block_until_ready()
"""


@pytest.mark.parametrize("env", [{}, {"JAXSERVE_NO_XLA_FLAGS": "1"}, {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}])
def test_the_engines_programs_and_no_others_compile_with_reassociation(tiny_llama_dir, tmp_path, env):
    """XLA's own record of what it compiled each program with (--xla_dump_to writes each
    module's debug options that differ from the defaults) says whether fast math was on: for
    the engine's step programs unless asked not to or XLA_FLAGS says otherwise; never for others."""
    dump = tmp_path / "dump"
    code = f"import sys; sys.argv[1:] = [{str(tiny_llama_dir)!r}]\n{ENGINE_AND_ANOTHER_PROGRAM}"
    run_python(code, **{**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump}"})

    def fast_math(path: Path) -> bool:
        return "xla_cpu_enable_fast_math: true" in path.read_text()

    steps = [*dump.glob("module_*.jit_body.debug_options"), *dump.glob("module_*.jit_head.debug_options")]
    assert len(steps) >= 2
    assert [fast_math(p) for p in steps] == [not env] * len(steps)
    (other,) = dump.glob("module_*.jit_someone_elses.debug_options")
    assert not fast_math(other)
