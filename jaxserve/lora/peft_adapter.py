"""Reading a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) for a base model.

PEFT writes, for a Llama/Qwen-style model, keys such as
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, d_in]) and
`...lora_B.weight` ([d_out, r]); the update of the projection is
`scaling * x @ A.T @ B.T` with `scaling = lora_alpha / r`, or `lora_alpha / sqrt(r)` with
rsLoRA. Here A is kept as [d_in, r] and B as [r, d_out] with the scaling folded into B, so
serving multiplies by nothing more.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.model.lora import TARGET_MODULES, projection_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)


class LoRAConfigError(ValueError):
    """An adapter this engine cannot serve; the message names the field or tensor at fault."""


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights by (layer, module): A [d_in, r] and B [r, d_out], B scaled."""

    rank: int
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def slot_arrays(self, cfg: ModelConfig, max_rank: int, dtype) -> list[dict[str, np.ndarray]]:
        """Per layer, what each slot stack of jaxserve.model.lora.LayerLoRA holds for this adapter:
        {"{module}_a": [d_in, max_rank], "{module}_b": [max_rank, d_out]}, zero padded (modules
        and layers it does not target: zeros)."""
        shapes = projection_shapes(cfg)
        layers = []
        for layer in range(cfg.num_layers):
            arrays = {}
            for module in TARGET_MODULES:
                d_in, d_out = shapes[module]
                a, b = np.zeros((d_in, max_rank), dtype), np.zeros((max_rank, d_out), dtype)
                if (layer, module) in self.weights:
                    wa, wb = self.weights[layer, module]
                    a[:, : self.rank], b[: self.rank] = wa, wb
                arrays[f"{module}_a"], arrays[f"{module}_b"] = a, b
            layers.append(arrays)
        return layers


def lora_scaling(lora_alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling of the update: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return lora_alpha / math.sqrt(rank) if use_rslora else lora_alpha / rank


def read_adapter_config(folder: Path, max_lora_rank: int) -> dict:
    """The adapter's config, refused (LoRAConfigError naming the field) where this engine cannot serve it."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRAConfigError(f"{folder} is not a PEFT adapter folder: it has no {CONFIG_FILE}")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAConfigError(f"peft_type={config.get('peft_type')!r}: only LORA adapters are served")
    if config.get("use_dora"):
        raise LoRAConfigError("use_dora=true: DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise LoRAConfigError(f"bias={config.get('bias')!r}: only bias='none' adapters are supported")
    if config.get("modules_to_save"):
        raise LoRAConfigError(
            f"modules_to_save={config['modules_to_save']!r}: adapters that replace whole modules "
            "(embeddings, lm_head) are not supported"
        )
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise LoRAConfigError(f"{field}={config[field]!r}: per-module ranks and alphas are not supported yet")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown or not targets:
        raise LoRAConfigError(
            f"target_modules={targets!r}: only {', '.join(TARGET_MODULES)} are supported "
            f"(not {', '.join(unknown) or 'an empty list'}); embedding and lm_head adapters are not"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAConfigError(f"r={rank!r} must be a positive integer")
    if rank > max_lora_rank:
        raise LoRAConfigError(f"r={rank} is over max_lora_rank={max_lora_rank} (raise --max-lora-rank)")
    return config


def load_peft_adapter(folder: str | Path, base: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read and validate a PEFT folder against the base model's config."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    config = read_adapter_config(folder, max_lora_rank)
    rank = config["r"]
    scaling = lora_scaling(config.get("lora_alpha", 8), rank, bool(config.get("use_rslora")))
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoRAConfigError(f"{folder} has no {WEIGHTS_FILE}")
    shapes = projection_shapes(base)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAConfigError(f"tensor {key!r}: not a LoRA weight of a q/k/v/o/gate/up/down projection")
        layer, module, half = int(match[1]), match[3], match[4]
        if module not in shapes:
            raise LoRAConfigError(f"tensor {key!r}: module {module!r} is not a supported target")
        if layer >= base.num_layers:
            raise LoRAConfigError(f"tensor {key!r}: layer {layer} but the base model has {base.num_layers} layers")
        d_in, d_out = shapes[module]
        expected = (rank, d_in) if half == "A" else (d_out, rank)
        if tensor.shape != expected:
            raise LoRAConfigError(
                f"tensor {key!r} has shape {list(tensor.shape)}, the base model needs {list(expected)} "
                "(an adapter for a model of another size?)"
            )
        halves.setdefault((layer, module), {})[half] = np.asarray(tensor, np.float32)
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAConfigError(f"layer {layer} {module}: lora_A and lora_B must both be present")
        weights[layer, module] = (pair["A"].T.copy(), (pair["B"].T * scaling).astype(np.float32))
    if not weights:
        raise LoRAConfigError(f"{weights_path} holds no LoRA weights")
    return LoRAAdapter(rank, tuple(sorted({m for _, m in weights})), weights)


def write_peft_adapter(
    folder: str | Path,
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]],
    *,
    lora_alpha: float,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write a PEFT LoRA folder that `peft` and this engine load: `weights` by (layer, module),
    each (lora_A [r, d_in], lora_B [d_out, r]) in PEFT's own orientation and unscaled."""
    from safetensors.numpy import save_file

    ranks = {a.shape[0] for a, _ in weights.values()}
    if len(ranks) != 1:
        raise ValueError(f"every module needs the same rank, got {sorted(ranks)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": ranks.pop(),
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({module for _, module in weights}),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    tensors = {}
    for (layer, module), (a, b) in weights.items():
        prefix = f"base_model.model.model.layers.{layer}.{_block(module)}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    return folder


def _block(module: str) -> str:
    return "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
