"""SIMD levels of the C++ canonical copy (``KVP_SIMD_*`` in csrc/canonical_copy.h)."""

from __future__ import annotations

from enum import IntEnum


class CpuSimd(IntEnum):
    """SIMD levels of the C++ canonical copy, narrowest first. The kernel runs the widest
    level the CPU has (checked once, at run time); every level writes the same bytes."""

    SCALAR = 0
    SSE2 = 1
    AVX512 = 2  # AVX-512 F + BW
