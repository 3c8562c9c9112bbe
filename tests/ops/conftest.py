"""tests/ops set-up: make `kvpack` importable from the checkout when it is not installed.

The package maps common/ -> kvpack (pyproject package-dir). Without an editable
install (e.g. on a lent GPU machine, whose python may lack the core's deps such as
xxhash), register that mapping here: the full package if its imports resolve,
otherwise a bare `kvpack` package object so that `kvpack.ops` (torch only) loads.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_COMMON = _ROOT / "common"

if importlib.util.find_spec("kvpack") is None:
    spec = importlib.util.spec_from_file_location(
        "kvpack", _COMMON / "__init__.py", submodule_search_locations=[str(_COMMON)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kvpack"] = module
    try:
        spec.loader.exec_module(module)
    except ImportError:
        for name in [n for n in sys.modules if n.startswith("kvpack.")]:
            del sys.modules[name]
        bare = types.ModuleType("kvpack", "kvpack (bare: core imports unavailable, kvpack.ops only)")
        bare.__path__ = [str(_COMMON)]
        sys.modules["kvpack"] = bare
