"""Parsing of human-readable byte sizes ("8GiB", "512MB", 1048576)."""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Return `value` as a whole number of bytes.

    Accepts a non-negative int, or a string such as ``"8GiB"``, ``"1.5 GB"``,
    ``"4096"``. Decimal units (kB, MB, GB) are powers of 1000, binary units
    (KiB, MiB, GiB) powers of 1024. Raises ValueError on anything else,
    including negative numbers and booleans.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got the boolean {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as '8GiB', got {type(value).__name__}")
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(f"cannot parse size {value!r} (expected e.g. '8GiB', '512MB', '4096')")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r} (use B, KB, MB, GB, KiB, MiB, GiB)")
    return int(float(number) * factor)
