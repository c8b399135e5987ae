"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from flax import nnx

from jaxserve.engine import EngineConfig, LLMEngine
from jaxserve.weights.params import _hf_name
from scheduler import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


def test_gguf_weights_equal_transformers_reading(default_model, hf_default_model):
    """Our GGUF reader (dequantize + undo llama.cpp's Q/K permutation) vs transformers'."""
    hf = {k: v.numpy() for k, v in hf_default_model.state_dict().items()}
    ours = nnx.to_pure_dict(nnx.state(default_model.model))
    checked = 0
    for group, leaves in [(("embed_tokens",), ours["embed_tokens"]), (("norm",), ours["norm"])]:
        for leaf, value in leaves.items():
            np.testing.assert_array_equal(np.asarray(value), hf[_hf_name(group + (leaf,))])
            checked += 1

    def walk(tree, path):
        nonlocal checked
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, path + (key,))
                continue
            want = hf[_hf_name(path + (key,))]
            got = np.asarray(value).T if key == "kernel" else np.asarray(value)
            np.testing.assert_array_equal(got, want, err_msg=_hf_name(path + (key,)))
            checked += 1

    assert sorted(ours["layers"]) == list(range(30))  # separate layers, the serving layout
    for layer, tree in ours["layers"].items():
        walk(tree, ("layers", layer))
    assert checked == 2 + 30 * 9


@pytest.mark.parametrize("tp", [1, 3])
def test_greedy_continuations_equal_transformers_generate(default_model, hf_default_model, tp):
    """On one device, and split over three (its 9 heads and 3 KV heads, 3 per device)."""
    tok = default_model.tokenizer
    engine = LLMEngine(
        default_model,
        EngineConfig(
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=128,
            kv_cache_memory=64 << 20,
            tensor_parallel_size=tp,
        ),
    )
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=32))
    ours = {o.request_id: o.outputs[0].token_ids for o in engine.generate_all()}
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([tok.encode(p, add_special_tokens=False)])
        with torch.no_grad():
            want = hf_default_model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :].tolist()
        assert ours[str(i)] == want, f"prompt {p!r}: {tok.decode(ours[str(i)])!r} != {tok.decode(want)!r}"
    assert tok.decode(ours["0"]).startswith(" Paris.")


@pytest.mark.default_model
def test_generate_cli_prints_paris_without_torch(tmp_path):
    """The whole path, first start included (GGUF conversion, tokenizer, engine, CLI), with
    torch made unimportable: the engine must never need it."""
    code = (
        "import sys; sys.modules['torch'] = None; from jaxserve.generate import main; "
        f"sys.exit(main(['The capital of France is', '--max-tokens', '3', '--cache-dir', {str(tmp_path)!r}]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(" Paris."), out.stdout
    assert "prompt tokens: 5, generated tokens: 3" in out.stderr


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is",
        "Hello, world! How's it going?\n\tIndented.",
        "naïve café — déjà vu 日本語 🙂",
        "<|im_start|>user\nhi<|im_end|>",
    ],
)
def test_gguf_tokenizer_matches_transformers(default_model, text):
    """On text without digits our GGUF tokenizer agrees with transformers' GGUF reader."""
    from transformers import AutoTokenizer

    from jaxserve.weights.default_model import default_model_path

    path = default_model_path()
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = default_model.tokenizer
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids) == text


def test_gguf_tokenizer_splits_digits_like_llama_cpp(default_model):
    """tokenizer.ggml.pre = "smollm": llama.cpp (and SmolLM's own tokenizer) split every digit."""
    tok = default_model.tokenizer
    ids = tok.encode("in 2018", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == ["in", " ", "2", "0", "1", "8"]
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_generate_cli_runs_a_prompts_file_as_one_batch(weights_cache, default_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n\nThe three primary colors are\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxserve.generate",
            "--prompts-file",
            str(prompts),
            "--max-tokens",
            "8",
            "--cache-dir",
            str(weights_cache),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    blocks = out.stdout.split("--- [")[1:]
    assert sorted(b.split("]")[0] for b in blocks) == ["0", "1"]  # the blank line is skipped
    assert " Paris." in out.stdout
    assert "generated tokens: 16" in out.stderr
