"""Test-only stand-ins for modules SGLang's HTTP server imports but kvpack's SGLang venv lacks.

`scripts/venv.sh sglang` installs SGLang with ``--no-deps`` plus only the imports
its storage and host-pool code needs. The server imports three more at module
load, none of which this test uses:

- ``xgrammar`` (``StructuralTag`` in pydantic models of the function-call parsers;
  the grammar backend falls back to ``none`` when XGrammar is unusable),
- ``jsonschema`` (tool-schema validation in the chat endpoint),
- ``soundfile`` (audio endpoints).

A stand-in is installed only when the real module is not importable; its
attributes are pydantic models (usable as field types) or, for ``*Error``
names, exception classes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

NAMES = ("xgrammar", "jsonschema", "soundfile")


class StandInModule(ModuleType):
    """A module whose every public attribute is a placeholder class."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        if name.endswith("Error"):
            return type(name, (Exception,), {})
        import pydantic

        return type(name, (pydantic.BaseModel,), {"model_config": pydantic.ConfigDict(extra="allow")})


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `StandInModule` for the given top-level names and their submodules."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return StandInModule(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        module.__path__ = []


def install() -> None:
    """Add a finder for the names in `NAMES` that are not installed (idempotent)."""
    absent = [name for name in NAMES if importlib.util.find_spec(name) is None]
    if absent and not any(isinstance(f, StandInFinder) for f in sys.meta_path):
        sys.meta_path.append(StandInFinder(absent))
