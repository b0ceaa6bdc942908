"""Byte sizes as people write them: "8GiB", "512 MiB", "1.5GB" or a plain number of bytes.

One parser for every size minipic takes (`cpu_bytes`, `disk_max_bytes`,
`minipic store evict --max-bytes`) and one printer for every size it shows, so
what minipic prints can be pasted back into its options. Binary units (KiB,
MiB, GiB, TiB) count in 1024s, as vLLM's `--kv-offloading-size` (GiB) does;
decimal units (kB, MB, GB, TB) mean what they say, powers of 1000.
Imports nothing heavy: `minipic store ...` uses it without vLLM.
"""

from __future__ import annotations

import math
import re
from typing import Any

_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)
_PRINTED_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


class SizeError(ValueError):
    """A size that is not a number of bytes or a number with a known unit."""


def parse_size(value: Any) -> int:
    """Bytes from an int, an integral float, or text such as "8GiB" (refuses bools)."""
    if isinstance(value, bool):  # True would silently be 1 byte
        raise SizeError(f"not a size: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise SizeError(f"not a whole number of bytes: {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise SizeError(f"not a size: {value!r}")
    match = _SIZE.fullmatch(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise SizeError(f"not a size: {value!r} (write bytes, or e.g. '8GiB', '512MiB', '1.5GB')")
    number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(number):
        raise SizeError(f"not a size: {value!r}")
    return round(number)


def format_size(n: float) -> str:
    """'512 B', '8 GiB', '1.5 GiB': binary units, at most one decimal."""
    for unit in _PRINTED_UNITS:
        if abs(n) < 1024 or unit == _PRINTED_UNITS[-1]:
            break
        n /= 1024
    text = f"{n:.0f}" if unit == "B" else f"{n:.1f}".removesuffix(".0")
    return f"{text} {unit}"
