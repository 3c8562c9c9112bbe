"""A python that sees what a lent GPU machine's image holds, built from this test python.

The image (docs: ../shared/ENGINES.md, "CUDA kernels without a GPU") has torch, Triton, pytest,
xxhash and prometheus-client, no vLLM, SGLang, Mooncake or transformers, and no installed
kvpack. `device_python` is this interpreter under ``-S`` (no site-packages, so no ``.pth``
file runs and an editable kvpack is not importable) with ``PYTHONPATH`` set to a folder of
links to the site-packages entries of `IMAGE_MODULES` only: anything else that this venv holds
(vLLM, Mooncake, the editable install's finder) cannot be imported, as on the image.

numpy is in `IMAGE_MODULES`: it is a dependency of kvpack (pyproject), and the image's torch
is expected to bring it; scripts/gpu_check.sh says so in its env step when it is missing.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Top-level import names (and their *.libs folders) of the image's distributions: torch and
# what it needs, Triton, pytest and its plugins' base, kvpack's small dependencies, ninja.
IMAGE_MODULES = frozenset(
    {
        "torch", "torchgen", "functorch", "triton", "filelock", "typing_extensions", "sympy", "isympy",
        "mpmath", "networkx", "jinja2", "markupsafe", "fsspec", "setuptools", "pkg_resources",
        "_distutils_hack", "pytest", "_pytest", "py", "pluggy", "iniconfig", "packaging", "pygments",
        "numpy", "xxhash", "prometheus_client", "ninja",
    }
)  # fmt: skip


def _import_name(entry: str) -> str:
    """The import name a site-packages entry provides (``numpy.libs`` counts as numpy)."""
    if entry.endswith((".dist-info", ".egg-info")):
        return re.split(r"-", entry, maxsplit=1)[0].lower().replace("-", "_")
    return entry.split(".", 1)[0]


@dataclass(frozen=True)
class DevicePython:
    """The command and environment of a device-like python."""

    argv: list[str]  # the interpreter and its flags; append a script or -m/-c
    env: dict[str, str]

    def shell_python(self) -> str:
        """The interpreter as scripts/gpu_check.sh's PYTHON (words split on spaces)."""
        return " ".join(self.argv)


def link_image_site(dest: Path, leave_out: frozenset[str] = frozenset()) -> Path:
    """A folder of links to the image's entries of this interpreter's site-packages, but
    those of `leave_out` (an image that lacks them)."""
    dest.mkdir(parents=True, exist_ok=True)
    for key in ("purelib", "platlib"):
        site = Path(sysconfig.get_paths()[key])
        if not site.is_dir():
            continue
        for entry in site.iterdir():
            link = dest / entry.name
            if _import_name(entry.name) in IMAGE_MODULES - leave_out and not link.exists():
                link.symlink_to(entry)
    return dest


def device_python(site: Path) -> DevicePython:
    """This interpreter, device-like: ``-S``, `site` (`link_image_site`) as its only packages."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
    return DevicePython([sys.executable, "-S"], env)
