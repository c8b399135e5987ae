"""Random PEFT LoRA adapters for the tiny models (tests/tiny_models.py), written by `peft` itself."""

from __future__ import annotations

import copy
from pathlib import Path

ATTENTION_QV = ["q_proj", "v_proj"]
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_model, folder: Path, *, r: int, seed: int, targets=ATTENTION_QV, **lora_config):
    """Save a LoRA adapter of `base_model` (a transformers model, left untouched) to `folder`
    with random A and B (PEFT starts B at zero: an adapter that changes nothing would prove
    nothing); return the PEFT model, the oracle. `lora_config`: more LoraConfig fields
    (lora_alpha, use_rslora, layers_to_transform, ...)."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, target_modules=list(targets), lora_dropout=0.0, **{"lora_alpha": 16, **lora_config})
    model = get_peft_model(copy.deepcopy(base_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    return model.eval()
