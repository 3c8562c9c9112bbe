"""The GPU check imports and collects on a device-like python: this interpreter under ``-S``
with only the lent GPU image's packages (tests/ops/device_image.py), so ``kvpack`` is not
importable by installation and vLLM, SGLang and Mooncake are absent. Run that way,
``scripts/gpu_check.sh --dry-run`` maps kvpack from the checkout (tests/kvpack_checkout.py),
runs every step's imports, the staging check on the CPU and ``pytest --collect-only
tests/ops``: what a lent GPU machine runs first, so none of it first fails there."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from device_image import DevicePython, device_python, link_image_site

import kvpack_checkout
from kvpack.canonical.geometry import CanonicalGeometry

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> DevicePython:
    return device_python(link_image_site(tmp_path_factory.mktemp("image-site")))


def test_the_bootstrap_maps_what_pyproject_maps() -> None:
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    assert kvpack_checkout.PACKAGE_DIRS == package_dir


def test_the_device_python_is_device_like(device: DevicePython) -> None:
    """Without the bootstrap, nothing of kvpack or the engines imports on it (so the test
    below shows the check working there, not an installation)."""
    code = (
        "import importlib.util, sys\n"
        "found = [n for n in ('kvpack', 'vllm', 'sglang', 'mooncake', 'transformers') if importlib.util.find_spec(n)]\n"
        "import torch, xxhash, prometheus_client, pytest\n"
        "print('FOUND', found)\n"
    )
    r = subprocess.run(
        [*device.argv, "-c", code], cwd=ROOT, env=device.env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert "FOUND []" in r.stdout


def test_the_gpu_check_dry_run_passes_on_the_device_python(device: DevicePython, tmp_path: Path) -> None:
    env = {**device.env, "OUT": str(tmp_path), "PYTHON": device.shell_python()}
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and lines[-1].startswith("GPU_CHECK PASS steps=7/7 dry-run"), r.stdout + r.stderr
    steps = {line.split()[1]: line.split()[2] for line in lines if line.startswith("STEP ")}
    assert steps == {
        "env": "PASS",
        "kernels": "DRY",
        "vllm-views": "DRY" if hasattr(CanonicalGeometry, "from_block_views") else "SKIP",
        "copy-bench": "DRY",
        "staging": "PASS",
        "bandwidth": "DRY",
        "pytest": "DRY",
    }, r.stdout
    assert f"kvpack: checkout ({ROOT / 'common'})" in r.stdout  # mapped, not installed
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[-1] == lines[-1] and len(summary) == 8


def test_kvpack_tools_and_plugins_map_from_the_checkout(device: DevicePython) -> None:
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "import kvpack_checkout\n"
        "m = kvpack_checkout.map_checkout(); again = kvpack_checkout.map_checkout()\n"
        "import importlib.util, kvpack, kvpack.tools.bench.copy_bench, kvpack.vllm_plugin.blocks, kvpack.csrc\n"
        "sglang_plugin = importlib.util.find_spec('kvpack.sglang_plugin').origin  # importing it needs SGLang\n"
        "print(m.source.value, again.source.value, kvpack.__file__, kvpack.tools.__file__, kvpack.csrc.__file__,\n"
        "      kvpack.vllm_plugin.__file__, sglang_plugin)\n"
        "print(sum(isinstance(f, kvpack_checkout.CheckoutFinder) for f in sys.meta_path))\n"
    )
    r = subprocess.run(
        [*device.argv, "-c", code], cwd=ROOT, env=device.env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()[-2:]
    assert first.split() == [
        "checkout",
        "checkout",
        str(ROOT / "common" / "__init__.py"),
        str(ROOT / "tools" / "__init__.py"),
        str(ROOT / "csrc" / "__init__.py"),
        str(ROOT / "vllm_plugin" / "__init__.py"),
        str(ROOT / "sglang_plugin" / "__init__.py"),
    ]
    assert second == "1"


def test_an_installed_kvpack_is_left_alone() -> None:
    """On a python with kvpack installed (the project's venvs: editable) the bootstrap maps nothing."""
    try:
        importlib.metadata.distribution("kvpack")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("kvpack is not installed on this python")
    r = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import kvpack_checkout; "
         "print(kvpack_checkout.map_checkout().source.value)"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "installed"
