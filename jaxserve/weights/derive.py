"""Variants derived from a cached copy instead of converting the checkpoint again.

A cached unquantized entry whose dtype holds the checkpoint's values exactly (float32 from a
GGUF file's dequantized blocks, bf16 from a bf16 safetensors checkpoint) is a lossless base:
every other dtype, int4, int8 and fp8 are computed from it exactly as from the checkpoint itself
(the same casts, the same quantizer over the same values), so they need no copy of their
own. Measured on SmolLM2-135M (a 94 MiB Q4_1 GGUF), see docs/weights-cache.md. Not derived:
`gguf` (it keeps the file's own blocks, which a float copy no longer has) and
compressed-tensors, GPTQ, AWQ and block-wise FP8 checkpoints (their quantized values come from the file).
"""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16

from jaxserve.model.quantization import QuantConfig, quantize
from jaxserve.weights.params import flatten_tree, unflatten_tree

_WIDER_THAN = {np.dtype(np.float32): {np.dtype(np.float16), np.dtype(bfloat16)}}


def can_derive(quant: QuantConfig | None) -> bool:
    """Whether this variant can be computed from a lossless base."""
    # our own round-to-nearest methods (whose layout is their name), not a checkpoint's own values
    return quant is None or (quant.method in ("int4", "int8", "fp8") and quant.kind == quant.method)


def holds_exactly(source_dtypes: set, dtype) -> bool:
    """Whether an unquantized copy in `dtype` keeps every value of tensors of `source_dtypes`
    (None in the set: a tensor that arrived quantized, which no float copy is)."""
    dtype = np.dtype(dtype)
    return all(d is not None and (d == dtype or d in _WIDER_THAN.get(dtype, ())) for d in source_dtypes)


def derive_params(base: dict, specs: dict, quant: QuantConfig | None) -> dict:
    """The parameters `specs` (flat path -> shape and dtype) asks for, from `base` (the nested
    host arrays of an unquantized model): cast, or quantized from the projection's kernel."""
    flat = dict(flatten_tree(base))
    del base
    derived: dict[tuple, np.ndarray] = {}
    for path, spec in specs.items():
        if path in derived:
            continue
        if path in flat:
            derived[path] = np.asarray(flat.pop(path), spec.dtype)
            continue
        module = path[:-1]  # a quantized projection: all its pieces from its float kernel
        # NOTE: in float32, as the checkpoint's readers hand tensors to the quantizer
        kernel = np.asarray(flat.pop(module + ("kernel",)), np.float32)
        for leaf, value in _quantized_pieces(kernel, quant).items():
            derived[module + (leaf,)] = value
    return unflatten_tree(derived)


def _quantized_pieces(kernel: np.ndarray, quant: QuantConfig) -> dict[str, np.ndarray]:
    """A projection's quantized parameters from its float kernel [K, N]; stacked experts'
    [E, K, N] one expert at a time, as they are quantized while loading (weights.params)."""
    if kernel.ndim == 2:
        return quantize(kernel, quant)
    experts = [quantize(w, quant) for w in kernel]
    return {leaf: np.stack([e[leaf] for e in experts]) for leaf in experts[0]}
