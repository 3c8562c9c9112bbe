"""Lint and types as tests (issue #28): ruff check, ruff format --check and mypy over the product code.

Each tool is its own test and fails with the tool's output. A tool that is not installed in the venv that runs
the tests skips with that reason (requirements/test.txt pins both, so the venvs built by scripts/venv.sh have them).

mypy must see a `kvpack` package (pyproject maps common/ -> kvpack, vllm_plugin/ -> kvpack.vllm_plugin, ...), so
the test builds that tree out of symlinks in tmp_path and maps the paths mypy reports back to repo paths. Its cache
lives in ~/.cache/kvpack/mypy/<venv> so a rerun only re-checks what changed.

A last test keeps private-attribute reads between modules from creeping back: ruff's SLF001 flags them, and the
only exemptions allowed in product code are the ones listed (with their reason) below.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("common", "vllm_plugin", "sglang_plugin", "tools")
LINTED = (*PRODUCT, "tests")
# Sub-packages of kvpack that live in their own top-level folder (pyproject's package-dir).
MAPPED = ("vllm_plugin", "sglang_plugin", "tools", "csrc")

# SLF001 noqa comments allowed in product code: path -> how many, each with why. Empty: there are none.
SLF001_NOQA_ALLOWED: dict[str, int] = {
    # torch's per-tensor version counter (bumped by every counted in-place write) has no public
    # accessor; `kvpack.observe.weights` reads it to notice weights written in place.
    "common/observe/weights.py": 1,
}
# Files whose SLF001 is switched off as a whole in pyproject's per-file-ignores.
SLF001_FILE_IGNORES_ALLOWED = {
    # The SGLang bench times SGLang's own private page copies: the baseline it compares kvpack with.
    "tools/bench/sglang_bench.py",
    # The same SGLang page copies, timed beside a thread busy in Python.
    "tools/bench/sglang_gil.py",
    # The benches' torchvision shim asks torch's dispatcher whether two ops are registered.
    "tools/bench/sglang_pools.py",
}


def _tool(name: str) -> list[str]:
    """The command that runs `name` from the venv running the tests; skips when it is not installed."""
    exe = Path(sys.executable).parent / name
    if exe.exists():
        return [str(exe)]
    if importlib.util.find_spec(name) is not None:
        return [sys.executable, "-m", name]
    pytest.skip(f"{name} is not installed in {sys.prefix} (pip install -r requirements/test.txt)")


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, check=False)


def test_ruff_check() -> None:
    r = _run([*_tool("ruff"), "check", "--no-cache", *LINTED], ROOT)
    assert r.returncode == 0, f"ruff check failed:\n{r.stdout}{r.stderr}"


def test_ruff_format() -> None:
    r = _run([*_tool("ruff"), "format", "--check", "--no-cache", *LINTED], ROOT)
    assert r.returncode == 0, f"ruff format --check failed (run `ruff format` on these files):\n{r.stdout}{r.stderr}"


def _kvpack_tree(dest: Path) -> Path:
    """dest/kvpack: common/ as real folders of symlinked files, the mapped sub-packages as folder symlinks."""
    pkg = dest / "kvpack"
    common = ROOT / "common"
    for dirpath, dirnames, filenames in os.walk(common):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = Path(dirpath).relative_to(common)
        (pkg / rel).mkdir(parents=True, exist_ok=True)
        for f in filenames:
            if f.endswith((".py", ".pyi")) or f == "py.typed":
                (pkg / rel / f).symlink_to(Path(dirpath) / f)
    for d in MAPPED:
        if (ROOT / d).is_dir():
            (pkg / d).symlink_to(ROOT / d, target_is_directory=True)
    return pkg


def _repo_paths(output: str) -> str:
    """mypy's kvpack/... paths rewritten to the repo's own (common/..., vllm_plugin/..., ...)."""
    mapped = "|".join(MAPPED)
    out = re.sub(rf"(?m)^kvpack/({mapped})/", r"\1/", output)
    return re.sub(r"(?m)^kvpack/", "common/", out)


def test_mypy(tmp_path: Path) -> None:
    cmd = _tool("mypy")
    _kvpack_tree(tmp_path)
    venv_key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    cache = Path.home() / ".cache" / "kvpack" / "mypy" / venv_key
    r = _run([*cmd, "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache), "-p", "kvpack"], tmp_path)
    assert r.returncode == 0, f"mypy failed:\n{_repo_paths(r.stdout)}{r.stderr}"


def test_no_private_reads_across_modules() -> None:
    """No product module reads another object's private attribute (SLF001) outside the allowlists above."""
    found: dict[str, int] = {}
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            n = len(re.findall(r"noqa:[^\n]*\bSLF001\b", path.read_text(encoding="utf-8")))
            if n:
                found[str(path.relative_to(ROOT))] = n
    extra = {p: n for p, n in found.items() if n > SLF001_NOQA_ALLOWED.get(p, 0)}
    assert not extra, f"new `# noqa: SLF001` in product code (give the owner a public method/property): {extra}"

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    per_file = config["tool"]["ruff"]["lint"].get("per-file-ignores", {})
    ignored = {
        pattern
        for pattern, codes in per_file.items()
        if not pattern.startswith("tests/") and any("SLF001".startswith(c) for c in codes)
    }
    assert ignored <= SLF001_FILE_IGNORES_ALLOWED, f"SLF001 switched off for product files: {ignored}"
    assert "SLF" in config["tool"]["ruff"]["lint"]["select"], "ruff no longer selects SLF"
