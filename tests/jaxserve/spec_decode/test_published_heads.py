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
    with pytest.raises(ValueError, match="published eagle heads, not medusa ones"):
        published_folder(str(folder), "medusa")


# -- EAGLE-3 ------------------------------------------------------------------------------

DRAFT_VOCAB = 40


def eagle3_state(tiny_llama_dir, *, own_embeddings: bool, seed: int):
    """A published EAGLE-3 head's tensors, and its modules made of transformers' own Llama
    parts: attention over [embedding; feature] (2D in, D out), norms, MLP."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    config._attn_implementation = "eager"
    d, heads = config.hidden_size, config.num_attention_heads
    wide = LlamaConfig.from_pretrained(tiny_llama_dir, hidden_size=2 * d, head_dim=d // heads)
    wide._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = LlamaAttention(wide, layer_idx=0).eval()
    attn.o_proj = torch.nn.Linear(d, d, bias=False)
    modules = {
        "self_attn": attn,
        "mlp": LlamaMLP(config),
        **{
            n: LlamaRMSNorm(d, config.rms_norm_eps)
            for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")
        },
    }
    state = {}
    with torch.no_grad():
        for prefix, module in modules.items():
            for name, p in module.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in prefix else 0.2 * torch.randn_like(p))
                state[f"midlayer.{prefix}.{name}"] = p.detach().clone()
    state["fc.weight"] = 0.2 * torch.randn(d, 3 * d)
    state["norm.weight"] = 1 + 0.1 * torch.randn(d)
    state["lm_head.weight"] = torch.randn(DRAFT_VOCAB, d)
    targets = torch.sort(torch.randperm(config.vocab_size)[:DRAFT_VOCAB]).values
    state["d2t"] = targets - torch.arange(DRAFT_VOCAB)  # draft token i is the target's i + d2t[i]
    state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill(0, targets, True)
    if own_embeddings:
        state["embed_tokens.weight"] = torch.randn(config.vocab_size, d)
    return state, modules, LlamaRotaryEmbedding(config)


def write_eagle3(folder, state, tiny_llama_dir, *, speculators=False, norm_before_residual=False):
    """The authors' layout (`midlayer.*`, settings at the top), or the speculators' (`layers.0.*`,
    the layer's settings in `transformer_layer_config`)."""
    folder.mkdir(parents=True, exist_ok=True)
    layer = {**json.loads((tiny_llama_dir / "config.json").read_text()), "num_hidden_layers": 1}
    settings = {"draft_vocab_size": DRAFT_VOCAB, "norm_before_residual": norm_before_residual}
    if speculators:
        config = {"speculators_model_type": "eagle3", "transformer_layer_config": layer, **settings}
        state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    else:
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], **settings}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
    return folder


def reference_eagle3_chain(parts, hf, prompt, k, *, norm_before_residual=False):
    """EAGLE-3's greedy chain of k drafts after `prompt`, as its authors compute it: the
    features are fc of the inputs of the target's layers 2, L // 2, L - 3 side by side (for
    L = 3: layers 0, 1, 2); entry i reads [norm(embedding of x_{i+1}); norm(f_i)], attention
    adds to f_i (or to its norm), then the MLP; the head's norm and LM head score the draft
    vocabulary, mapped to the target's by d2t; drafting feeds the output (before the norm)
    back as the next feature."""
    state, m, rope = parts
    embed = hf.model.embed_tokens.weight if "embed_tokens.weight" not in state else state["embed_tokens.weight"]
    with torch.no_grad():
        out = hf.model(torch.tensor([prompt]), output_hidden_states=True)
        layers = sorted({2, len(hf.model.layers) // 2, len(hf.model.layers) - 3})
        feats = F.linear(torch.cat([out.hidden_states[i][0] for i in layers], dim=-1), state["fc.weight"])
        tokens = prompt[1:] + [int(hf.lm_head(out.last_hidden_state[0, -1]).argmax())]
        drafts = []
        for _ in range(k):
            normed = m["hidden_norm"](feats)
            x = torch.cat([m["input_layernorm"](F.embedding(torch.tensor(tokens), embed)), normed], dim=-1)[None]
            n = x.shape[1]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            a = m["self_attn"](x, position_embeddings=rope(x, pos), attention_mask=mask)[0][0]
            y = (normed if norm_before_residual else feats) + a
            y = y + m["mlp"](m["post_attention_layernorm"](y))
            guess = int(
                F.linear(rms(y[-1], state["norm.weight"], hf.config.rms_norm_eps), state["lm_head.weight"]).argmax()
            )
            drafts.append(guess + int(state["d2t"][guess]))
            feats = torch.cat([feats, y[-1:]])
            tokens.append(drafts[-1])
    return drafts


def rms(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


EAGLE3_LAYOUTS = {
    "authors": dict(speculators=False, norm_before_residual=False, own_embeddings=False),
    "speculators-own-embeddings": dict(speculators=True, norm_before_residual=True, own_embeddings=True),
}


@pytest.mark.parametrize("layout", EAGLE3_LAYOUTS)
def test_engine_drafts_are_the_published_eagle3_chain(tiny_llama, tiny_llama_dir, hf_tiny, layout, tmp_path):
    """After the prefill and again after verify steps (the head's entries rewritten from the
    target's features of the accepted tokens), the drafts are the reference chain's."""
    kind = EAGLE3_LAYOUTS[layout]
    state, modules, rope = eagle3_state(tiny_llama_dir, own_embeddings=kind["own_embeddings"], seed=3)
    folder = write_eagle3(
        tmp_path / "eagle3",
        state,
        tiny_llama_dir,
        speculators=kind["speculators"],
        norm_before_residual=kind["norm_before_residual"],
    )
    eng = engine(tiny_llama, {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K})
    eng.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    req = eng.scheduler.requests["a"]
    for steps in (1, 3):
        for _ in range(steps):
            eng.step()
        eng.proposer.propose(eng.scheduler.running)
        seq = list(req.all_token_ids)
        want = reference_eagle3_chain(
            (state, modules, rope), hf_tiny, seq[:-1], K, norm_before_residual=kind["norm_before_residual"]
        )
        assert req.spec_token_ids == want, len(seq)
    assert len(req.all_token_ids) >= len(PROMPT) + 4 and eng.scheduler.spec_stats.num_drafts > 0  # verify steps ran


def test_target_layer_inputs_are_transformers_hidden_states(tiny_llama, hf_tiny):
    """The features EAGLE-3 reads: layer i's input is transformers' hidden_states[i]; the
    scanned (stacked) model gives the unrolled one's."""
    from flax import nnx

    from jaxserve.model.decoder import DecoderLM, unstack_layers
    from jaxserve.model.kv_cache import allocate_kv_cache
    from tests.jaxserve.spec_decode.test_spec_decode_medusa import prompt_inputs

    inputs, n = prompt_inputs(PROMPT), len(PROMPT)
    kv = allocate_kv_cache(tiny_llama.config, 4, 4, tiny_llama.model.dtype)
    hidden, _, features = tiny_llama.model.hidden_states_and_layer_inputs(inputs, kv, (2, 0))
    with torch.no_grad():
        want = hf_tiny.model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    np.testing.assert_allclose(
        np.asarray(features[:n]), torch.cat([want[0][0], want[2][0]], -1).numpy(), atol=1e-5, rtol=1e-5
    )
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(tiny_llama.model.hidden_states(inputs, kv)[0]))
    stacked = DecoderLM(tiny_llama.config, rngs=nnx.Rngs(4))
    a = stacked.hidden_states_and_layer_inputs(inputs, kv, (1, 2))
    b = unstack_layers(stacked).hidden_states_and_layer_inputs(inputs, kv, (1, 2))
    for x, y in ((a[0], b[0]), (a[2], b[2])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=1e-6)


def test_greedy_with_published_eagle3_equals_plain(tiny_llama, tiny_llama_dir, tmp_path):
    prompts, params = workload(seed=7, count=8)
    want = tokens(run(engine(tiny_llama), prompts, params))
    state = eagle3_state(tiny_llama_dir, own_embeddings=False, seed=4)[0]
    folder = write_eagle3(tmp_path / "eagle3", state, tiny_llama_dir)
    eng = engine(tiny_llama, {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K})
    assert tokens(run(eng, prompts, params)) == want
    assert eng.scheduler.spec_stats.num_drafts > 0


def test_eagle3_head_on_a_qwen3_target_is_a_llama_layer(tiny_llama_dir, tmp_path):
    """The head is a Llama layer whatever the target: no q/k norms from a Qwen3 target."""
    from jaxserve.weights import load_model
    from tests.tiny_models import make_tiny_model

    make_tiny_model("qwen3", tmp_path / "qwen3", seed=2)
    target = load_model(str(tmp_path / "qwen3"), use_cache=False, progress=False)
    assert target.config.qk_norm
    prompts, params = workload(seed=8, count=4)
    want = tokens(run(engine(target), prompts, params))
    folder = write_eagle3(
        tmp_path / "eagle3", eagle3_state(tiny_llama_dir, own_embeddings=False, seed=7)[0], tiny_llama_dir
    )
    eng = engine(target, {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K})
    assert tokens(run(eng, prompts, params)) == want
    assert eng.scheduler.spec_stats.num_drafts > 0


def test_bad_published_eagle3_heads_are_refused(tiny_llama, tiny_llama_dir, tmp_path):
    from jaxserve.spec_decode.published_heads import load_published_eagle3

    state = eagle3_state(tiny_llama_dir, own_embeddings=False, seed=5)[0]

    def load(name, tensors, **config):
        folder = write_eagle3(tmp_path / name, tensors, tiny_llama_dir)
        if config:
            (folder / "config.json").write_text(
                json.dumps({**json.loads((folder / "config.json").read_text()), **config})
            )
        return load_published_eagle3(published_folder(str(folder), "eagle3"), tiny_llama.config)

    with pytest.raises(ValueError, match="lacks the head's hidden_norm.weight"):
        load("missing", {k: v for k, v in state.items() if "hidden_norm" not in k})
    with pytest.raises(ValueError, match="d2t .* does not map the 40 draft tokens"):
        load("d2t", {**state, "d2t": state["d2t"] + 200})
    with pytest.raises(ValueError, match=r"layers \[1, 2, 3\]: a target of 3 layers"):
        load("layers", state, eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="of 2 layers; one-layer heads load"):
        load("deep", state, num_hidden_layers=2)
    with pytest.raises(ValueError, match="published eagle3 heads, not eagle ones"):
        published_folder(str(tmp_path / "missing"), "eagle")
