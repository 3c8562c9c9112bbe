"""tests/ops set-up: make `kvpack` importable from the checkout when it is not installed.

The package maps common/ -> kvpack (pyproject package-dir); in a venv without an
editable install, register that mapping here so these tests still run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]

if importlib.util.find_spec("kvpack") is None:
    spec = importlib.util.spec_from_file_location(
        "kvpack", _ROOT / "common" / "__init__.py", submodule_search_locations=[str(_ROOT / "common")]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvpack"] = module
    spec.loader.exec_module(module)
