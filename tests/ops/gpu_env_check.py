"""The GPU check's first step: can this python run the rest? (run by scripts/gpu_check.sh)

Says, on one ``STEP env PASS|FAIL reason`` line after the details, whether `kvpack` imports
(installed, or mapped from this checkout by tests/kvpack_checkout.py), whether the core's
dependencies and pytest import, and, unless ``--dry-run``, whether a CUDA device is visible and
the extension can be built for it (a C++ compiler, ninja, an nvcc whose major version is
torch's CUDA major). Everything missing is named at once, so one run on a lent machine
says all that a rerun needs.

    python tests/ops/gpu_env_check.py [--dry-run]
Exit status: 0 when nothing is missing.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import kvpack_checkout  # noqa: E402

MAPPING = kvpack_checkout.map_checkout()

import torch  # noqa: E402

# kvpack's runtime dependencies (pyproject [project] dependencies) and the test runner
NEEDED = ("numpy", "xxhash", "prometheus_client", "pytest")


def missing_modules() -> list[str]:
    """Each needed module that does not import, with the error."""
    out = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except ImportError as e:
            out.append(f"{name} ({e})")
    return out


def build_problems() -> list[str]:
    """What stops the CUDA kernel from being built here (empty: nothing known)."""
    from kvpack.ops._build import _compiler_missing, cuda_major_mismatch, nvcc_version

    problems = []
    if not torch.cuda.is_available():
        problems.append("no CUDA device visible (torch.cuda.is_available() is False)")
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is built without CUDA")
    nvcc = nvcc_version()
    print(f"nvcc: {nvcc or 'not found'}", flush=True)
    if nvcc is None:
        problems.append("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
    elif mismatch := cuda_major_mismatch(nvcc, torch.version.cuda):
        problems.append(mismatch)
    if compiler := _compiler_missing():
        problems.append(compiler)
    return problems


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="no GPU expected: imports only")
    args = p.parse_args(argv)
    print(f"python {platform.python_version()} ({sys.executable}); {MAPPING.describe()}", flush=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); GPU: {gpu}", flush=True)
    problems = missing_modules()
    if MAPPING.source is kvpack_checkout.Source.CHECKOUT_BARE:
        problems.append(f"the kvpack core does not import: {MAPPING.reason}")
    if not args.dry_run:
        problems += build_problems()
    if problems:
        print(f"STEP env FAIL {'; '.join(problems)}", flush=True)
        return 1
    print(f"STEP env PASS {MAPPING.source.value} kvpack, {', '.join(NEEDED)} import; GPU {gpu}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
