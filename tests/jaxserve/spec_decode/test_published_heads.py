"""Published Medusa-1 heads (FasterDecoding's layout) load and draft as the authors' code
computes them: residual blocks then each head's own LM head, on transformers' last hidden
state after the final norm. The reference below is that math written in torch from the
published description, on tiny random heads for the tiny Llama; transformers gives the
hidden states.
"""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from jaxserve.model.inputs import ModelInputs
from jaxserve.model.kv_cache import allocate_kv_cache
from jaxserve.spec_decode.published_heads import load_published_medusa, published_medusa_folder
from scheduler import SamplingParams
from tests.jaxserve.spec_decode.test_spec_decode import engine, run, tokens, workload

HEADS, LAYERS = 3, 2
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"
PROMPT = [5, 17, 33, 8, 61, 20]


def random_medusa_state(dim: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Medusa-1 state dict: `{i}.{j}.linear.{weight,bias}` blocks, `{i}.{LAYERS}.weight` LM heads."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(HEADS):
        for j in range(LAYERS):
            state[f"{i}.{j}.linear.weight"] = 0.3 * torch.randn(dim, dim, generator=gen)
            state[f"{i}.{j}.linear.bias"] = 0.3 * torch.randn(dim, generator=gen)
        state[f"{i}.{LAYERS}.weight"] = torch.randn(vocab, dim, generator=gen)
    return state


def reference_logits(state: dict[str, torch.Tensor], normed_hidden: torch.Tensor) -> torch.Tensor:
    """[HEADS, T, V]: each head's residual blocks (x + SiLU(Wx + b)) then its LM head."""
    out = []
    for i in range(HEADS):
        x = normed_hidden
        for j in range(LAYERS):
            x = x + F.silu(F.linear(x, state[f"{i}.{j}.linear.weight"], state[f"{i}.{j}.linear.bias"]))
        out.append(F.linear(x, state[f"{i}.{LAYERS}.weight"]))
    return torch.stack(out)


def write_published(folder, state, *, pickle=False):
    folder.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": HEADS, "medusa_num_layers": LAYERS, "base_model_name_or_path": "tiny-llama"}
    (folder / "config.json").write_text(json.dumps(config))
    if pickle:
        torch.save(state, folder / "medusa_lm_head.pt")
    else:
        save_file(state, folder / "medusa_lm_head.safetensors")
    return folder


@pytest.fixture(scope="module")
def medusa_state(tiny_llama):
    return random_medusa_state(tiny_llama.config.hidden_size, tiny_llama.config.vocab_size)


@pytest.fixture(scope="module")
def published_dir(medusa_state, tmp_path_factory):
    return write_published(tmp_path_factory.mktemp("medusa-published"), medusa_state)


@pytest.fixture(scope="module")
def hf_normed_hidden(tiny_llama_dir):
    """transformers' last hidden state (after the final norm) of PROMPT, [T, D]."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf.model(torch.tensor([PROMPT])).last_hidden_state[0]


def our_hidden(loaded) -> np.ndarray:
    """Our target's hidden states of PROMPT, before the final norm."""
    n = len(PROMPT)
    inputs = ModelInputs.from_numpy(
        input_ids=PROMPT,
        positions=np.arange(n),
        slot_mapping=np.arange(n) + 4,
        query_start_loc=[0, n],
        seq_lens=[n],
        block_tables=[[1, 2]],
        logits_indices=[n - 1],
    )
    kv = allocate_kv_cache(loaded.config, 4, 4, loaded.model.dtype)
    return loaded.model.hidden_states(inputs, kv)[0][:n]


@pytest.mark.parametrize("pickle", [False, True], ids=["safetensors", "torch-pickle"])
def test_heads_compute_the_published_math(tiny_llama, medusa_state, hf_normed_hidden, pickle, tmp_path):
    folder = published_medusa_folder(str(write_published(tmp_path / "heads", medusa_state, pickle=pickle)))
    heads, info = load_published_medusa(folder, tiny_llama.config)
    assert heads.num_heads == HEADS and info["method"] == "medusa"
    ours = np.asarray(heads(tiny_llama.model, our_hidden(tiny_llama)))
    want = reference_logits(medusa_state, hf_normed_hidden).numpy()
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_engine_drafts_are_the_published_heads_top_tokens(tiny_llama, medusa_state, published_dir, hf_normed_hidden):
    """After the prefill, the tree's node (r_1 .. r_d) holds head d's candidate of rank r_d,
    ranked by the reference logits at the prompt's last position."""
    spec = {"method": "medusa", "model": str(published_dir), "num_speculative_tokens": HEADS}
    eng = engine(tiny_llama, {**spec, "speculative_token_tree": TREE})
    eng.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    eng.step()
    eng.proposer.propose(eng.scheduler.running)
    ranked = torch.argsort(reference_logits(medusa_state, hf_normed_hidden[-1:])[:, 0], dim=-1, descending=True)
    tree = eng.config.speculative_config.tree
    want = [int(ranked[tree.depth[i] - 1, tree.rank[i]]) for i in range(1, tree.num_nodes + 1)]
    assert eng.scheduler.requests["a"].spec_token_ids == want


def test_greedy_with_published_heads_equals_plain(tiny_llama, published_dir):
    prompts, params = workload(seed=7, count=8)
    want = tokens(run(engine(tiny_llama), prompts, params))
    eng = engine(tiny_llama, {"method": "medusa", "model": str(published_dir), "num_speculative_tokens": HEADS})
    assert tokens(run(eng, prompts, params)) == want
    assert eng.scheduler.spec_stats.num_drafts > 0


def test_heads_for_another_target_or_incomplete_are_refused(tiny_llama, medusa_state, tmp_path):
    wrong = {k: (v[:-1] if k.endswith(f".{LAYERS}.weight") else v) for k, v in medusa_state.items()}
    folder = write_published(tmp_path / "wrong", wrong)
    with pytest.raises(ValueError, match="trained for tiny-llama .*vocabulary"):
        load_published_medusa(folder, tiny_llama.config)
    folder = write_published(tmp_path / "missing", {k: v for k, v in medusa_state.items() if k != "1.0.linear.bias"})
    with pytest.raises(ValueError, match="lacks 1.0.linear.bias"):
        load_published_medusa(folder, tiny_llama.config)
    assert published_medusa_folder(str(tmp_path / "nothing-here")) is None
