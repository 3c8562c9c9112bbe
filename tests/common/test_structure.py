"""The tree keeps its shape: the core imports no engine, adapter or tool; no module is huge.

Read from the source with `ast` (nothing is imported), so a lazy import inside a
function, a `TYPE_CHECKING` block or an `importlib.import_module("...")` with a
literal name counts the same as one at the top of a file.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "common"  # import kvpack
# folders of the shipped package (pyproject.toml's package-dir) whose modules must stay readable
PACKAGE_FOLDERS = ("common", "vllm_plugin", "sglang_plugin", "tools")
# what the engine-neutral core must never import (DESIGN.md: adapters import the core, not the reverse;
# the operator tools in tools/ are reached by the CLI by module name only)
FORBIDDEN = ("vllm", "sglang", "kvpack.vllm_plugin", "kvpack.sglang_plugin", "kvpack.tools")
MAX_LINES = 600


def _module_of(path: Path, folder: Path, package: str) -> str:
    """`common/tiers/disk.py` -> `kvpack.tiers.disk` (a package's `__init__.py` -> the package)."""
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _imported(path: Path, folder: Path = CORE, top: str = "kvpack") -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every import in the file at any depth; `folder` is `top`'s source."""
    module = _module_of(path, folder, top)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield node.lineno, source
            for alias in node.names:  # `from kvpack import tools` imports a submodule
                yield node.lineno, f"{source}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def _is_forbidden(name: str, forbidden: tuple[str, ...] = FORBIDDEN) -> bool:
    return any(name == bad or name.startswith(bad + ".") for bad in forbidden)


def test_resolver_sees_relative_and_lazy_imports(tmp_path: Path) -> None:
    # the check itself: a lazy relative import of the adapter, two levels up, is found
    core = tmp_path / "common"
    (core / "tiers").mkdir(parents=True)
    src = core / "tiers" / "x.py"
    src.write_text(
        "def f():\n"
        "    from ..vllm_plugin import worker\n"
        "    import importlib\n"
        "    importlib.import_module('sglang.srt')\n"
    )
    found = [name for _, name in _imported(src, core) if _is_forbidden(name)]
    assert found == ["kvpack.vllm_plugin", "kvpack.vllm_plugin.worker", "sglang.srt"]


def test_core_imports_no_engine_adapter_or_tool() -> None:
    offenders: dict[str, str] = {}  # one line per import statement: the first forbidden name it names
    for path in sorted(CORE.rglob("*.py")):
        for line, name in _imported(path):
            if _is_forbidden(name):
                offenders.setdefault(f"{path.relative_to(ROOT)}:{line}", name)
    listing = "\n".join(f"{where}: {name}" for where, name in offenders.items())
    assert not offenders, "the core (common/) must not import these:\n" + listing


def test_adapters_import_no_tool() -> None:
    # the shipped adapters are product too: bench, soak and demo are never on their import path
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for folder in ("vllm_plugin", "sglang_plugin")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, name in _imported(path, ROOT / folder, f"kvpack.{folder}")
        if _is_forbidden(name, ("kvpack.tools",))
    ]
    assert not offenders, "an adapter imports an operator tool:\n" + "\n".join(dict.fromkeys(offenders))


def test_no_module_over_600_lines() -> None:
    # one job per module (issue 14); a module that grows past this is split, not excused
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in PACKAGE_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
    }
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    listing = ", ".join(f"{name} ({n})" for name, n in sorted(over.items()))
    assert not over, f"modules over {MAX_LINES} lines: {listing}"


def test_test_modules_have_unique_basenames() -> None:
    # tests/ has no __init__.py files: pytest imports each test module by its basename, and a
    # second module of the same name stops the whole suite's collection ("import file mismatch")
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename: {clashes}"
