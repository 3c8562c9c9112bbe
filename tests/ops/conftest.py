"""tests/ops set-up: `kvpack` from the checkout when it is not installed.

tests/conftest.py maps it first under pytest (tests/kvpack_checkout.py); this module does
the same for a script that imports it from tests/ops (test_build.py's fallback script).
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import kvpack_checkout  # noqa: E402

MAPPING = kvpack_checkout.map_checkout()
