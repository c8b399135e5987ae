"""Random tiny Hugging Face checkpoints, built with torch from a config and a fixed seed.

Weights are drawn at a scale that gives logits of order one (the default 0.02 init
gives near-uniform logits, against which any error bound is met by accident).
"""

from __future__ import annotations

from pathlib import Path

BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (architecture, config overrides)
TINY_MODELS = {
    "llama": ("LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama-tied-mqa-llama3rope": (
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            num_key_value_heads=1,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "llama-bias-mha": ("LlamaForCausalLM", dict(attention_bias=True, num_key_value_heads=4)),
    "mistral-window": ("MistralForCausalLM", dict(sliding_window=7, tie_word_embeddings=False)),
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=False)),
    "qwen3-tied": ("Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True, num_key_value_heads=1)),
    # Mixtures of experts: Mixtral's experts are its MLPs, renormed top 2; Qwen2-MoE adds a
    # gated shared expert and here keeps a dense MLP on layer 1; Qwen3-MoE renorms its top 3.
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    "qwen2-moe": (
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, head_dim=24),
    ),
}


def make_tiny_model(name: str, folder: Path, seed: int = 0, dtype: str = "float32", **config):
    """Write `config.json` + `model.safetensors` for TINY_MODELS[name] (`config`: more
    overrides); return the torch model."""
    import torch
    import transformers

    arch, overrides = TINY_MODELS[name]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**{**BASE, **overrides, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model = model.to(getattr(torch, dtype))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return model


SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: BASE's bos_token_id 1 and eos_token_id 2
WORDS = (
    "the a cat dog sat on mat and ran to house big small red blue green is was of in it he she they we you "
    "am are be hello world user assistant system : . , ! ? yes no one two three four five six seven eight "
    "nine ten time day night sun moon star tree sky sea fish bird eat drink sleep go come see look play walk "
    "talk good bad new old hot cold up down left right out over under very"
).split()
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def make_tiny_tokenizer(folder: Path, *, add_bos: bool = True, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """A real `tokenizer.json` for the tiny models' 97-token vocabulary: whole words, and a
    post-processor that adds BOS like Llama 3's and Mistral's tokenizers do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys(WORDS))
    words += [f"w{i}" for i in range(BASE["vocab_size"] - len(SPECIALS) - len(words))]
    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    assert len(vocab) == BASE["vocab_size"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=chat_template
    )
    fast.save_pretrained(folder)


def make_tiny_char_tokenizer(folder: Path) -> None:
    """A byte-level `tokenizer.json` with one token per printable ASCII character (all but
    '~') and the space: every text over those characters encodes, so a grammar engine can
    build any JSON, regex or choice from the tiny models' 97 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    space = "Ġ"  # the byte-level alphabet's name for " "
    chars = [space] + [chr(c) for c in range(33, 127) if chr(c) != "~"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    assert len(vocab) == BASE["vocab_size"]
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)


def q8_0_table(rng, n: int, k: int):
    """A float32 [n, k] table dequantized from GGUF's Q8_0 blocks (as a GGUF's tied embedding
    table often comes), quantized and dequantized by the gguf package; one all-zero block."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    table = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 10, (n, 1)).astype(np.float32)
    table[0, :32] = 0
    blocks = quants.quantize(table, GGMLQuantizationType.Q8_0)
    return quants.dequantize(blocks, GGMLQuantizationType.Q8_0).astype(np.float32)
