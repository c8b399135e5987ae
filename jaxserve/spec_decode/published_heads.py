"""Draft heads as their authors publish them: Medusa-1 (FasterDecoding), EAGLE-1 and EAGLE-3 (SafeAILab).

Medusa-1: `config.json` (`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`)
and `medusa_lm_head.safetensors` (or `.pt`), the state dict of a list of heads. Head i is a
`torch.nn.Sequential`:

    i.0 .. i.(L-1)   residual blocks   x -> x + SiLU(W x + b)      (`{i}.{j}.linear.weight`, `.bias`)
    i.L              its own LM head   x -> U x, no bias           (`{i}.{L}.weight`, [V, D])

EAGLE-1: `config.json` (the target's architecture with one layer) and `pytorch_model.bin` or
safetensors: `fc.weight` [D, 2D] (and `fc.bias` where the config's `bias` is not false) over
[embedding of the next token; feature], then `layers.0.*`, a decoder layer of the target's
kind without `input_layernorm`. Its output feature goes to the target's LM head, with no
norm, and is fed back for the next draft. The embedding is the target's (a copy in the
file is ignored, as vLLM does).

EAGLE-3: `config.json` (one layer of the target's architecture; `draft_vocab_size`,
optionally `eagle_aux_hidden_state_layer_ids` and `norm_before_residual`, also inside
`eagle_config` or, in the speculators format, beside a `transformer_layer_config`) and
weights: `fc.weight` [D, 3D] over the feature layers' inputs, `midlayer.*` (or `layers.0.*`)
with `hidden_norm` and q/k/v over 2D, then `norm`, `lm_head` [draft vocabulary, D] and
`d2t` (draft token i is the target's i + d2t[i]; `t2d` is not needed). Feature layers by
default: 2, L // 2 and L - 3 of the target's L (the authors' and vLLM's choice).

Medusa-1 and EAGLE-1 read the target's last hidden state after the final norm (the base model's
`outputs[0]`). Ours (`heads.MedusaHeads`, `heads.EagleHead`) read it before the norm and
end in the target's own norm and LM head; the classes here keep our heads' calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder import DecoderLayer, DecoderLM
from jaxserve.spec_decode.heads import Eagle3Head, EagleHead, MedusaBlock, head_config, load_heads
from jaxserve.weights.hub import parse_hub_reference
from jaxserve.weights.params import flatten_tree, param_path, unflatten_tree
from jaxserve.weights.safetensors_reader import read_tensors

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
TORCH_FILES = ("pytorch_model.bin", "medusa_lm_head.pt")
_MEDUSA_KEY = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


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


class _NoNorm(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return x


class PublishedEagleHead(EagleHead):
    def __init__(self, cfg: ModelConfig, fc_bias: bool, dtype=jnp.float32, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.cfg = head_config(cfg)
        self.fc = nnx.Linear(2 * d, d, use_bias=fc_bias, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layer = DecoderLayer(self.cfg, dtype, rngs)
        self.layer.input_layernorm = _NoNorm()  # EAGLE-1's only layer has none

    def target_features(self, target: DecoderLM, hidden: jax.Array) -> jax.Array:
        return target.norm(hidden)

    def logits(self, target: DecoderLM, features: jax.Array) -> jax.Array:
        return target.unnormed_logits(features)

    def _fc_input(self, features: jax.Array, embeddings: jax.Array) -> jax.Array:
        return jnp.concatenate([embeddings, features], axis=-1)


def load_draft_heads(model: str, cfg: ModelConfig, dtype, method: str) -> nnx.Module:
    """The `method` heads `model` names: published ones (a folder or hub repository in the
    authors' layout) or a folder train_draft saved (heads.load_heads)."""
    published = published_folder(model, method)
    if published is None:
        return load_heads(model, cfg, dtype, method=method)[0]
    load = {"medusa": load_published_medusa, "eagle": load_published_eagle, "eagle3": load_published_eagle3}[method]
    return load(published, cfg, dtype)[0]


def published_folder(model: str, method: str) -> Path | None:
    """The folder of published `method` heads that `model` names (a path, or a hub repository,
    downloaded or found in the hub's cache), or None when it holds heads of ours."""
    folder = Path(model).expanduser()
    if not folder.exists() and parse_hub_reference(model) is not None:
        from huggingface_hub import snapshot_download

        try:
            patterns = ["config.json", "*.safetensors", *TORCH_FILES]
            folder = Path(snapshot_download(model, allow_patterns=patterns))
        except Exception as e:
            raise FileNotFoundError(f"could not download {model!r} from the Hugging Face hub: {e}") from e
    config = folder / "config.json"
    if (folder / "info.json").is_file() or (folder / "heads").is_dir() or not config.is_file():
        return None  # ours (heads.load_heads says what is wrong with a folder of neither kind)
    info = json.loads(config.read_text())
    kind = "medusa" if "medusa_num_heads" in info else "eagle3" if _is_eagle3(info) else "eagle"
    if kind != method:
        raise ValueError(f"{folder} holds published {kind} heads, not {method} ones")
    return folder


def _is_eagle3(info: dict) -> bool:
    architectures = info.get("architectures") or []
    return (
        "draft_vocab_size" in info
        or info.get("speculators_model_type") == "eagle3"
        or any("Eagle3" in a for a in architectures)
    )


def load_published_medusa(folder: Path, cfg: ModelConfig, dtype=jnp.float32) -> tuple[PublishedMedusaHeads, dict]:
    """The Medusa heads in a published folder for a target of config `cfg`, and the folder's config."""
    info = json.loads((folder / "config.json").read_text())
    num_heads, num_layers = int(info["medusa_num_heads"]), int(info.get("medusa_num_layers", 1))
    tensors = _read_weights(folder, MEDUSA_FILES)
    expected = {f"{i}.{j}.linear.{p}" for i in range(num_heads) for j in range(num_layers) for p in ("weight", "bias")}
    expected |= {f"{i}.{num_layers}.weight" for i in range(num_heads)}
    _check_names(folder, tensors, expected, f"a Medusa-1 head of {num_layers} layer(s)")
    vocab, dim = tensors[f"0.{num_layers}.weight"].shape
    _check_target(folder, info, cfg, dim, vocab)
    heads = PublishedMedusaHeads(cfg, num_heads, num_layers, dtype, rngs=nnx.Rngs(0))
    for name, value in tensors.items():
        i, j, what = _MEDUSA_KEY.fullmatch(name).groups()
        i, j = int(i), int(j)
        if what == "weight":
            heads.lm_heads[i].kernel[...] = jnp.asarray(value.T, dtype)
        elif what == "linear.weight":
            heads.blocks[i][j].linear.kernel[...] = jnp.asarray(value.T, dtype)
        else:
            heads.blocks[i][j].linear.bias[...] = jnp.asarray(value, dtype)
    return heads, {"method": "medusa", "num_heads": num_heads, "published": info}


def load_published_eagle(folder: Path, cfg: ModelConfig, dtype=jnp.float32) -> tuple[PublishedEagleHead, dict]:
    """The EAGLE-1 head in a published folder for a target of config `cfg`, and the folder's config."""
    info = json.loads((folder / "config.json").read_text())
    tensors = {k: v for k, v in _read_weights(folder, ()).items() if k != "embed_tokens.weight"}
    if "fc.weight" not in tensors:
        raise ValueError(f"{folder} holds no fc.weight: not an EAGLE-1 head")
    dim = tensors["fc.weight"].shape[0]
    _check_target(folder, info, cfg, dim, int(info.get("vocab_size", cfg.vocab_size)))
    head_cfg = dataclasses.replace(
        cfg,
        num_layers=1,
        intermediate_size=int(info.get("intermediate_size", cfg.intermediate_size)),
        num_heads=int(info.get("num_attention_heads", cfg.num_heads)),
        num_kv_heads=int(info.get("num_key_value_heads", info.get("num_attention_heads", cfg.num_kv_heads))),
        rms_norm_eps=float(info.get("rms_norm_eps", cfg.rms_norm_eps)),
    )
    head = PublishedEagleHead(head_cfg, "fc.bias" in tensors, dtype, rngs=nnx.Rngs(0))

    def place(name: str) -> tuple[tuple[str, ...], bool]:
        if name.startswith("fc."):
            return ("fc", "kernel" if name == "fc.weight" else "bias"), name == "fc.weight"
        where = param_path(f"model.{name}", head_cfg)
        if where is None or where[1] != 0:
            raise ValueError(f"{folder} holds {name}, which an EAGLE-1 head has not")
        (_, *module), _, transpose = where
        return ("layer", *module), transpose

    _fill_head(folder, head, tensors, place, "EAGLE-1", dtype)
    return head, {"method": "eagle", "num_heads": 1, "published": info}


def eagle3_feature_layers(model: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The target layers whose inputs the EAGLE-3 head `model` names reads (the runner keeps them)."""
    folder = published_folder(model, "eagle3")
    if folder is None:
        raise ValueError(
            f"method eagle3 takes published EAGLE-3 heads (a folder or hub repository); {model} is not one"
        )
    return _eagle3_layers(folder, json.loads((folder / "config.json").read_text()), cfg)


def _eagle3_setting(info: dict, key: str, default=None):
    """A setting of the head's config: top level, in `eagle_config`, or in the speculators' layer config."""
    for where in (info, info.get("eagle_config") or {}, info.get("transformer_layer_config") or {}):
        if where.get(key) is not None:
            return where[key]
    return default


def _eagle3_layers(folder: Path, info: dict, cfg: ModelConfig) -> tuple[int, ...]:
    n = cfg.num_layers
    layers = _eagle3_setting(info, "eagle_aux_hidden_state_layer_ids", (2, n // 2, n - 3))
    if _eagle3_setting(info, "use_aux_hidden_state", True) is False:
        raise ValueError(f"{folder} is an EAGLE-3 head without feature layers (use_aux_hidden_state: false)")
    if len(set(layers)) != len(layers) or not all(0 <= int(i) < n for i in layers):
        raise ValueError(f"{folder} reads the inputs of layers {list(layers)}: a target of {n} layers has not them all")
    return tuple(sorted(int(i) for i in layers))


def _eagle3_path(name: str) -> tuple[tuple[str, ...], bool]:
    """Where a published EAGLE-3 tensor goes in `Eagle3Head`, and whether it is transposed
    (torch's linear weights are [out, in], ours [in, out])."""
    for prefix in ("midlayer.", "layers.0."):
        if name.startswith(prefix):
            *module, what = name.removeprefix(prefix).split(".")
            linear = what == "weight" and module[-1].endswith("_proj")
            where = tuple(module) if module == ["hidden_norm"] else ("layer", *module)
            return (*where, "kernel" if linear else what), linear
    module, _, what = name.rpartition(".")
    linear = module in ("fc", "lm_head")
    return (module, "kernel" if linear else "embedding" if module == "embed_tokens" else what), linear


def load_published_eagle3(folder: Path, cfg: ModelConfig, dtype=jnp.float32) -> tuple[Eagle3Head, dict]:
    """The EAGLE-3 head in a published folder for a target of config `cfg`, and the folder's config."""
    info = json.loads((folder / "config.json").read_text())
    tensors = {k: v for k, v in _read_weights(folder, ()).items() if k != "t2d"}
    if "fc.weight" not in tensors or "lm_head.weight" not in tensors:
        raise ValueError(f"{folder} holds no fc.weight or lm_head.weight: not an EAGLE-3 head")
    layers = _eagle3_layers(folder, info, cfg)
    layer = info.get("transformer_layer_config") or info
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{folder} is an EAGLE-3 head of {layer['num_hidden_layers']} layers; one-layer heads load")
    dim = int(layer.get("hidden_size", tensors["fc.weight"].shape[0]))
    _check_target(folder, info, cfg, dim, int(layer.get("vocab_size", cfg.vocab_size)))
    if tensors["fc.weight"].shape != (dim, len(layers) * dim):
        raise ValueError(
            f"fc.weight in {folder} has shape {tensors['fc.weight'].shape}, not {(dim, len(layers) * dim)}"
        )
    num_heads = int(layer.get("num_attention_heads", cfg.num_heads))
    head_cfg = dataclasses.replace(
        cfg,
        num_layers=1,
        intermediate_size=int(layer.get("intermediate_size", cfg.intermediate_size)),
        num_heads=num_heads,
        num_kv_heads=int(layer.get("num_key_value_heads", num_heads)),
        head_dim=int(layer.get("head_dim") or dim // num_heads),
        rms_norm_eps=float(layer.get("rms_norm_eps", cfg.rms_norm_eps)),
        # A Llama layer whatever the target (vLLM's): q/k/v/o biases as its config says, no q/k
        # norms, no sliding window, a dense MLP; the rotary settings are the target's.
        attention_bias=(bias := bool(layer.get("attention_bias", False))),
        o_proj_bias=bias,
        qk_norm=False,
        sliding_window=None,
        num_experts=0,
    )
    draft_vocab = tensors["lm_head.weight"].shape[0]
    head = Eagle3Head(
        head_cfg,
        layers,
        draft_vocab,
        bool(_eagle3_setting(info, "norm_before_residual", False)),
        own_embeddings="embed_tokens.weight" in tensors,  # as vLLM: the file's copy, else the target's
        dtype=dtype,
        rngs=nnx.Rngs(0),
    )
    offsets = tensors.pop("d2t", np.zeros(draft_vocab, np.float32))
    _fill_head(folder, head, tensors, _eagle3_path, "EAGLE-3", dtype)
    targets = np.arange(draft_vocab) + np.rint(offsets).astype(np.int64) if offsets.shape == (draft_vocab,) else None
    if targets is None or targets.min() < 0 or targets.max() >= cfg.vocab_size:
        raise ValueError(f"d2t in {folder} does not map the {draft_vocab} draft tokens into the target's vocabulary")
    head.draft_offsets[...] = jnp.asarray(targets - np.arange(draft_vocab), jnp.int32)
    return head, {"method": "eagle3", "num_heads": 1, "published": info}


def _fill_head(folder: Path, head: nnx.Module, tensors: dict, place, kind: str, dtype) -> None:
    """Set every parameter of `head` from the published `tensors`; `place(name)` gives a
    tensor's (parameter path, transposed). Extra, missing or misshapen tensors are refused."""
    params = dict(flatten_tree(nnx.to_pure_dict(nnx.state(head, nnx.Param))))
    found = {}
    for name, value in tensors.items():
        path, transpose = place(name)
        if path not in params:
            raise ValueError(f"{folder} holds {name}, which an {kind} head of this target has not")
        value = value.T if transpose else value
        if value.shape != params[path].shape:
            raise ValueError(f"{name} in {folder} has shape {value.shape[::-1] if transpose else value.shape}")
        found[path] = jnp.asarray(value, dtype)
    if missing := sorted(".".join(map(str, p)) for p in params.keys() - found.keys()):
        raise ValueError(f"{folder} lacks the head's {', '.join(missing[:4])}")
    nnx.update(head, nnx.State(unflatten_tree(found)))


def _check_names(folder: Path, tensors: dict, expected: set[str], what: str) -> None:
    if missing := sorted(expected - tensors.keys()):
        raise ValueError(f"{folder} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if extra := sorted(tensors.keys() - expected):
        raise ValueError(f"{folder} holds tensors {what} has not: {', '.join(extra[:4])}")


def _check_target(folder: Path, info: dict, cfg: ModelConfig, dim: int, vocab: int) -> None:
    if (dim, vocab) != (cfg.hidden_size, cfg.vocab_size):
        base = info.get("base_model_name_or_path", "another model")
        raise ValueError(
            f"the heads in {folder} were trained for {base} (hidden size {dim}, vocabulary {vocab}), not for this "
            f"target (hidden size {cfg.hidden_size}, vocabulary {cfg.vocab_size})"
        )


def _read_weights(folder: Path, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Float32 tensors of the folder's safetensors (`names[0]`, or every one when no names),
    else of its torch pickle."""
    safetensors = [folder / names[0]] if names else sorted(folder.glob("*.safetensors"))
    if safetensors and safetensors[0].is_file():
        return dict(read_tensors(safetensors))
    pickle = next((folder / n for n in TORCH_FILES if (folder / n).is_file()), None)
    if pickle is None:
        raise FileNotFoundError(f"{folder} has a config.json but no safetensors or {' or '.join(TORCH_FILES)}")
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            f"{pickle} is a torch pickle: install torch to read it, or save it as safetensors "
            "(safetensors.torch.save_file(torch.load(path), ...))"
        ) from e
    state = torch.load(pickle, map_location="cpu", weights_only=True)
    return {name: t.float().numpy() for name, t in state.items()}
