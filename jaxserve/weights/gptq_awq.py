"""GPTQ and AWQ checkpoints (AutoGPTQ / GPTQModel and AutoAWQ's formats): int4 kept as stored.

Both store, per projection, 4-bit values packed eight to an int32 word, a float16 scale and
a 4-bit zero point per group of `group_size` inputs (K), and give the weight as

    w[k, n] = scale[g, n] * (q[k, n] - zero[g, n]),     g = k // group_size

which is our int4 layout (`pallas_kernels.quantized_matmul`: w = scale * nibble + offset)
with offset = -scale * zero; float32 holds both products exactly (11 significant bits
times at most 5), so nothing is rounded again. They differ in how they pack:

    gptq   qweight int32 [K/8, N], the nibble at bits 4j of word [r, n] is k = 8r + j;
           qzeros int32 [G, N/8], the nibble at bits 4j of word [g, c] is n = 8c + j,
           holding zero - 1 (`checkpoint_format` "gptq", the usual one) or zero ("gptq_v2");
           scales [G, N]; g_idx int32 [K], each input's group.
    awq    ("version": "gemm") qweight int32 [K, N/8] and qzeros int32 [G, N/8] with the
           nibble at bits 4j of word c holding n = 8c + ORDER[j] (ORDER = 0 2 4 6 1 3 5 7),
           the zero point itself; scales [G, N].

A GPTQ checkpoint quantized with act-order (`desc_act`) quantized the inputs in another order
than K's, so its g_idx spreads each group over K. Sorted by group, the rows are our layout
again: the layer keeps them so and gathers its inputs into the same order first
(`QuantizedLinear.input_order`: y = x[:, order] @ w[order], exactly). Each group must
then have `group_size` rows, as GPTQ writes them. Refused by name: act-order experts of a
mixture of experts (the grouped kernels take no order), other bit widths, per-channel
scales (group_size -1), the Marlin and AWQ GEMV layouts, per-module overrides (`dynamic`),
a quantized LM head and partly quantized models.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxserve.model.quantization import QuantConfig, QuantizedWeight, pack_int4
from jaxserve.weights.compressed_tensors import PROJECTION_MODULE
from jaxserve.weights.params import WeightError
from jaxserve.weights.safetensors_reader import read_raw_tensors

METHODS = ("gptq", "awq")
SUPPORTED = (
    "jaxserve loads 4-bit GPTQ and AWQ GEMM checkpoints with a group size, "
    "compressed-tensors checkpoints, or quantizes float checkpoints itself (--quantization int4|int8|fp8)"
)
_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # word nibble j holds column 8c + _AWQ_ORDER[j]
_PIECES = frozenset({"qweight", "qzeros", "scales"})  # and GPTQ's g_idx, which older checkpoints lack


def checkpoint_quant_config(spec: dict) -> QuantConfig:
    """The QuantConfig of a GPTQ or AWQ `quantization_config`; refuses what we cannot serve
    exactly, by name."""
    method = spec.get("quant_method")
    if method not in METHODS:
        raise WeightError(f"quantization_config.quant_method {method!r} is not gptq or awq")
    # AutoAWQ's own quant_config names: w_bit, q_group_size
    bits, group = spec.get("bits", spec.get("w_bit")), spec.get("group_size", spec.get("q_group_size"))
    if bits != 4:
        raise WeightError(f"{method} checkpoint with {bits}-bit weights is not supported; {SUPPORTED}")
    if not isinstance(group, int) or group < 2 or group % 2:
        what = "per-channel scales (group_size -1)" if group == -1 else f"group_size {group!r}"
        raise WeightError(f"{method} checkpoint with {what} is not supported; {SUPPORTED}")
    if method == "gptq":
        fmt = spec.get("checkpoint_format", "gptq")
        if spec.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
            raise WeightError(
                f"gptq checkpoint_format {'marlin' if spec.get('is_marlin_format') else fmt!r} "
                f"is not supported (gptq or gptq_v2); {SUPPORTED}"
            )
        if spec.get("dynamic"):
            raise WeightError(f"gptq per-module overrides (dynamic: {spec['dynamic']}) are not supported; {SUPPORTED}")
        if spec.get("lm_head"):
            raise WeightError("this gptq checkpoint quantizes lm_head; jaxserve keeps the LM head in the model dtype")
    else:
        version = str(spec.get("version", "gemm")).lower()
        if version != "gemm" or not spec.get("zero_point", True):
            what = f"version {version!r}" if version != "gemm" else "zero_point false"
            raise WeightError(f"awq checkpoint with {what} is not supported (GEMM with zero points); {SUPPORTED}")
    return QuantConfig(method, "int4", group, act_order=method == "gptq" and bool(spec.get("desc_act")))


def read_tensors(files: list[Path], spec: dict) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
    """(Hugging Face name, tensor) for a GPTQ or AWQ checkpoint: one QuantizedWeight per
    projection (named `....q_proj.weight`), float32 arrays for everything else. A
    projection's pieces are held only until the last of them arrives (the next few tensors:
    read_raw_tensors gives a shard's tensors in name order, so a g_idx comes before them)."""
    quant = checkpoint_quant_config(spec)
    pieces_of = _PIECES | ({"g_idx"} if quant.method == "gptq" else set())
    pending: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in read_raw_tensors(files):
        module, _, leaf = name.rpartition(".")
        if PROJECTION_MODULE.match(module) and leaf != "bias":
            if leaf not in pieces_of:
                raise WeightError(
                    f"{module} is stored unquantized in a {quant.label} checkpoint; jaxserve does not load "
                    "partly quantized models (every attention and MLP projection or none)"
                    if leaf == "weight"
                    else f"unexpected tensor {name!r} in a {quant.label} checkpoint "
                    f"(a quantized projection stores {', '.join(sorted(pieces_of))})"
                )
            pieces = pending.setdefault(module, {})
            pieces[leaf] = tensor
            if pieces.keys() >= _PIECES:
                del pending[module]
                convert = _convert_gptq if quant.method == "gptq" else _convert_awq
                yield f"{module}.weight", convert(module, pieces, quant, spec)
        elif leaf in ("qweight", "qzeros", "scales", "g_idx"):
            raise WeightError(
                f"tensor {name!r}: {module} is quantized in this checkpoint, but jaxserve quantizes only "
                "the attention, MLP and expert projections (the rest stays in the model dtype)"
            )
        else:
            yield name, np.asarray(tensor, np.float32)
    for module, pieces in pending.items():
        has, missing = ", ".join(sorted(pieces)), ", ".join(sorted(_PIECES - pieces.keys()))
        raise WeightError(f"quantized module {module} is incomplete: it has {has} but no {missing}")


# -- one projection -----------------------------------------------------------------------


def _convert_gptq(module: str, pieces: dict[str, np.ndarray], quant: QuantConfig, spec: dict) -> QuantizedWeight:
    qweight, qzeros, scales = (pieces[p] for p in ("qweight", "qzeros", "scales"))
    k, n, group = 8 * qweight.shape[0], qweight.shape[1], quant.group_size
    g_idx = pieces.get("g_idx", np.arange(k) // group)
    _check(module, qweight, qzeros, scales, k, n, group)
    zeros = _nibbles_along_n(qzeros, n)
    if spec.get("checkpoint_format", "gptq") == "gptq":
        zeros += 1  # the usual format stores zero - 1 (a zero point of 0 cannot be written)
    in_order = g_idx.shape == (k,) and np.array_equal(g_idx, np.arange(k) // group)
    if not quant.act_order:
        if not in_order:
            raise WeightError(
                f"{module}.g_idx is not k // group_size, but quantization_config has no desc_act "
                "(act-order): the checkpoint contradicts itself"
            )
        # Word [r, n]'s little-endian bytes hold k = 8r + 2b (low nibble) and 8r + 2b + 1 (high)
        # in byte b: our packing already, read down the columns.
        packed = np.ascontiguousarray(qweight.T).view(np.uint8).T  # [K/2, N]
        return _int4_weight(packed, scales, zeros, n, k)
    if "g_idx" not in pieces:
        raise WeightError(f"{module} has no g_idx, but quantization_config says desc_act (act-order)")
    if ".experts." in module:
        raise WeightError(f"{module}: act-order experts of a mixture of experts are not supported; {SUPPORTED}")
    order = _group_order(module, g_idx, k, group)
    nibbles = _nibbles_along_n(qweight.T, k)[:, order]  # [N, K], inputs in group order
    weight = _int4_weight(pack_int4(nibbles.T), scales, zeros, n, k)
    weight.params["input_order"] = order.astype(np.int32)
    return weight


def _group_order(module: str, g_idx: np.ndarray, k: int, group: int) -> np.ndarray:
    """The inputs sorted by group (stable), checked to give each group `group` of them."""
    if g_idx.shape != (k,) or g_idx.min() < 0 or g_idx.max() >= k // group:
        raise WeightError(f"{module}.g_idx must hold a group in 0..{k // group - 1} for each of K={k} inputs")
    if np.any(np.bincount(g_idx, minlength=k // group) != group):
        raise WeightError(f"{module}.g_idx does not give each group {group} inputs (group_size in quantization_config)")
    return np.argsort(g_idx, kind="stable")


def _convert_awq(module: str, pieces: dict[str, np.ndarray], quant: QuantConfig, spec: dict) -> QuantizedWeight:
    qweight, qzeros, scales = (pieces[p] for p in ("qweight", "qzeros", "scales"))
    k, n, group = qweight.shape[0], 8 * qweight.shape[1], quant.group_size
    _check(module, qweight, qzeros, scales, k, n, group)
    inverse = np.argsort(_AWQ_ORDER)  # column 8c + i sits in nibble inverse[i]
    columns = (np.arange(n) // 8) * 8 + inverse[np.arange(n) % 8]
    nibbles, zeros = _nibbles_along_n(qweight, n)[:, columns], _nibbles_along_n(qzeros, n)[:, columns]
    return _int4_weight(pack_int4(nibbles), scales, zeros, n, k)


def _check(module, qweight, qzeros, scales, k: int, n: int, group: int) -> None:
    if qweight.dtype != np.int32 or qzeros.dtype != np.int32:
        raise WeightError(f"{module}: qweight and qzeros must be int32, got {qweight.dtype} and {qzeros.dtype}")
    if k % group:
        raise WeightError(f"{module}: K={k} is not a multiple of the group size {group} in quantization_config")
    want = {"qzeros": (k // group, n // 8), "scales": (k // group, n)}
    for name, got in (("qzeros", qzeros.shape), ("scales", scales.shape)):
        if got != want[name]:
            raise WeightError(
                f"{module}.{name} has shape {got}, expected {want[name]} for K={k}, N={n}, group size {group}"
            )


def _nibbles_along_n(words: np.ndarray, n: int) -> np.ndarray:
    """int32 [R, N/8] -> float32 [R, N]: word c's nibble at bits 4j as column 8c + j
    (also GPTQ's qweight read transposed: [N, K/8] -> [N, K])."""
    nibble_bytes = np.ascontiguousarray(words).view(np.uint8)  # [R, N/2], byte b of word c at 4c + b
    return np.stack([nibble_bytes & 0xF, nibble_bytes >> 4], axis=-1).reshape(len(words), n).astype(np.float32)


def _int4_weight(packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray, n: int, k: int) -> QuantizedWeight:
    scales = scales.astype(np.float32)  # float16 in the file: exact
    params = {"packed": np.ascontiguousarray(packed), "scales": scales, "offsets": -scales * zeros}
    return QuantizedWeight("int4", params, (n, k))
