"""A GGUF file (llama.cpp's format) as a Hugging Face-style config and tensors.

Quantized tensors are dequantized with the `gguf` package, or, for `--quantization gguf`,
each projection's blocks are kept in the layout that holds them exactly (`GGUFFile.quant_config`):
Q4_0 / Q4_1 / Q4_K as int4 with group 32 (`q4_blocks_as_int4`, `q4_k_blocks_as_int4`), Q8_0
and Q5_0 as int8 with group 32 (`q8_0_blocks_as_int8`, `q5_0_blocks_as_int8`), Q5_1 and Q5_K
as int8 with an offset per 32 (int8_asym: `q5_1_blocks_as_int8`, `q5_k_blocks_as_int8`), Q6_K
as int8 with group 16 (`q6_k_blocks_as_int8`): the file's exact values, as llama.cpp computes them.
A file may mix them (a Q4_K_M keeps some v and down projections in Q6_K); the model then has
layers of both kinds. Other block types are re-quantized (`projection_layout`). llama.cpp
stores the Q and K projections of Llama-architecture models with the rows of each head
interleaved for its rotary kernel; we undo that permutation so the weights match Hugging
Face's layout.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.model.config import UnsupportedModelError
from jaxserve.model.quantization import QuantConfig, QuantizedWeight, pack_int4
from jaxserve.weights.params import WeightError

logger = logging.getLogger(__name__)

# Block types kept as they are: the layout and group that hold their values exactly.
_EXACT = {
    "Q4_0": ("int4", 32),
    "Q4_1": ("int4", 32),
    "Q4_K": ("int4", 32),
    "Q8_0": ("int8", 32),
    "Q5_0": ("int8", 32),
    "Q5_1": ("int8_asym", 32),
    "Q5_K": ("int8_asym", 32),
    "Q6_K": ("int8", 16),
}
# Block types of 4 bits a value or fewer, re-quantized to int4 (more bits: to int8).
_FEW_BITS = {"Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"}

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_MOE_ARCHITECTURES = {"qwen2moe", "qwen3moe", "mixtral"}
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IN_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFFile:
    def __init__(self, path: str | Path):
        from gguf import GGUFReader  # imported here: only GGUF users pay for it

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        try:
            self.reader = GGUFReader(str(self.path))
        except Exception as e:  # the reader raises assorted errors on a damaged file
            raise WeightError(f"{self.path} is not a readable GGUF file (damaged or truncated?): {e}") from e
        self.arch = self.field("general.architecture")
        experts = self.field(f"{self.arch}.expert_count")
        if experts or self.arch in _MOE_ARCHITECTURES or any("_exps." in t.name for t in self.reader.tensors):
            # NOTE: GGUF stores the experts stacked ([E, F, D] `blk.N.ffn_gate_exps`), Mixtral
            # under the `llama` architecture; not read here yet.
            raise UnsupportedModelError(
                f"GGUF mixture-of-experts models are not supported (architecture {self.arch!r}"
                + (f", {experts} experts" if experts else "")
                + "); load the model's Hugging Face safetensors folder instead (--quantization int4|fp8 "
                "quantizes its experts)"
            )
        if self.arch not in _ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {self.arch!r} is not supported; supported: {', '.join(_ARCHITECTURES)}"
            )

    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def hf_config(self) -> dict[str, Any]:
        """The metadata as the dict a Hugging Face config.json would hold."""
        a = self.arch
        num_heads = self.field(f"{a}.attention.head_count")
        hidden = self.field(f"{a}.embedding_length")
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise UnsupportedModelError("GGUF rope_freqs (llama3 rope scaling) is not supported; use the HF folder")
        cfg = {
            "architectures": [_ARCHITECTURES[a]],
            "vocab_size": self.field(f"{a}.vocab_size") or len(self.field("tokenizer.ggml.tokens")),
            "hidden_size": hidden,
            "intermediate_size": self.field(f"{a}.feed_forward_length"),
            "num_hidden_layers": self.field(f"{a}.block_count"),
            "num_attention_heads": num_heads,
            "num_key_value_heads": self.field(f"{a}.attention.head_count_kv", num_heads),
            "head_dim": self.field(f"{a}.attention.key_length", hidden // num_heads),
            "max_position_embeddings": self.field(f"{a}.context_length", 4096),
            "rms_norm_eps": self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self.field(f"{a}.rope.freq_base", 10000.0),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }
        scaling = self.field(f"{a}.rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
            cfg["rope_scaling"] = {"type": "linear", "factor": self.field(f"{a}.rope.scaling.factor")}
        return cfg

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def quant_config(self) -> QuantConfig:
        """How `--quantization gguf` keeps this file's projections, each in its block type's
        `projection_layout`: the layout most projections take, and the others as exceptions
        (a Q4_K_M: int4 with group 32, its Q6_K projections int8 with group 16)."""
        projections = [t for t in self.reader.tensors if _is_projection(t)]
        layouts = {_module_path(t.name): projection_layout(t.tensor_type.name) for t in projections}
        if not layouts:
            return QuantConfig("gguf", "int4", 32)
        kind, group = Counter(layouts.values()).most_common(1)[0][0]
        exceptions = tuple((path, *layout) for path, layout in layouts.items() if layout != (kind, group))
        return QuantConfig("gguf", kind, group, exceptions=exceptions)

    def tensors(self, keep: QuantConfig | None = None) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
        """(Hugging Face name, float32 array in Hugging Face layout) for every tensor; with
        `keep` (quant_config's), the projections whose block type the layout `keep` gives them
        holds exactly come as `QuantizedWeight`s of it, the others as floats (re-quantized by
        the loader, said in the log)."""
        from gguf import dequantize

        cfg = self.hf_config()
        requantized: Counter = Counter()
        for t in self.reader.tensors:
            name = hf_name(t.name)
            shape = tuple(int(n) for n in reversed(t.shape))
            kind = t.tensor_type.name if keep is not None and _is_projection(t) else None
            layout = keep.at(_module_path(t.name)) if kind is not None else None
            try:
                if kind is not None and _EXACT.get(kind) == (layout.kind, layout.group_size):
                    array = _KEEP[kind](np.asarray(t.data), shape)
                else:
                    if kind is not None:
                        requantized[kind, layout.label] += 1
                    array = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
            except Exception as e:
                raise WeightError(f"{self.path}: tensor {t.name!r} could not be read: {e}") from e
            heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}.get(
                t.name.split(".")[-2]
            )
            if self.arch == "llama" and heads is not None:
                if isinstance(array, QuantizedWeight):
                    order = unpermute_rotary(np.arange(shape[0]), heads)
                    array = array.permute_outputs(order)
                else:
                    array = unpermute_rotary(array, heads)
            yield name, array
        for (kind, label), count in sorted(requantized.items()):
            logger.warning(
                "%s: %d %s projection%s re-quantized to %s (no layout holds %s blocks exactly)",
                self.path.name,
                count,
                kind,
                "s were" if count > 1 else " was",
                label,
                kind,
            )


def projection_layout(type_name: str) -> tuple[str, int]:
    """(kind, group) `--quantization gguf` stores a projection of this block type in: the one
    that holds its values exactly (_EXACT), else int4 with group 32 for 4 bits a value or fewer
    and int8 with group 32 for more (F16, BF16, F32, ...), which loses far less than int4."""
    if type_name in _EXACT:
        return _EXACT[type_name]
    return ("int4", 32) if type_name in _FEW_BITS else ("int8", 32)


def _module_path(gguf_name: str) -> str:
    """A projection's module path in the model ("blk.3.ffn_down.weight" -> "layers.3.mlp.down_proj")."""
    return hf_name(gguf_name).removeprefix("model.").rsplit(".", 1)[0]


def _is_projection(tensor) -> bool:
    """A layer's weight matrix (a projection), not a norm or a bias."""
    return _BLOCK.match(tensor.name) is not None and len(tensor.shape) == 2


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    m = _BLOCK.match(gguf_name)
    if not m or m.group(2) not in _IN_LAYER:
        raise WeightError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_IN_LAYER[m.group(2)]}.{m.group(3)}"


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of a Q or K projection ([out, ...]).

    llama.cpp reorders each head's rows from [first half, second half] (Hugging Face's
    rotate-half pairs) to interleaved pairs; this puts them back.
    """
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_blocks_as_int4(data: np.ndarray, has_min: bool, shape: tuple[int, int]) -> QuantizedWeight:
    """A projection's Q4_1 (`d * q + m`) or Q4_0 (`d * (q - 8)`) blocks as int4 with group 32.

    A block covers 32 consecutive inputs of one output row: f16 d, (Q4_1) f16 m, then 16
    bytes whose low nibbles are inputs 0..15 and high nibbles inputs 16..31.
    """
    n, k = shape
    blocks = data.reshape(n, k // 32, 20 if has_min else 18)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else -8.0 * d
    qs = blocks[..., 4:20] if has_min else blocks[..., 2:18]
    nibbles = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k)  # [N, K] in input order
    return _int4_weight(nibbles, d, m, shape)


def _int4_weight(nibbles: np.ndarray, scales: np.ndarray, offsets: np.ndarray, shape) -> QuantizedWeight:
    """Nibbles [N, K] in input order, scales and offsets [N, K / group]: our int4 layout ([K, N])."""
    params = {
        "packed": pack_int4(nibbles.T),
        "scales": np.ascontiguousarray(scales.T),
        "offsets": np.ascontiguousarray(offsets.T),
    }
    return QuantizedWeight("int4", params, shape)


def q8_0_blocks_as_int8(data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A projection's Q8_0 blocks as int8 with group 32, exactly: a block covers 32
    consecutive inputs of one output row, f16 d then 32 int8 values q (`d * q`)."""
    n, k = shape
    blocks = data.reshape(n, k // 32, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    q = blocks[..., 2:34].copy().view(np.int8).reshape(n, k)
    return _int8_weight(q, d, shape)


def q5_0_blocks_as_int8(data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A projection's Q5_0 blocks as int8 with group 32, exactly: a block covers 32
    consecutive inputs of one output row, f16 d, then the five-bit values (`_five_bits`).
    Input i is `d * (q - 16)`, q in [0, 31]: symmetric int8 with scale d."""
    n, k = shape
    blocks = data.reshape(n, k // 32, 22)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    q = _five_bits(blocks[..., 2:6], blocks[..., 6:22]).astype(np.int16) - 16
    return _int8_weight(q.astype(np.int8).reshape(n, k), d, shape)


def q5_1_blocks_as_int8(data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A projection's Q5_1 blocks as asymmetric int8 with group 32, exactly: Q5_0's block with
    an f16 m after d; input i is `d * q + m`, q in [0, 31]."""
    n, k = shape
    blocks = data.reshape(n, k // 32, 24)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    q = _five_bits(blocks[..., 4:8], blocks[..., 8:24]).astype(np.int8).reshape(n, k)
    return _int8_weight(q, d, shape, m)


def q5_k_blocks_as_int8(data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A projection's Q5_K blocks as asymmetric int8 with group 32, exactly.

    A Q5_K super-block covers 256 consecutive inputs of one output row: f16 d and dmin, Q4_K's
    12 bytes of 6-bit scales and mins (one pair per 32 inputs), 32 bytes of fifth bits, then 128
    bytes of nibbles, each 32 of them holding 64 inputs (low nibbles the first 32, high the
    next). Input l of sub-block j takes bit j of fifth-bit byte l. Input i of sub-block j is
    `d * scale_j * q - dmin * min_j`, q in [0, 31]: scale `d * scale_j`, offset `-dmin * min_j`.
    """
    n, k = shape
    blocks = data.reshape(n, k // 256, 176)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, K/256, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    scales, mins = _k_quant_scales(blocks[..., 4:16])
    fifth = blocks[..., 16:48]  # [N, K/256, 32]
    qs = blocks[..., 48:176].reshape(n, k // 256, 4, 1, 32)
    nibbles = np.concatenate([qs & 0xF, qs >> 4], axis=-2).reshape(n, k // 256, 8, 32)  # sub-block j, input l
    high = (fifth[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, K/256, 8, 32]
    q = (nibbles | (high << 4)).astype(np.int8).reshape(n, k)
    return _int8_weight(q, (d * scales).reshape(n, k // 32), shape, (-(dmin * mins)).reshape(n, k // 32))


def _five_bits(high: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 values in [0, 31], [..., 32]: `high` a little-endian 32-bit word per block
    whose bit i is input i's fifth bit, `qs` 16 bytes whose low nibbles are inputs 0..15 and
    high nibbles inputs 16..31."""
    word = high.copy().view("<u4")  # [..., 1]
    fifth = ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1) | (fifth << 4)


def q6_k_blocks_as_int8(data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A projection's Q6_K blocks as int8 with group 16, exactly.

    A Q6_K super-block covers 256 consecutive inputs of one output row: 128 bytes of low
    nibbles, 64 bytes of high bit pairs, 16 int8 scales (one per 16 inputs), then f16 d. Each
    half of 128 inputs takes 64 low-nibble bytes and 32 bit-pair bytes: input j < 64 the low
    nibble of byte j, 64 + j its high nibble; the bit pair of input 32 s + l (l < 32) is bits
    2 s, 2 s + 1 of byte l. Input i is `d * scale_{i // 16} * (q - 32)`: symmetric int8 with
    group 16, scale `d * scale` (float32 holds it exactly: 11 and 8 significant bits).
    """
    n, k = shape
    blocks = data.reshape(n, k // 256, 210)
    low = blocks[..., 0:128].reshape(n, k // 256, 2, 64)
    pairs = blocks[..., 128:192].reshape(n, k // 256, 2, 32)
    low = np.concatenate([low & 0xF, low >> 4], axis=-1)  # [N, K/256, 2, 128] in input order
    high = np.concatenate([(pairs >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, k)
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)  # [N, K/256, 1]
    scales = blocks[..., 192:208].copy().view(np.int8).astype(np.float32) * d  # [N, K/256, 16]
    return _int8_weight(q, scales.reshape(n, k // 16), shape)


def _int8_weight(q: np.ndarray, scales: np.ndarray, shape, offsets: np.ndarray | None = None) -> QuantizedWeight:
    """Values [N, K] in input order, scales (and offsets) [N, K / group]: our int8 layout
    ([K, N]), int8_asym with offsets."""
    params = {"weight": np.ascontiguousarray(q.T), "scales": np.ascontiguousarray(scales.T)}
    if offsets is None:
        return QuantizedWeight("int8", params, shape)
    return QuantizedWeight("int8_asym", params | {"offsets": np.ascontiguousarray(offsets.T)}, shape)


def q4_k_blocks_as_int4(data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A projection's Q4_K blocks as int4 with group 32, exactly.

    A Q4_K super-block covers 256 consecutive inputs of one output row: f16 d and dmin, 12
    bytes of eight 6-bit scales and eight 6-bit mins (one pair per 32 inputs), then 128 bytes
    of nibbles, each 32 of them holding 64 inputs (low nibbles the first 32, high the next).
    Input i of sub-block j is `d * scale_j * q - dmin * min_j`: asymmetric int4 with group 32,
    scale `d * scale_j` and offset `-dmin * min_j` (float32 holds both products exactly: 11 and
    6 significant bits).
    """
    n, k = shape
    blocks = data.reshape(n, k // 256, 144)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, K/256, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    scales, mins = _k_quant_scales(blocks[..., 4:16])
    qs = blocks[..., 16:144].reshape(n, k // 256, 4, 1, 32)
    nibbles = np.concatenate([qs & 0xF, qs >> 4], axis=-2).reshape(n, k)  # [N, K] in input order
    return _int4_weight(nibbles, (d * scales).reshape(n, k // 32), (-(dmin * mins)).reshape(n, k // 32), shape)


def _k_quant_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes [..., 12] as eight 6-bit scales and eight 6-bit mins, float32
    [..., 8] each. Sub-blocks 0-3 keep their 6 bits in bytes 0-3 (scales) and 4-7 (mins);
    sub-blocks 4-7 take 4 low bits from bytes 8-11 and their top 2 from the top bits of bytes
    0-3 / 4-7."""
    packed = packed.astype(np.uint8)
    low, high, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 63, (rest & 15) | ((low >> 6) << 4)], axis=-1).astype(np.float32)
    mins = np.concatenate([high & 63, (rest >> 4) | ((high >> 6) << 4)], axis=-1).astype(np.float32)
    return scales, mins


# The decoders of the block types kept exactly, each to its _EXACT layout.
_KEEP = {
    "Q4_0": lambda data, shape: q4_blocks_as_int4(data, False, shape),
    "Q4_1": lambda data, shape: q4_blocks_as_int4(data, True, shape),
    "Q4_K": q4_k_blocks_as_int4,
    "Q8_0": q8_0_blocks_as_int8,
    "Q5_0": q5_0_blocks_as_int8,
    "Q5_1": q5_1_blocks_as_int8,
    "Q5_K": q5_k_blocks_as_int8,
    "Q6_K": q6_k_blocks_as_int8,
}
