"""Checkpoints saved in the compressed-tensors format (llm-compressor's, what vLLM loads)."""

from __future__ import annotations

from jaxserve.quantization import QuantConfig
from jaxserve.weights.params import WeightError


def checkpoint_quant_config(spec: dict) -> QuantConfig:
    """The QuantConfig of a config.json's `quantization_config`; refuses other methods by name."""
    method = spec.get("quant_method", "unknown")
    raise WeightError(f"quantized checkpoints ({method}) are not supported yet")


def read_tensors(files, spec: dict):
    raise NotImplementedError
