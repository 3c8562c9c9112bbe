"""The GPU check's staging script runs here with ``--cpu`` (every part a CPU can run), and
scripts/gpu_check.sh parses and runs its dry run: neither first fails on a lent GPU for a
reason this machine could have shown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_staging_check_passes_on_the_cpu() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "ops" / "gpu_staging_check.py"), "--cpu", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    summary = [line for line in r.stdout.splitlines() if line.startswith("GPU_STAGING ")]
    assert len(summary) == 1 and summary[0].startswith("GPU_STAGING PASS device=cpu checks=2/2"), r.stdout


def test_gpu_check_sh_dry_run(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("GPU_CHECK PASS"), r.stdout
