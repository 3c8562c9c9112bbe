"""scripts/gpu_check.sh parses, and a real run on a machine without a GPU fails fast, every
step that needs one saying FAIL with the reason (never a pass, never a hang); a dependency
the image lacks (a module, ninja) is unpacked from a carried wheel first. Its dry run on a device-like python is
in test_gpu_check_imports.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch
from device_image import device_python, link_image_site

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# what scripts/gpu_check.sh runs besides python (coreutils, grep)
TOOLS = ("bash", "timeout", "tee", "grep", "cut", "date", "mkdir", "rm", "ls", "dirname", "basename", "chmod")
TOOLS += ("head", "tail", "cat", "env", "sleep")


def test_gpu_check_sh_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], timeout=30).returncode == 0


def _wheel_of(package: str, wheels: Path) -> None:
    """A wheel-shaped zip of this python's installed `package` (all the script unpacks)."""
    src = Path(sysconfig.get_paths()["platlib"]) / package
    wheels.mkdir()
    with zipfile.ZipFile(wheels / f"{package}-0-py3-none-any.whl", "w") as z:
        for f in src.rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts:
                z.write(f, f.relative_to(src.parent))


def _ninja_wheel(wheels: Path) -> None:
    """A wheel-shaped zip holding this machine's ninja where the ninja wheel keeps it."""
    ninja = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
    with zipfile.ZipFile(wheels / "ninja-0-py3-none-any.whl", "w") as z:
        z.write(ninja, "ninja-0.data/scripts/ninja")


def _path_without_ninja(bin_dir: Path) -> str:
    """A PATH of links to the tools the script and the env step use, ninja left out."""
    bin_dir.mkdir()
    for tool in (*TOOLS, "c++"):
        if found := shutil.which(tool):
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the real check runs on it")
def test_a_real_run_without_a_gpu_fails_every_gpu_step(tmp_path: Path) -> None:
    device = device_python(link_image_site(tmp_path / "site", leave_out=frozenset({"xxhash"})))
    _wheel_of("xxhash", tmp_path / "wheels")
    _ninja_wheel(tmp_path / "wheels")
    env = {
        **device.env,
        "PATH": _path_without_ninja(tmp_path / "bin"),
        "HOME": str(tmp_path),
        "OUT": str(tmp_path / "out"),
        "PYTHON": device.shell_python(),
        "KVPACK_GPU_WHEELS": str(tmp_path / "wheels"),
    }
    r = subprocess.run(["bash", str(SCRIPT), "--quick"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 1, r.stdout + r.stderr
    assert "xxhash missing: unpacked xxhash-0-py3-none-any.whl" in lines, r.stdout
    assert "ninja missing: unpacked ninja-0-py3-none-any.whl" in lines, r.stdout
    steps = {line.split()[1]: line.split(maxsplit=3)[2:] for line in lines if line.startswith("STEP ")}
    assert set(steps) == {"env", "kernels", "vllm-views", "copy-bench", "staging", "bandwidth", "pytest"}, r.stdout
    for name, (verdict, reason) in steps.items():
        assert verdict == "FAIL" and "no CUDA device visible" in reason, (name, r.stdout)
    assert "xxhash" not in steps["env"][1] and "ninja" not in steps["env"][1], r.stdout  # from the wheels
    assert lines[-1].startswith("GPU_CHECK FAIL steps=0/7 failed: env:FAIL kernels:FAIL vllm-views:FAIL"), r.stdout
    assert "no bandwidth figures" in lines[-1], r.stdout
