"""The model: a config-driven decoder (Llama, Mistral, Qwen2, Qwen3), its inputs, the paged
KV cache's layout, quantized layers, and the byte and FLOP arithmetic of sizing."""

from jaxserve.model.config import ModelConfig, UnsupportedModelError
from jaxserve.model.decoder import DecoderLM
from jaxserve.model.inputs import ModelInputs
from jaxserve.model.kv_cache import KVCache, KVHandoff, allocate_kv_cache
from jaxserve.model.quantization import QuantConfig, QuantizedLinear

__all__ = [
    "DecoderLM",
    "KVCache",
    "KVHandoff",
    "ModelConfig",
    "ModelInputs",
    "QuantConfig",
    "QuantizedLinear",
    "UnsupportedModelError",
    "allocate_kv_cache",
]
