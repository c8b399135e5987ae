"""Frames between nodes: a JSON header and raw array bytes; never pickle.

A frame is `MAGIC`, the header's length (u32, little-endian), the header, then each array's
bytes in order. The header names the frame's `kind`, carries small JSON values in `body`, and
describes a `tree`: nested dataclasses, lists and JSON scalars whose arrays stand as
{"@array": i}, with each array's dtype and shape. Decoding builds only the dataclasses the
receiver registered and only plain numeric dtypes, so a frame can carry data and nothing
that runs: a peer that sends anything else (a pickle, an unknown type, sizes that do not
add up) gets FrameError.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

MAGIC = b"JXSF1"
MAX_HEADER_BYTES = 1 << 20
_DTYPES = frozenset({"bool", "int8", "uint8", "int16", "int32", "uint32", "int64", "uint64", "float16", "float32"})


class FrameError(ValueError):
    """A frame this node will not read."""


class Frame(NamedTuple):
    kind: str
    body: dict
    tree: Any


class Codec:
    """Encodes and decodes frames whose trees hold the dataclasses in `types` (by class name)."""

    def __init__(self, types: Iterable[type] = ()):
        self.types = {t.__name__: t for t in types}

    def encode(self, kind: str, body: dict | None = None, tree: Any = None) -> bytes:
        arrays: list[np.ndarray] = []
        header = {"kind": kind, "body": body or {}, "tree": self._encode(tree, arrays)}
        header["arrays"] = [[a.dtype.name, list(a.shape)] for a in arrays]
        raw = json.dumps(header, separators=(",", ":")).encode()
        return b"".join([MAGIC, struct.pack("<I", len(raw)), raw, *(a.tobytes(order="C") for a in arrays)])

    def _encode(self, x: Any, arrays: list[np.ndarray]) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, (np.ndarray, np.generic)):
            a = np.asarray(x)  # NOTE: not ascontiguousarray, which makes a 0-d array 1-d
            if a.dtype.name not in _DTYPES:
                raise TypeError(f"a frame cannot carry {a.dtype} arrays")
            arrays.append(a)
            return {"@array": len(arrays) - 1}
        if isinstance(x, (list, tuple)):
            return [self._encode(v, arrays) for v in x]
        name = type(x).__name__
        if dataclasses.is_dataclass(x) and self.types.get(name) is type(x):
            fields = {f.name: self._encode(getattr(x, f.name), arrays) for f in dataclasses.fields(x)}
            return {"@type": name, "fields": fields}
        raise TypeError(f"a frame cannot carry {type(x).__qualname__} (register the dataclass with the Codec)")

    @staticmethod
    def header(frame: bytes) -> bytes:
        """A frame's header: its kind, body and tree with each array's dtype and shape, no values."""
        (size,) = struct.unpack_from("<I", frame, len(MAGIC))
        return frame[len(MAGIC) + 4 : len(MAGIC) + 4 + size]

    def decode(self, frame: bytes) -> Frame:
        if not frame.startswith(MAGIC) or len(frame) < len(MAGIC) + 4:
            raise FrameError(f"not a jaxserve frame (starts {frame[:8]!r})")
        (size,) = struct.unpack_from("<I", frame, len(MAGIC))
        start = len(MAGIC) + 4
        if size > MAX_HEADER_BYTES or start + size > len(frame):
            raise FrameError(f"frame header of {size} bytes does not fit the frame")
        try:
            header = json.loads(frame[start : start + size])
            kind, body, tree, specs = header["kind"], header["body"], header["tree"], header["arrays"]
        except (ValueError, KeyError, TypeError) as e:
            raise FrameError(f"unreadable frame header: {e}") from None
        if not isinstance(kind, str) or not isinstance(body, dict) or not isinstance(specs, list):
            raise FrameError("malformed frame header")
        arrays, at = [], start + size
        for spec in specs:
            a = self._array(spec, frame, at)
            arrays.append(a)
            at += a.nbytes
        if at != len(frame):
            raise FrameError(f"frame has {len(frame) - at} bytes past its arrays")
        return Frame(kind, body, self._decode(tree, arrays))

    @staticmethod
    def _array(spec, frame: bytes, at: int) -> np.ndarray:
        try:
            dtype, shape = spec
            ok = dtype in _DTYPES and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise FrameError(f"frame array spec {spec!r} is not a plain numeric array")
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * np.dtype(dtype).itemsize
        if at + nbytes > len(frame):
            raise FrameError("frame is shorter than its arrays")
        return np.frombuffer(frame, dtype, count, at).reshape(shape)

    def _decode(self, x: Any, arrays: list[np.ndarray]) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [self._decode(v, arrays) for v in x]
        if isinstance(x, dict) and x.keys() == {"@array"}:
            i = x["@array"]
            if type(i) is not int or not 0 <= i < len(arrays):
                raise FrameError(f"frame refers to array {i!r} of {len(arrays)}")
            return arrays[i]
        if isinstance(x, dict) and x.keys() == {"@type", "fields"}:
            cls = self.types.get(x["@type"])
            fields = x["fields"]
            if cls is None or not isinstance(fields, dict):
                raise FrameError(f"frame holds a {x['@type']!r}, which this node does not read")
            if set(fields) != {f.name for f in dataclasses.fields(cls)}:
                raise FrameError(f"frame's {x['@type']} has fields {sorted(fields)}")
            return cls(**{k: self._decode(v, arrays) for k, v in fields.items()})
        raise FrameError(f"frame holds {type(x).__name__} {str(x)[:80]!r}, which this node does not read")
