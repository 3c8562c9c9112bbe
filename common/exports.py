"""A package's public names, imported on first use (PEP 562).

A package that gathers names from its modules writes their imports once, under
``if TYPE_CHECKING:`` (what type checkers and readers see), and binds::

    __getattr__ = LazyExports.read(__name__, __file__).resolve

Importing the package then imports none of those modules; the first use of a name
(``kvpack.KVStore``, ``from kvpack import KVStore``) imports its module and binds the name
in the package, so later uses are plain attribute reads. Why: a process that needs one
module (`kvpack config`, `kvpack proxy`, a tool, ``kvpack.identity.keys``) does not import
torch and every tier to get it.

Invariant: the names are exactly the block's ``from .module import name [as alias]``
lines, read from the package's own source: one list (tests/common/test_structure.py counts
each as an import of the package, so circles and layers are checked as before).
"""

from __future__ import annotations

import ast
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LazyExports:
    package: str
    """The package's name (``kvpack``, ``kvpack.ops``)."""
    sources: dict[str, tuple[str, str]]
    """Public name -> (its module, relative to the package: ``.store``; its name there)."""

    @classmethod
    def read(cls, package: str, init_file: str) -> LazyExports:
        """The exports of the package whose ``__init__.py`` is `init_file`: its top-level
        ``if TYPE_CHECKING:`` block's relative ``from`` imports."""
        tree = ast.parse(Path(init_file).read_text(encoding="utf-8"), filename=init_file)
        sources: dict[str, tuple[str, str]] = {}
        for node in tree.body:
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                for stmt in node.body:
                    if isinstance(stmt, ast.ImportFrom) and stmt.level == 1 and stmt.module:
                        for alias in stmt.names:
                            sources[alias.asname or alias.name] = ("." + stmt.module, alias.name)
        return cls(package, sources)

    def resolve(self, name: str) -> object:
        """The package attribute `name`, its module imported now; AttributeError when it is no export."""
        try:
            module, attr = self.sources[name]
        except KeyError:
            raise AttributeError(f"module {self.package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module, self.package), attr)
        setattr(sys.modules[self.package], name, value)
        return value
