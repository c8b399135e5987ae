"""A mixture-of-experts model served and generated from the command line, as a user runs
them: the real server with the openai client, and `jaxserve generate`, on a tiny Qwen2-MoE
folder (experts, a shared expert and one dense layer) with a real tokenizer. The oracle is
transformers' greedy generation on the same weights."""

import subprocess
import sys

import openai
import pytest
import torch

from tests.api.conftest import REPO, run_server
from tests.tiny_models import make_tiny_model, make_tiny_tokenizer

pytestmark = pytest.mark.slow  # a server in a subprocess

PROMPTS = ["the cat sat on the mat and", "one two three four"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen2-moe")
    hf_model = make_tiny_model("qwen2-moe", folder)
    make_tiny_tokenizer(folder)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    want = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    assert all(len(w.split()) >= MAX_TOKENS // 2 for w in want), want  # words to compare, not an early stop
    return folder, want


def test_the_server_answers_as_transformers_generates(moe_folder, tmp_path):
    folder, want = moe_folder
    with run_server(tmp_path, "--model", str(folder), "--max-model-len", "64", "--num-blocks", "64") as server:
        client: openai.OpenAI = server.client()
        (model,) = [m.id for m in client.models.list().data]
        got = [
            client.completions.create(
                model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
            for p in PROMPTS
        ]
        stream = client.completions.create(
            model=model,
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert [g.strip() for g in got] == [w.strip() for w in want]
    assert streamed == got[0]


def test_generate_cli_prints_what_transformers_generates(moe_folder):
    folder, want = moe_folder
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxserve.generate",
            PROMPTS[0],
            "--model",
            str(folder),
            "--max-tokens",
            str(MAX_TOKENS),
            "--temperature",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert want[0].strip() in out.stdout
