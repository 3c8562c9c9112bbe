"""The tree keeps its shape: the core imports no engine, adapter or tool; no module is huge;
no import circles; the adapters reach the core through its public names and one door
(`kvpack.Session`: no store, no metric counted by name) in classes of about 250 lines
(docs/ARCHITECTURE.md).

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
# what the engine-neutral core must never import (docs/ARCHITECTURE.md: adapters import the core, not the reverse;
# the operator tools in tools/ are reached by the CLI by module name only)
FORBIDDEN = ("vllm", "sglang", "kvpack.vllm_plugin", "kvpack.sglang_plugin", "kvpack.tools")
MAX_LINES = 1000
"""Past this a module is a god file (STYLE.md); well below it, a module is judged by its job."""


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


def test_no_god_module() -> None:
    """A module has one job; its size is not why it is split (a 600-line cap cut the store into
    mixins). This only keeps out the files that do everything (STYLE.md) and names the largest."""
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in PACKAGE_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
    }
    largest = ", ".join(f"{name} ({n})" for name, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:8])
    assert max(sizes.values()) <= MAX_LINES, f"a module over {MAX_LINES} lines; the largest: {largest}"


def test_test_modules_have_unique_basenames() -> None:
    # tests/ has no __init__.py files: pytest imports each test module by its basename, and a
    # second module of the same name stops the whole suite's collection ("import file mismatch")
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename: {clashes}"


# -- the product import graph -------------------------------------------------------

TOPS = {"common": "kvpack", "vllm_plugin": "kvpack.vllm_plugin", "sglang_plugin": "kvpack.sglang_plugin"}
TOPS["tools"] = "kvpack.tools"
PUBLIC = ("kvpack", "kvpack.ops", "kvpack.transfers")
"""What an adapter may import from the core: the package's public names and the kernels' entry."""

BUILT_BY_THE_CORE = frozenset({"StoreKey", "GroupKey", "ObjectHeader", "Expectation", "PutItem", "LoadItem"})
"""What only the core builds (`kvpack.session`): an adapter that built one by hand would hold
key, header or expectation policy (issue 28)."""


def _modules(root: Path = ROOT, tops: dict[str, str] = TOPS) -> dict[str, Path]:
    """Every product module's name -> its source file."""
    return {
        _module_of(path, root / folder, top): path
        for folder, top in tops.items()
        for path in sorted((root / folder).rglob("*.py"))
    }


def _lazy_package(tree: ast.Module) -> bool:
    """Whether a package ``__init__`` exports lazily (`kvpack.exports`: ``__getattr__ = LazyExports...``):
    its ``TYPE_CHECKING`` block then holds imports that do run, on a name's first use."""
    return any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__getattr__" for t in node.targets)
        and "LazyExports" in ast.unparse(node.value)
        for node in tree.body
    )


def _type_only_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes under an ``if TYPE_CHECKING:`` block: imports that never run (a lazy
    package's exports aside: they run when a name is first used)."""
    nodes: set[int] = set()
    if _lazy_package(tree):
        return nodes
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes.update(id(inner) for inner in node.body for inner in ast.walk(inner))
    return nodes


def _top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """The statements at a module's top level, a lazy package's exports block unfolded."""
    lazy = _lazy_package(tree)
    return [
        inner
        for node in tree.body
        for inner in (
            node.body if lazy and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) else [node]
        )
    ]


def _package_names(package: str, modules: dict[str, Path]) -> set[str]:
    """Names a package's ``__init__`` binds with ``from .module import name`` (at its top level, or
    as a lazy export)."""
    path = modules.get(package)
    if path is None or path.name != "__init__.py":
        return set()
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        alias.asname or alias.name
        for node in _top_level_imports(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        for alias in node.names
    }


def _runtime_edges(module: str, path: Path, modules: dict[str, Path], *, typing: bool = False) -> set[str]:
    """The product modules `module` imports when it runs, at any depth (lazy imports count,
    ``TYPE_CHECKING`` blocks only with `typing`). ``from pkg import name`` is an edge to
    ``pkg.name`` when that is a module, else to ``pkg`` (a package binds no name of one of
    its modules: `test_public_names_do_not_shadow_a_submodule`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = set() if typing else _type_only_nodes(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                source = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in modules:
                    out.add(full)
                elif source in modules:
                    out.add(source)
    out.discard(module)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_the_edge_finder_counts_a_lazy_packages_exports(tmp_path: Path) -> None:
    # the check itself: a package that exports lazily (`kvpack.exports`) imports its exports' modules
    # when they are used, so they are its edges; a plain TYPE_CHECKING block's imports never run
    pkg = tmp_path / "common" / "p"
    pkg.mkdir(parents=True)
    for name in ("a", "b"):
        (pkg / f"{name}.py").write_text("X = 1\n")
    init = pkg / "__init__.py"
    block = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n"
    modules = {"kvpack.p": init, "kvpack.p.a": pkg / "a.py", "kvpack.p.b": pkg / "b.py"}
    init.write_text(block)
    assert _runtime_edges("kvpack.p", init, modules) == set()
    init.write_text(block + "__getattr__ = LazyExports.read(__name__, __file__).resolve\n")
    assert _runtime_edges("kvpack.p", init, modules) == {"kvpack.p.a"}
    assert _package_names("kvpack.p", modules) == {"X"}


def test_circle_finder_sees_a_lazy_circle(tmp_path: Path) -> None:
    # the check itself: base's lazy import of lru (the old eviction circle) closes a loop
    pkg = tmp_path / "common" / "cycle"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "base.py").write_text("def make():\n    from .lru import LRU\n    return LRU()\n")
    (pkg / "lru.py").write_text("from .base import make\n")
    (pkg / "arc.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .base import make\n")
    modules = _modules(tmp_path, {"common": "kvpack"})
    graph = {name: _runtime_edges(name, path, modules) for name, path in modules.items()}
    assert _circles(graph) == [["kvpack.cycle.base", "kvpack.cycle.lru"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_product_imports_have_no_circles() -> None:
    # a circle makes import order matter and hides which layer owns what (issue 28); in the core the
    # names a module takes for its annotations count too (issue 53): a type is a dependency a reader follows
    modules = _modules()
    graph = {
        name: _runtime_edges(name, path, modules, typing=_layer_of(name) is not None) for name, path in modules.items()
    }
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "cpu_features", "background", "exports"),
    ("ops",),
    ("identity", "client_input"),
    ("config",),
    ("canonical", "observe"),
    ("policy",),
    ("tiers",),
    ("store", "exit_flush"),
    ("session",),
    ("transfers",),
    ("operate",),
    ("cli",),
)
"""The core's folders and loose modules (``kvpack.<name>``), lowest first, as docs/ARCHITECTURE.md
draws them: a module imports its own layer and those below, never one above (annotations count)."""


def _layer_of(module: str) -> str | None:
    """`kvpack.tiers.index.catalog` -> ``tiers``; None outside the core (adapters, tools) or for the package itself."""
    parts = module.split(".")
    if parts[0] != "kvpack" or len(parts) < 2 or parts[1] in ("vllm_plugin", "sglang_plugin", "tools", "csrc"):
        return None
    return parts[1]


def test_the_core_imports_only_down_its_layers() -> None:
    rank = {name: i for i, names in enumerate(LAYERS) for name in names}
    modules = _modules()
    core = {_layer_of(name) for name in modules} - {None}
    assert core <= rank.keys(), f"a folder or loose module of the core in no layer: {sorted(core - rank.keys())}"
    upward = sorted(
        f"{name} -> {target}"
        for name, path in modules.items()
        if (here := _layer_of(name)) is not None
        for target in _runtime_edges(name, path, modules, typing=True)
        if (there := _layer_of(target)) is not None and rank[there] > rank[here]
    )
    assert not upward, "imports up the layers: " + "; ".join(upward)


OPTIONAL_DEPENDENCIES = ("mooncake", "torch.utils.cpp_extension")
"""What the core may import inside a function: a dependency not every install has or needs
(Mooncake's client; torch's C++ build tooling, used only when the kernels are built)."""


def _imports_in_functions(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import inside a function of `path` (``TYPE_CHECKING`` blocks aside)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typed = _type_only_nodes(tree)
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if id(node) in typed:
                    continue
                if isinstance(node, ast.ImportFrom):
                    source = "." * node.level + (node.module or "")
                    found.extend(
                        (
                            node.lineno,
                            f"{source}.{alias.name}" if node.module else source + alias.name,
                        )
                        for alias in node.names
                    )
                elif isinstance(node, ast.Import):
                    found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def test_an_import_inside_a_function_is_only_an_optional_dependency() -> None:
    # a lazy import hides a circle or a layer crossed (issue 53); it stays only where the module may be missing
    lazy = [
        f"{path.relative_to(ROOT)}:{line} {module}"
        for path in sorted(CORE.rglob("*.py"))
        for line, module in _imports_in_functions(path)
        if not module.startswith(OPTIONAL_DEPENDENCIES)
    ]
    assert not lazy, "imports inside functions: " + "; ".join(lazy)


def test_the_lazy_import_finder_sees_one(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
        "def f():\n    from .b import B\n    import mooncake.store\n    return B\n"
    )
    assert _imports_in_functions(source) == [(5, ".b.B"), (6, "mooncake.store")]


def test_adapters_import_only_public_core_names() -> None:
    # the adapters reach the core through `kvpack` and `kvpack.ops` only (issue 28)
    modules = _modules()
    for folder, top in TOPS.items():
        if folder not in ("vllm_plugin", "sglang_plugin"):
            continue
        internal: dict[str, set[str]] = {}
        for name, path in modules.items():
            if name == top or name.startswith(top + "."):
                for target in _runtime_edges(name, path, modules, typing=True):
                    core = target == "kvpack" or (target.startswith("kvpack.") and not target.startswith(top))
                    if core and target not in PUBLIC:
                        internal.setdefault(target, set()).add(name)
        assert not internal, f"{folder} imports core-internal modules (use a public kvpack name): {internal}"


def _hand_built(source: str) -> list[tuple[int, str]]:
    """(line, class) of every call that builds a `BUILT_BY_THE_CORE` object: ``X(...)`` or ``X.batch(...)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "batch":
            func = func.value
        if isinstance(func, ast.Name) and func.id in BUILT_BY_THE_CORE:
            found.append((node.lineno, func.id))
    return found


def test_adapters_build_no_keys_headers_or_expectations() -> None:
    # the session builds them from engine facts; StoreKey(...) or ObjectHeader.batch(...)
    # in an adapter is key or header policy in the wrong layer (issue 28)
    found = [
        f"{path.relative_to(ROOT)}:{line} {name}"
        for folder in ("vllm_plugin", "sglang_plugin")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, name in _hand_built(path.read_text())
    ]
    assert not found, "adapters build core objects by hand (use kvpack.Session): " + ", ".join(found)


def test_the_build_check_sees_a_hand_built_key() -> None:
    source = "from kvpack import StoreKey, Session\nk = StoreKey.batch('t', 'f', ['c'], 'kv')\ns = Session(store)\n"
    assert _hand_built(source) == [(2, "StoreKey")]


def test_public_names_do_not_shadow_a_submodule() -> None:
    # `from .model_identity import model_identity` in kvpack/__init__.py once rebound
    # `kvpack.identity.model_identity` to the function: `import kvpack.identity.model_identity as mi` broke
    modules = _modules()
    for package in ("kvpack", "kvpack.ops", "kvpack.transfers", "kvpack.canonical"):
        shadowed = sorted(n for n in _package_names(package, modules) if f"{package}.{n}" in modules)
        assert not shadowed, f"{package} binds names of its own submodules: {shadowed}"


ADAPTER_FOLDERS = ("vllm_plugin", "sglang_plugin")
MAX_ADAPTER_CLASS_LINES = 250
"""An adapter class translates; one that grows past this holds the core's work (plans, jobs, counts)."""
CLASS_CEILINGS: dict[str, int] = {}
"""Adapter classes still over `MAX_ADAPTER_CLASS_LINES`, at their present size: they may shrink, never grow."""


def _adapter_modules(root: Path = ROOT) -> list[Path]:
    return [path for folder in ADAPTER_FOLDERS for path in sorted((root / folder).rglob("*.py"))]


def _store_uses(source: str) -> list[int]:
    """Lines that name a store: ``store.x``, ``self.store``, ``session.store`` (an attribute or a name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "store":
            found.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id == "store":
            found.append(node.lineno)
    return sorted(set(found))


def test_adapters_reach_the_store_only_through_the_session() -> None:
    # hit rules, tail placement, warm-up holds, waits, flushes and counts are the session's
    found = {str(p.relative_to(ROOT)): _store_uses(p.read_text()) for p in _adapter_modules()}
    found = {path: lines for path, lines in found.items() if lines}
    assert not found, f"adapter modules that reach into the store (use kvpack.Session): {found}"


def test_the_store_check_sees_a_store_call() -> None:
    source = "def f(self):\n    self.store.tails.find()\n    x = self.session.key()\n    store.close()\n"
    assert _store_uses(source) == [2, 4]


def _metric_names() -> set[str]:
    """Every metric name in `kvpack.observe.metrics.SPECS` (the first argument of each ``MetricSpec(...)``)."""
    tree = ast.parse((CORE / "observe" / "metrics.py").read_text())
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", "") == "MetricSpec"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


def _counted(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) of each metric name literal, each ``.inc(`` / ``.observe(`` / ``.gauge(``
    call and each ``x.metrics.y`` (a metric reached through an attribute chain)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("inc", "observe", "gauge"):
                found.append((node.lineno, node.func.attr))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "metrics":
            found.append((node.lineno, f"metrics.{node.attr}"))
    return sorted(set(found))


def test_adapters_count_no_metric_by_name() -> None:
    # they report events (kvpack.AdapterEvent, Session.report.record / refused); the core names the metric
    names = _metric_names()
    assert "handoff_refused" in names and "loaded_tokens" in names and "workers_disabled" in names
    found = {str(p.relative_to(ROOT)): _counted(p.read_text(), names) for p in _adapter_modules()}
    found = {path: what for path, what in found.items() if what}
    assert not found, f"metrics counted by name in an adapter (use Session.report.record): {found}"


def test_the_metric_check_sees_a_count_by_name() -> None:
    source = "m.inc('x')\ns.record(E.X)\ny = 'lookups_held'\nself.store.metrics.value('z')\n"
    assert _counted(source, {"lookups_held"}) == [(1, "inc"), (3, "lookups_held"), (4, "metrics.value")]


def _class_sizes(source: str) -> dict[str, int]:
    """Lines of each top-level class (its decorators to its last line), by name."""
    tree = ast.parse(source)
    return {
        node.name: node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None
    }


def test_adapter_classes_translate_in_about_250_lines() -> None:
    # a connector side or a storage backend over this is doing the core's work
    over = {
        f"{path.relative_to(ROOT)}:{name}": n
        for path in _adapter_modules()
        for name, n in _class_sizes(path.read_text()).items()
        if n > CLASS_CEILINGS.get(f"{path.relative_to(ROOT)}:{name}", MAX_ADAPTER_CLASS_LINES)
    }
    assert not over, f"adapter classes over {MAX_ADAPTER_CLASS_LINES} lines: {over}"


def test_the_class_size_check_counts_a_class() -> None:
    assert _class_sizes("import x\n\n@dataclass\nclass A:\n    a: int\n\n    b: int\n") == {"A": 5}


RULE_HOMES = {
    "quota": ("common/policy/eviction/shares.py",),
    "checksum": ("common/identity/objects.py", "common/store/integrity.py"),
}
"""Rules written once, by the module that may state them: a tenant's guaranteed share read
(`quotas[t]`, `quotas.get(t)`: the victim rule, used by the memory tier and the disk index),
and a loaded payload's checksum compared (`== / != x.checksum`: `objects.check_payload`, the
keyed MAC in `integrity`). Every other module passes them on."""


def _rule_uses(source: str) -> list[tuple[int, str]]:
    """(line, rule) of each place `source` states a rule of `RULE_HOMES`."""

    def quotas(node: ast.expr) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name.endswith("quotas")

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and quotas(node.value):
            found.append((node.lineno, "quota"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if quotas(node.func.value):
                found.append((node.lineno, "quota"))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "checksum" for s in sides):
                found.append((node.lineno, "checksum"))
    return sorted(set(found))


def test_each_rule_is_written_once() -> None:
    # the quota rule once for both accountings (memory, disk index); one payload check for every tier's read
    found = {
        f"{path.relative_to(ROOT)}:{line}": rule
        for folder in PACKAGE_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, rule in _rule_uses(path.read_text())
        if str(path.relative_to(ROOT)) not in RULE_HOMES[rule]
    }
    assert not found, f"a rule stated outside its one home ({RULE_HOMES}): {found}"


def test_the_rule_check_sees_a_second_copy() -> None:
    source = "if used[t] > self._quotas.get(t, 0):\n    pass\nok = h.checksum != xxh3(p)\nq = quotas[t]\nn = h.checksum is None\n"
    assert _rule_uses(source) == [(1, "quota"), (3, "checksum"), (4, "quota")]


KEYS_HOME = "common/identity/keys.py"
"""Where the identity rules are written: the chunk-hash chain (`chunk_hashes`, `chain_hash`,
`ChunkChain`), the key string (``kvpack/<tenant>/...``) and member naming (`member_name`:
``<base>[_g<group>][_pp<stage>][_h<start>_<stop>][@<shard>of<shards>]``)."""


def _identity_restated(source: str, adapter: bool) -> list[tuple[int, str]]:
    """(line, rule) of each place `source` restates a `KEYS_HOME` rule: a key string or a member's
    shard suffix built by hand (an f-string starting ``kvpack/``, or holding ``@{..}of{..}``);
    in an adapter, a chain hashed by hand (`chunk_hashes` / `chain_hash`: it holds a `ChunkChain`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            if text.startswith("kvpack/"):
                found.append((node.lineno, "key string"))
            elif "@{}of{}" in text:
                found.append((node.lineno, "member name"))
        elif adapter and isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in ("chunk_hashes", "chain_hash"):
                found.append((node.lineno, "chunk chain"))
    return sorted(set(found))


def test_key_string_chain_and_member_names_are_written_once() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line} {rule}"
        for folder in PACKAGE_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if str(path.relative_to(ROOT)) != KEYS_HOME
        for line, rule in _identity_restated(path.read_text(), folder in ("vllm_plugin", "sglang_plugin"))
    ]
    assert not found, f"an identity rule restated outside {KEYS_HOME} (call its function): {found}"


def test_the_identity_check_sees_a_second_copy() -> None:
    source = (
        'k = f"kvpack/{t}/{fp}/{c}/kv"\nm = f"{base}@{rank}of{world}"\nh = kvpack.chunk_hashes(ids, bs, parent=p)\n'
        'g = chain_hash(p, ids)\nok = f"kvpack: {x}"\n'
    )
    assert _identity_restated(source, adapter=True) == [
        (1, "key string"),
        (2, "member name"),
        (3, "chunk chain"),
        (4, "chunk chain"),
    ]
    assert _identity_restated(source, adapter=False) == [(1, "key string"), (2, "member name")]
