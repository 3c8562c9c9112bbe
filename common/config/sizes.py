"""Parsing of human-readable byte sizes ("8GiB", "512MB", 1048576).

Invariants: a parsed size is a whole number of bytes in ``0 .. MAX_SIZE``;
nothing is ever rounded or truncated (``1.9`` and ``"0.5B"`` are refused, not
turned into 1 and 0), and every refusal is a `ValueError` (never an
`OverflowError` from ``inf`` or a 400-digit number), so config parsing can
name the field.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

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
_SIZE_RE = re.compile(r"\s*([0-9]{1,24}(?:\.[0-9]{1,24})?)\s*([a-zA-Z]{0,3})\s*")
MAX_SIZE = 1 << 60
"""Largest size accepted (1 EiB): far above any real tier, far below u64 overflow."""


def parse_size(value: int | float | str) -> int:
    """Return `value` as a whole number of bytes.

    Accepts a non-negative int, a float with no fractional part, or a string
    such as ``"8GiB"``, ``"1.5 GB"``, ``"4096"`` whose value is a whole number
    of bytes. Decimal units (kB, MB, GB) are powers of 1000, binary units
    (KiB, MiB, GiB) powers of 1024. Raises ValueError on anything else:
    negative numbers, booleans, NaN, infinities, fractions of a byte and
    sizes above `MAX_SIZE`.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got the boolean {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"size must be a finite number of bytes, got {value!r}")
        if not value.is_integer():
            raise ValueError(f"size must be a whole number of bytes, got {value!r}")
        return _bounded(int(value), value)
    if isinstance(value, int):
        return _bounded(value, value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as '8GiB', got {type(value).__name__}")
    match = _SIZE_RE.fullmatch(value)
    if match is None:
        raise ValueError(f"cannot parse size {value[:60]!r} (expected e.g. '8GiB', '512MB', '4096')")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r} (use B, KB, MB, GB, KiB, MiB, GiB)")
    try:
        exact = Decimal(number) * factor
    except InvalidOperation:  # pragma: no cover - the regex admits only plain decimals
        raise ValueError(f"cannot parse size {value!r}") from None
    if exact != exact.to_integral_value():
        raise ValueError(f"size {value!r} is not a whole number of bytes ({exact})")
    return _bounded(int(exact), value)


def _bounded(n: int, original: object) -> int:
    if n < 0:
        raise ValueError(f"size must be >= 0, got {original!r}")
    if n > MAX_SIZE:
        shown = (
            original[:24] + "..." if isinstance(original, str) and len(original) > 24 else f"of {n.bit_length()} bits"
        )
        raise ValueError(f"size {shown} is larger than the maximum {MAX_SIZE} bytes (1 EiB)")
    return n


def parse_mooncake_size(value: object) -> int:
    """A size as Mooncake's config files write it: ints, or "3.125GB"/"512mb" (powers of 1024)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        s = value.strip().lower()
        for suffix, mult in (
            ("kb", 1 << 10),
            ("mb", 1 << 20),
            ("gb", 1 << 30),
            ("tb", 1 << 40),
            ("k", 1 << 10),
            ("m", 1 << 20),
            ("g", 1 << 30),
            ("t", 1 << 40),
            ("b", 1),
        ):
            if s.endswith(suffix):
                return _mooncake_number(s[: -len(suffix)], mult, value)
        return _mooncake_number(s, 1, value)
    raise ValueError(f"expected a size such as '4GB' or an integer, got {value!r}")


def _mooncake_number(text: str, mult: int, original: object) -> int:
    """``float(text) * mult`` rounded down, as Mooncake reads it, but finite and bounded (ValueError)."""
    number = float(text)  # ValueError on junk
    if not math.isfinite(number) or number < 0 or number * mult > MAX_SIZE:
        raise ValueError(f"size must be between 0 and {MAX_SIZE} bytes, got {str(original)[:40]!r}")
    return int(number * mult)
