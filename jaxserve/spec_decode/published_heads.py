"""Medusa heads as their authors publish them (FasterDecoding/Medusa, Medusa-1).

A published folder holds `config.json` (`medusa_num_heads`, `medusa_num_layers`,
`base_model_name_or_path`) and `medusa_lm_head.safetensors` (or `.pt`), the state dict of a
list of heads. Head i is a `torch.nn.Sequential`:

    i.0 .. i.(L-1)   residual blocks   x -> x + SiLU(W x + b)      (`{i}.{j}.linear.weight`, `.bias`)
    i.L              its own LM head   x -> U x, no bias           (`{i}.{L}.weight`, [V, D])

and every head reads the target's last hidden state after the final norm (the base model's
`outputs[0]`). Ours (`heads.MedusaHeads`) read it before the norm and end in the target's
own norm and LM head, so a published head is a module of its own with the same call:
`heads(target, h)` -> f32 logits [k, T, V] of hidden states h [T, D] before the final norm.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder import DecoderLM
from jaxserve.spec_decode.heads import MedusaBlock
from jaxserve.weights.hub import parse_hub_reference
from jaxserve.weights.safetensors_reader import read_tensors

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_KEY = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


class PublishedMedusaHeads(nnx.Module):
    def __init__(self, cfg: ModelConfig, num_heads: int, num_layers: int, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.blocks = nnx.List(
            [nnx.List([MedusaBlock(cfg.hidden_size, dtype, rngs) for _ in range(num_layers)]) for _ in range(num_heads)]
        )
        self.lm_heads = nnx.List(
            [
                nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
                for _ in range(num_heads)
            ]
        )

    def __call__(self, target: DecoderLM, h: jax.Array) -> jax.Array:
        """f32 logits [k, T, V] of hidden states h [T, D] (before the target's final norm)."""
        x = target.norm(h)
        out = []
        for blocks, lm_head in zip(self.blocks, self.lm_heads):
            y = x
            for block in blocks:
                y = block(y)
            out.append(lm_head(y).astype(jnp.float32))
        return jnp.stack(out)


def published_medusa_folder(model: str) -> Path | None:
    """The folder of published Medusa heads that `model` names (a path, or a hub repository,
    downloaded or found in the hub's cache), or None when it is not one."""
    folder = Path(model).expanduser()
    if not folder.exists() and parse_hub_reference(model) is not None:
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(model, allow_patterns=["config.json", *WEIGHT_FILES]))
        except Exception as e:
            raise FileNotFoundError(f"could not download {model!r} from the Hugging Face hub: {e}") from e
    config = folder / "config.json"
    if not config.is_file() or "medusa_num_heads" not in json.loads(config.read_text()):
        return None
    return folder


def load_published_medusa(folder: Path, cfg: ModelConfig, dtype=jnp.float32) -> tuple[PublishedMedusaHeads, dict]:
    """The heads in a published folder for a target of config `cfg`, and the folder's config."""
    info = json.loads((folder / "config.json").read_text())
    num_heads, num_layers = int(info["medusa_num_heads"]), int(info.get("medusa_num_layers", 1))
    tensors = _read_weights(folder)
    expected = {f"{i}.{j}.linear.{p}" for i in range(num_heads) for j in range(num_layers) for p in ("weight", "bias")}
    expected |= {f"{i}.{num_layers}.weight" for i in range(num_heads)}
    if missing := sorted(expected - tensors.keys()):
        raise ValueError(f"{folder} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if extra := sorted(tensors.keys() - expected):
        names = ", ".join(extra[:4])
        raise ValueError(f"{folder} holds tensors a Medusa-1 head of {num_layers} layer(s) has not: {names}")
    vocab, dim = tensors[f"0.{num_layers}.weight"].shape
    if (dim, vocab) != (cfg.hidden_size, cfg.vocab_size):
        base = info.get("base_model_name_or_path", "another model")
        raise ValueError(
            f"the heads in {folder} were trained for {base} (hidden size {dim}, vocabulary {vocab}), not for this "
            f"target (hidden size {cfg.hidden_size}, vocabulary {cfg.vocab_size})"
        )
    heads = PublishedMedusaHeads(cfg, num_heads, num_layers, dtype, rngs=nnx.Rngs(0))
    for name, value in tensors.items():
        i, j, what = _KEY.fullmatch(name).groups()
        i, j = int(i), int(j)
        if what == "weight":
            heads.lm_heads[i].kernel[...] = jnp.asarray(value.T, dtype)
        elif what == "linear.weight":
            heads.blocks[i][j].linear.kernel[...] = jnp.asarray(value.T, dtype)
        else:
            heads.blocks[i][j].linear.bias[...] = jnp.asarray(value, dtype)
    return heads, {"method": "medusa", "num_heads": num_heads, "published": info}


def _read_weights(folder: Path) -> dict[str, np.ndarray]:
    safetensors, pickle = (folder / name for name in WEIGHT_FILES)
    if safetensors.is_file():
        return dict(read_tensors([safetensors]))
    if not pickle.is_file():
        raise FileNotFoundError(f"{folder} has a Medusa config.json but neither {' nor '.join(WEIGHT_FILES)}")
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            f"{pickle} is a torch pickle: install torch to read it, or save it as {WEIGHT_FILES[0]} "
            "(safetensors.torch.save_file(torch.load(path), ...))"
        ) from e
    state = torch.load(pickle, map_location="cpu", weights_only=True)
    return {name: t.float().numpy() for name, t in state.items()}
