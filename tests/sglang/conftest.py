"""tests/sglang: real SGLang classes (host pools, storage factory), no GPU.

The shim must run before anything imports sglang (see kvpack_sglang_shim).
Every test here is marked ``sglang``; the suite needs the sglang venv
(``scripts/venv.sh sglang``) and skips as a whole without SGLang.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _sglang_installed() -> bool:
    """The installed distribution, not `find_spec` (which finds this tests/sglang folder)."""
    try:
        importlib.metadata.version("sglang")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


if not _sglang_installed():
    collect_ignore_glob = ["test_*.py", "server/test_*.py"]
else:
    import kvpack_sglang_shim  # noqa: F401
