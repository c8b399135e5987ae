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

from jaxserve.spec_decode.published_heads import load_published_medusa, published_folder
from scheduler import SamplingParams
from tests.jaxserve.spec_decode.test_spec_decode import engine, run, tokens, workload
from tests.jaxserve.spec_decode.test_spec_decode_medusa import prompt_hidden_states

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


@pytest.mark.parametrize("pickle", [False, True], ids=["safetensors", "torch-pickle"])
def test_heads_compute_the_published_math(tiny_llama, medusa_state, hf_normed_hidden, pickle, tmp_path):
    folder = published_folder(str(write_published(tmp_path / "heads", medusa_state, pickle=pickle)), "medusa")
    heads, info = load_published_medusa(folder, tiny_llama.config)
    assert heads.num_heads == HEADS and info["method"] == "medusa"
    ours = np.asarray(heads(tiny_llama.model, prompt_hidden_states(tiny_llama, PROMPT)))
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
    assert published_folder(str(tmp_path / "nothing-here"), "medusa") is None


# -- EAGLE-1 ------------------------------------------------------------------------------

K = 3


@pytest.fixture(scope="module")
def eagle_layer(tiny_llama_dir):
    """transformers' own Llama decoder layer with random weights and, as EAGLE-1's only layer,
    no input norm; and the tensors of the head's published state dict."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig.from_pretrained(tiny_llama_dir, num_hidden_layers=1)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    layer.input_layernorm = torch.nn.Identity()
    d = config.hidden_size
    state = {f"layers.0.{name}": p.detach().clone() for name, p in layer.state_dict().items()}
    state["fc.weight"], state["fc.bias"] = 0.2 * torch.randn(d, 2 * d), 0.1 * torch.randn(d)
    return layer, LlamaRotaryEmbedding(config), state


def write_eagle(folder, state, tiny_llama_dir, *, pickle=False):
    folder.mkdir(parents=True, exist_ok=True)
    config = {**json.loads((tiny_llama_dir / "config.json").read_text()), "num_hidden_layers": 1, "bias": True}
    (folder / "config.json").write_text(json.dumps(config))
    if pickle:
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    return folder


def reference_eagle_chain(eagle_layer, hf, prompt, k):
    """EAGLE-1's greedy chain of k drafts after `prompt`, as its authors compute it: entry i
    is fc([embedding of x_{i+1}; f_i]) with f_i the target's normed hidden state (the head's own
    output once drafting), the layer runs causally over all entries, and each output goes
    through the target's LM head alone."""
    layer, rope, state = eagle_layer
    with torch.no_grad():
        out = hf.model(torch.tensor([prompt]))
        feats = out.last_hidden_state[0]
        tokens = prompt[1:] + [int(hf.lm_head(feats[-1]).argmax())]  # x_1 .. x_n (x_n: the target's greedy)
        drafts = []
        for _ in range(k):
            emb = hf.model.embed_tokens(torch.tensor(tokens))
            x = F.linear(torch.cat([emb, feats], dim=-1), state["fc.weight"], state["fc.bias"])[None]
            n = x.shape[1]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            y = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope(x, pos))[0]
            drafts.append(int(hf.lm_head(y[-1]).argmax()))
            feats = torch.cat([feats, y[-1:]])
            tokens.append(drafts[-1])
    return drafts


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("pickle", [False, True], ids=["safetensors", "torch-pickle"])
def test_engine_drafts_are_the_published_eagle_chain(
    tiny_llama, tiny_llama_dir, eagle_layer, hf_tiny, pickle, tmp_path
):
    folder = write_eagle(tmp_path / "eagle", eagle_layer[2], tiny_llama_dir, pickle=pickle)
    eng = engine(tiny_llama, {"method": "eagle", "model": str(folder), "num_speculative_tokens": K})
    eng.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    eng.step()  # the prefill, then the head's entries for it
    eng.proposer.propose(eng.scheduler.running)
    assert eng.scheduler.requests["a"].spec_token_ids == reference_eagle_chain(eagle_layer, hf_tiny, PROMPT, K)


def test_greedy_with_published_eagle_equals_plain(tiny_llama, tiny_llama_dir, eagle_layer, tmp_path):
    prompts, params = workload(seed=7, count=8)
    want = tokens(run(engine(tiny_llama), prompts, params))
    folder = write_eagle(tmp_path / "eagle", eagle_layer[2], tiny_llama_dir)
    eng = engine(tiny_llama, {"method": "eagle", "model": str(folder), "num_speculative_tokens": K})
    assert tokens(run(eng, prompts, params)) == want
    assert eng.scheduler.spec_stats.num_drafts > 0


def test_bad_published_eagle_heads_are_refused(tiny_llama, tiny_llama_dir, eagle_layer, tmp_path):
    from jaxserve.spec_decode.published_heads import load_published_eagle

    state = eagle_layer[2]
    folder = write_eagle(tmp_path / "missing", {k: v for k, v in state.items() if "down_proj" not in k}, tiny_llama_dir)
    with pytest.raises(ValueError, match="lacks the head's layer.mlp.down_proj.kernel"):
        load_published_eagle(published_folder(str(folder), "eagle"), tiny_llama.config)
    folder = write_eagle(
        tmp_path / "extra", {**state, "layers.1.mlp.up_proj.weight": state["fc.bias"].clone()}, tiny_llama_dir
    )
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj.weight"):
        load_published_eagle(published_folder(str(folder), "eagle"), tiny_llama.config)
    eagle3 = write_eagle(tmp_path / "eagle3", state, tiny_llama_dir)
    eagle3_config = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32}
    (eagle3 / "config.json").write_text(json.dumps(eagle3_config))
    with pytest.raises(ValueError, match="EAGLE-3 heads, which do not load yet"):
        published_folder(str(eagle3), "eagle")
    with pytest.raises(ValueError, match="published eagle heads, not medusa ones"):
        published_folder(str(folder), "medusa")
