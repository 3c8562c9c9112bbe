"""tests/sglang: real SGLang classes (host pools, storage factory), no GPU.

The shim must run before anything imports sglang (see kvpack_sglang_shim).
Every test here is marked ``sglang``; the suite needs the sglang venv
(``scripts/venv.sh sglang``) and skips as a whole without SGLang.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import kvpack_sglang_shim  # noqa: F401

