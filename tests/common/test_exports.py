"""Lazy package exports (`kvpack.exports`): the operator commands start without torch, and every
exported name still resolves to what its module defines."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpack.exports import LazyExports

CORE = Path(__file__).resolve().parents[2] / "common"
HEAVY = ("torch", "vllm", "sglang", "mooncake")
"""What an operator command needs none of (the tiers it opens may import torch; these commands open none)."""


def _lazy_packages() -> list[str]:
    """The core packages whose ``__init__`` exports lazily."""
    out = []
    for init in sorted(CORE.rglob("__init__.py")):
        if "LazyExports.read(" in init.read_text():
            parts = init.parent.relative_to(CORE).parts
            out.append(".".join(("kvpack", *parts)))
    return out


def test_the_core_exports_lazily() -> None:
    # the packages an operator command passes through: a second eager one brings torch back
    assert {"kvpack", "kvpack.ops", "kvpack.store", "kvpack.tiers.host", "kvpack.tiers.disk"} <= set(_lazy_packages())


@pytest.mark.parametrize("package", _lazy_packages())
def test_every_export_resolves_to_its_modules_object(package: str) -> None:
    module = importlib.import_module(package)
    exports = LazyExports.read(package, str(module.__file__))
    assert exports.sources, f"{package}: no exports read"
    assert set(module.__all__) == set(exports.sources), f"{package}: __all__ and the exports differ"
    for name, (source, attr) in exports.sources.items():
        assert getattr(module, name) is getattr(importlib.import_module(source, package), attr), name
        assert name in vars(module), f"{package}.{name} is resolved once, then a plain attribute"


def test_a_name_that_is_no_export_is_an_attribute_error() -> None:
    import kvpack

    with pytest.raises(AttributeError, match="module 'kvpack' has no attribute 'KVStor'"):
        kvpack.KVStor  # noqa: B018 - the attribute read is the test
    assert not hasattr(kvpack, "KVStor")


COMMANDS = [
    ["config", "{config}"],
    ["config"],
    ["inspect", "{folder}"],
    ["host"],
    ["pin", "--list", "--disk", "{folder}"],
    ["proxy", "--help"],
    ["--help"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a).replace("{", "").replace("}", ""))
def test_an_operator_command_runs_without_torch(argv: list[str], tmp_path: Path) -> None:
    # each in a process of its own, as an operator runs it: what it imported is what it cost
    folder = tmp_path / "store"
    folder.mkdir(mode=0o700)
    config = tmp_path / "kvpack.json"
    config.write_text(json.dumps({"disk": {"path": str(folder)}}))
    args = [a.format(config=config, folder=folder) for a in argv]
    script = (
        "import sys\nfrom kvpack.cli import main\n"
        "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as exc:\n    code = exc.code\n"
        f"print('LOADED', [m for m in {HEAVY!r} if m in sys.modules], code, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert last == "LOADED [] 0", done.stderr[-2000:]
