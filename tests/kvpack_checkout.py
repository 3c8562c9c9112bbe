"""Import `kvpack` from this checkout on a python where it is not installed.

pyproject.toml's ``package-dir`` puts four source folders under one import namespace:
``common/`` is ``kvpack``, ``vllm_plugin/`` ``kvpack.vllm_plugin``, ``sglang_plugin/``
``kvpack.sglang_plugin``, ``tools/`` ``kvpack.tools`` (and ``csrc/`` ``kvpack.csrc``, the
kernel sources). An install (editable or not) provides that mapping; a plain checkout run by a
python with torch and the core's small dependencies only (a lent GPU machine's image) does
not. `map_checkout` then puts a finder first on ``sys.meta_path`` that maps exactly those
names to the checkout's folders, as an editable install's finder does; their submodules are
found through each package's ``__path__`` as usual.

Invariants: an importable ``kvpack`` is never replaced (an install wins, and the answer says
where it lives); calling `map_checkout` twice maps once; `PACKAGE_DIRS` equals pyproject's
``package-dir`` (tests/ops/test_gpu_check_imports.py compares them). When the core cannot be
imported on this python (a dependency such as numpy or xxhash is missing), ``kvpack`` is
left as a bare package over ``common/``, so the torch-only ``kvpack.ops`` still loads, and
the answer says why.

Imported by tests/conftest.py and tests/ops/conftest.py before anything imports ``kvpack``,
and by the GPU check's scripts (tests/ops/gpu_*.py), which put tests/ on ``sys.path`` first.
It lives outside ``common/``: it is how a checkout is run, not part of the package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# import name -> folder of the checkout (pyproject.toml [tool.setuptools] package-dir)
PACKAGE_DIRS: dict[str, str] = {
    "kvpack": "common",
    "kvpack.vllm_plugin": "vllm_plugin",
    "kvpack.sglang_plugin": "sglang_plugin",
    "kvpack.csrc": "csrc",
    "kvpack.tools": "tools",
}


class Source(str, Enum):
    """Where ``kvpack`` is imported from."""

    INSTALLED = "installed"  # an install (editable or not) resolves it; nothing was mapped
    CHECKOUT = "checkout"  # mapped onto this checkout's folders, the core imports
    CHECKOUT_BARE = "checkout-bare"  # mapped, but the core's imports failed: kvpack.ops only


@dataclass(frozen=True)
class Mapping:
    """The answer of `map_checkout`: where ``kvpack`` comes from and, when bare, why."""

    source: Source
    location: str  # the folder or file that ``kvpack`` resolves to
    reason: str = ""  # the ImportError that left the package bare

    def describe(self) -> str:
        text = f"kvpack: {self.source.value} ({self.location})"
        return f"{text}; core not importable: {self.reason}" if self.reason else text


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the names of `PACKAGE_DIRS` in a checkout's folders, nothing else."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folders = {name: root / folder for name, folder in PACKAGE_DIRS.items()}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        folder = self.folders.get(fullname)
        if folder is None or not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def _installed() -> str | None:
    """Where an installed ``kvpack`` resolves to, or None (no finder of ours consulted)."""
    if any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        return None
    spec = importlib.util.find_spec("kvpack")
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or [])


def map_checkout(root: Path = ROOT) -> Mapping:
    """Make ``kvpack`` importable from `root` unless an install already provides it."""
    mine = next((f for f in sys.meta_path if isinstance(f, CheckoutFinder)), None)
    if mine is None:
        where = _installed()
        if where is not None:
            return Mapping(Source.INSTALLED, where)
        mine = CheckoutFinder(root)
        sys.meta_path.insert(0, mine)
    common = str(mine.folders["kvpack"])
    why: str = getattr(sys.modules.get("kvpack"), "__kvpack_bare__", "")
    if why:
        return Mapping(Source.CHECKOUT_BARE, common, why)
    try:
        importlib.import_module("kvpack")
    except ImportError as e:
        for name in [n for n in sys.modules if n == "kvpack" or n.startswith("kvpack.")]:
            del sys.modules[name]
        module = types.ModuleType("kvpack", "kvpack (bare: the core's imports failed; kvpack.ops only)")
        module.__path__ = [common]
        module.__kvpack_bare__ = str(e)  # type: ignore[attr-defined]
        sys.modules["kvpack"] = module
        return Mapping(Source.CHECKOUT_BARE, common, str(e))
    return Mapping(Source.CHECKOUT, common)
