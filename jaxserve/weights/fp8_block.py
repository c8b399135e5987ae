"""Block-wise FP8 checkpoints (Hugging Face's `quant_method: "fp8"` with `weight_block_size`,
as DeepSeek-V3 and Qwen3's FP8 releases ship): kept as stored.

Each projection stores its weight in e4m3 [N, K] and `weight_scale_inv` float32
[ceil(N / bn), ceil(K / bk)], one scale per block of bn outputs by bk inputs (a partial block
at either end keeps its own scale), and the weight is

    w[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]

(the name notwithstanding, a multiplier). The layer keeps both as they are, transposed to
our [K, N] orientation (`QuantConfig` kind "fp8_block"; `pallas_kernels.quantized_matmul`).
Refused by name: static activation scales, other formats than e4m3, per-tensor scales (no
block size), partly quantized models (`modules_to_not_convert` naming a projection).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxserve.model.quantization import QuantConfig, QuantizedWeight
from jaxserve.weights.compressed_tensors import PROJECTION_MODULE
from jaxserve.weights.params import WeightError
from jaxserve.weights.safetensors_reader import read_raw_tensors

METHODS = ("fp8",)
SUPPORTED = "jaxserve loads block-wise FP8 checkpoints with dynamic activations (weight_block_size, e4m3)"
_PIECES = frozenset({"weight", "weight_scale_inv"})


def checkpoint_quant_config(spec: dict) -> QuantConfig:
    """The QuantConfig of a block-wise FP8 `quantization_config`; refuses what we cannot serve
    as stored, by name."""
    block = spec.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise WeightError(f"fp8 checkpoint with weight_block_size {block!r} is not supported; {SUPPORTED}")
    if spec.get("activation_scheme", "dynamic") != "dynamic":
        scheme = spec["activation_scheme"]
        raise WeightError(f"fp8 checkpoint with {scheme!r} activation scales is not supported; {SUPPORTED}")
    if spec.get("fmt", "e4m3") != "e4m3":
        raise WeightError(f"fp8 checkpoint in format {spec['fmt']!r} is not supported; {SUPPORTED}")
    skipped = [m for m in spec.get("modules_to_not_convert") or [] if m != "lm_head" and "proj" in m]
    if skipped:
        raise WeightError(
            f"this fp8 checkpoint leaves {', '.join(skipped[:3])} unquantized; jaxserve does not load partly "
            "quantized models (every attention and MLP projection or none)"
        )
    return QuantConfig("fp8", "fp8_block", block=(block[0], block[1]))


def read_tensors(files: list[Path], spec: dict) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
    """(Hugging Face name, tensor) for a block-wise FP8 checkpoint: one QuantizedWeight per
    projection, float32 arrays for everything else (a projection's two pieces arrive together:
    read_raw_tensors gives a shard's tensors in name order)."""
    quant = checkpoint_quant_config(spec)
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in read_raw_tensors(files):
        module, _, leaf = name.rpartition(".")
        if PROJECTION_MODULE.match(module) and leaf in _PIECES:
            pieces = pending.setdefault(module, {})
            pieces[leaf] = tensor
            if pieces.keys() == _PIECES:
                del pending[module]
                yield f"{module}.weight", _convert(module, pieces, quant)
        elif leaf == "weight_scale_inv":
            raise WeightError(
                f"tensor {name!r}: {module} is quantized in this checkpoint, but jaxserve quantizes only "
                "the attention and MLP projections (the rest stays in the model dtype)"
            )
        else:
            yield name, np.asarray(tensor, np.float32)
    for module, pieces in pending.items():
        if "weight_scale_inv" not in pieces:
            raise WeightError(
                f"{module} is stored unquantized in a {quant.label} checkpoint; jaxserve does not load "
                "partly quantized models (every attention and MLP projection or none)"
            )
        raise WeightError(f"quantized module {module} has weight_scale_inv but no weight")


def _convert(module: str, pieces: dict[str, np.ndarray], quant: QuantConfig) -> QuantizedWeight:
    weight, scales = pieces["weight"], pieces["weight_scale_inv"]
    n, k = weight.shape
    bn, bk = quant.block
    if weight.dtype.name != "float8_e4m3fn":
        raise WeightError(f"{module}.weight is {weight.dtype}, not float8_e4m3fn, in a {quant.label} checkpoint")
    if scales.shape != (-(-n // bn), -(-k // bk)):
        raise WeightError(
            f"{module}.weight_scale_inv has shape {scales.shape}; a [{n}, {k}] weight in blocks of "
            f"{bn}x{bk} has {(-(-n // bn), -(-k // bk))}"
        )
    params = {"weight": np.ascontiguousarray(weight.T), "scales": np.ascontiguousarray(scales.T, np.float32)}
    return QuantizedWeight("fp8_block", params, (n, k))
