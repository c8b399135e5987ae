"""`python -m jaxserve.train_lora`: an adapter trained through the serving model's code is a
PEFT folder that `peft` loads, whose loss on the training completions `peft` itself measures
lower than the base model's, and that this engine serves with peft's tokens."""

import json

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxserve.lora import LoRARequest
from jaxserve.train_lora import main, read_examples
from jaxserve.weights import load_model

# One fact to learn per prompt: a completion the random base model would not write.
PAIRS = [
    ("the cat sat on the", "red mat"),
    ("a dog ran to the", "big house"),
    ("he is", "one two three"),
    ("we see the", "sun and moon"),
    ("they eat", "fish"),
    ("she was in the", "blue sea"),
]


def write_data(path, chat: bool):
    with path.open("w") as f:
        for prompt, completion in PAIRS:
            if chat:
                line = {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]}
            else:
                line = {"prompt": prompt, "completion": completion}
            f.write(json.dumps(line) + "\n")
    return path


def peft_loss(model, examples) -> float:
    """The mean cross-entropy of the completion tokens, by torch: the oracle of the training loss."""
    tokens, targets = torch.tensor(examples.tokens.astype(np.int64)), torch.tensor(examples.targets)
    with torch.no_grad():
        logits = model(tokens).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none"
    )
    mask = targets[:, :-1].reshape(-1)
    return float((ce * mask).sum() / mask.sum())


@pytest.mark.parametrize("chat", [False, True], ids=["prompt-completion", "chat"])
def test_trained_adapter_lowers_peft_s_loss_and_serves_peft_s_tokens(tiny_llama_tok_dir, tmp_path, chat, capsys):
    data = write_data(tmp_path / "train.jsonl", chat)
    out = tmp_path / "adapter"
    args = ["--model", str(tiny_llama_tok_dir), "--data", str(data), "--out", str(out)]
    args += [
        "--rank",
        "4",
        "--steps",
        "60",
        "--batch",
        "4",
        "--lr",
        "3e-2",
        "--target-modules",
        "q_proj,v_proj,up_proj",
    ]
    assert main(args) == 0
    assert "wrote the PEFT adapter" in capsys.readouterr().out
    assert {"adapter_config.json", "adapter_model.safetensors", "loss.png", "training.json"} <= {
        p.name for p in out.iterdir()
    }
    losses = json.loads((out / "training.json").read_text())["losses"]
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:5])

    loaded = load_model(str(tiny_llama_tok_dir), use_cache=False, progress=False)
    examples = read_examples(data, loaded.tokenizer, loaded.config.vocab_size, 512)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_tok_dir, torch_dtype=torch.float32).eval()
    before = peft_loss(base, examples)
    tuned = PeftModel.from_pretrained(base, out).eval()
    after = peft_loss(tuned, examples)
    assert after < 0.5 * before, (before, after)

    # The server's reading of the folder gives peft's greedy tokens for a training prompt.
    from jaxserve.engine import EngineConfig, LLMEngine
    from scheduler import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_tok_dir)
    prompt = examples.tokens[0][: int(np.argmax(examples.targets[0])) + 1].tolist()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(tuned(torch.tensor([ids])).logits[0, -1].argmax()))
    engine = LLMEngine(
        loaded,
        EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64, enable_lora=True, max_lora_rank=4),
    )
    engine.add_request(
        "a",
        prompt,
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        lora_request=LoRARequest("t", 1, str(out)),
    )
    (output,) = engine.generate_all()
    assert list(output.outputs[0].token_ids) == ids[len(prompt) :]
    assert tokenizer.decode(ids[len(prompt) :]).startswith(PAIRS[0][1].split()[0])  # it learned the first word


def test_bad_data_is_refused_naming_the_line(tiny_llama_tok_dir, tmp_path):
    loaded = load_model(str(tiny_llama_tok_dir), use_cache=False, progress=False)
    bad = tmp_path / "bad.jsonl"
    for text, message in [
        ('{"prompt": "a"}\n', "bad.jsonl:1: expected"),
        ('{"prompt": "a", "completion": "b"}\nnot json\n', "bad.jsonl:2: not JSON"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', "must end with an assistant message"),
    ]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_examples(bad, loaded.tokenizer, loaded.config.vocab_size, 512)
