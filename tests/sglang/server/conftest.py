"""tests/sglang/server: the optional CPU SGLang server test, ignored (like tests/sglang) without SGLang.

Checks the installed distribution, not ``find_spec("sglang")``: with ``tests/`` on
``sys.path`` (pyproject's ``pythonpath``), ``tests/sglang`` itself is found as a
namespace package named ``sglang``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    version("sglang")
except PackageNotFoundError:
    collect_ignore_glob = ["test_*.py"]
