"""Byte sizes as people write them ('64MiB', '80GB') and as a listing shows them.

Here, below the commands, so the weight cache can read `$JAXSERVE_CACHE_MAX_BYTES` with the
same rules as the flags (`jaxserve.flags` re-exports `parse_bytes`). Imports nothing heavy.
"""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    """'67108864', '64MiB', '1.5GiB', '80GB' -> bytes. GiB, MiB, KiB (and a bare G, M, K)
    are binary units; GB, MB, kB decimal ones, as on devices' data sheets."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512MiB, 4GiB, 80GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (binary units, as `du -h` counts)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
