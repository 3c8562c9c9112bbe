"""Shared pytest set-up: fixtures live in tests/fixtures/ (one module per real part)."""

from __future__ import annotations

import importlib.util

pytest_plugins = [
    name
    for name in ("fixtures.common", "fixtures.mooncake", "fixtures.tiny_model")
    if importlib.util.find_spec(name) is not None
]
