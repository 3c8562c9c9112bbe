"""JIT build and load of the csrc/ kernels as torch custom ops (``torch.ops.kvpack``).

Built on first use with torch.utils.cpp_extension (ninja) into a per-user cache
(``$XDG_CACHE_HOME/kvpack/ext`` or ``~/.cache/kvpack/ext``), one folder per source
hash, torch version and flavour, so a second process (or a second venv) reuses or
rebuilds it safely. The CUDA kernel is compiled in only where torch has CUDA, a
GPU is visible and nvcc exists. The build is logged once; when no compiler (or
ninja) is found, or the build fails, the pure-torch fallback runs and that is
logged once (with the reason). The only module state is the lock-protected
handle below (the status and the extension's Python module).

`region_copier()` never waits: it is the native region copy once the
extension is loaded (by `load_extension`, which an adapter calls at start-up),
else None, and callers copy with numpy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .simd import CpuSimd

if TYPE_CHECKING:
    from ..tiers.parallel import RegionCopier

logger = logging.getLogger("kvpack.ops")

_SOURCES_CPU = (
    "bindings.cpp",
    "block_copy_cpu.cpp",
    "canonical_copy_cpu.cpp",
    "region_copy_cpu.cpp",
    "region_copy_py.cpp",
)
_SOURCES_CUDA = ("block_copy.cu", "canonical_copy.cu")
_HEADERS = (
    "block_copy_geometry.h",
    "canonical_copy.h",
    "canonical_copy_cuda.h",
    "cuda_words.h",
    "block_copy_cpu.h",
    "block_copy.h",
    "region_copy_cpu.h",
    "transpose_sse2.h",
    "transpose_avx512.h",
)


@dataclass(frozen=True)
class ExtensionStatus:
    """Outcome of loading the extension: usable or not, and why."""

    available: bool
    has_cuda: bool
    reason: str  # how it was built/loaded, or why the fallback runs
    build_dir: str | None = None


_lock = threading.Lock()
_status: ExtensionStatus | None = None
_module: Any = None


def csrc_dir() -> Path | None:
    """Folder with the kernel sources: package data ``kvpack.csrc`` or the repo's csrc/."""
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec("kvpack.csrc")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates.extend(Path(p) for p in spec.submodule_search_locations)
    candidates.append(Path(__file__).resolve().parents[2] / "csrc")
    for c in candidates:
        if all((c / f).is_file() for f in _SOURCES_CPU + _HEADERS):
            return c
    return None


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvpack" / "ext"


def cuda_build_possible() -> tuple[bool, str]:
    """Whether the CUDA kernel can be built here, and why not."""
    if torch.version.cuda is None:
        return False, "torch has no CUDA"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible"
    from torch.utils import cpp_extension

    nvcc = Path(cpp_extension.CUDA_HOME or "", "bin", "nvcc") if cpp_extension.CUDA_HOME else None
    if not (nvcc and nvcc.is_file()) and shutil.which("nvcc") is None:
        return False, "nvcc not found"
    return True, "CUDA torch, a device and nvcc"


def _compiler_missing() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"C++ compiler {cxx!r} not found"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja not found"
    return None


def _register_fakes() -> None:
    """Meta/fake kernels: the copy ops only mutate an argument and return nothing."""

    @torch.library.register_fake("kvpack::gather_blocks")
    def _gather_fake(tensors, ptr_table, block_ids, out, geometry, ptr_align, stream) -> None:  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("kvpack::scatter_blocks")
    def _scatter_fake(tensors, ptr_table, block_ids, src, geometry, ptr_align, stream) -> None:  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("kvpack::canonical_copy")
    def _canonical_fake(tensors, ptr_table, block_ids, staging, geometry, ptr_align, stream, gather) -> None:  # type: ignore[no-untyped-def]
        return None


def _build_flavour(src: Path, with_cuda: bool, note: str) -> tuple[ExtensionStatus, Any]:
    """Builds (or loads the cached) extension with or without the CUDA kernel."""
    from torch.utils import cpp_extension

    sources = _SOURCES_CPU + (_SOURCES_CUDA if with_cuda else ())
    digest = hashlib.sha256()
    for f in sorted(sources + _HEADERS):
        if (src / f).is_file():
            digest.update(f.encode() + b"\0" + (src / f).read_bytes())
    digest.update(torch.__version__.encode())
    flavour = "cuda" if with_cuda else "cpu"
    name = f"kvpack_ops_{flavour}_{digest.hexdigest()[:12]}"
    build_dir = _cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    cflags = ["-O3", "-fopenmp", "-std=c++17"] + (["-DKVPACK_WITH_CUDA"] if with_cuda else [])
    prebuilt = (build_dir / f"{name}.so").is_file()
    if not prebuilt:
        logger.info("kvpack.ops: building block-copy kernels (%s) in %s ...", flavour, build_dir)
    t0 = time.monotonic()
    module = cpp_extension.load(
        name=name,
        sources=[str(src / f) for f in sources],
        extra_cflags=cflags,
        extra_cuda_cflags=["-O3", "-std=c++17"],
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(src)],
        build_directory=str(build_dir),
        is_python_module=True,
        with_cuda=with_cuda,
        verbose=False,
    )
    _register_fakes()
    has_cuda = bool(torch.ops.kvpack.has_cuda())
    how = "loaded cached" if prebuilt else f"built in {time.monotonic() - t0:.1f}s"
    simd = CpuSimd(int(torch.ops.kvpack.cpu_simd())).name.lower()
    reason = f"{how} ({flavour}; CPU canonical copy: {simd}{'' if with_cuda else '; CUDA kernel not built: ' + note})"
    return ExtensionStatus(True, has_cuda, reason, str(build_dir)), module


def _build() -> tuple[ExtensionStatus, Any]:
    src = csrc_dir()
    if src is None:
        return ExtensionStatus(False, False, "kernel sources (csrc/) not found"), None
    missing = _compiler_missing()
    if missing is not None:
        return ExtensionStatus(False, False, missing), None
    with_cuda, cuda_why = cuda_build_possible()
    if with_cuda:
        try:
            return _build_flavour(src, True, "")
        except Exception as e:  # e.g. nvcc/torch CUDA version mismatch: keep the CPU kernel
            cuda_why = f"CUDA build failed: {type(e).__name__}: {str(e)[-2000:]}"
            logger.warning("kvpack.ops: %s; building the CPU kernel only", cuda_why)
    return _build_flavour(src, False, cuda_why)


def load_extension() -> ExtensionStatus:
    """Builds/loads the extension once per process; never raises. Thread safe."""
    global _status, _module
    with _lock:
        if _status is None:
            try:
                _status, _module = _build()
            except Exception as e:  # a failed build must never break the engine
                _status = ExtensionStatus(False, False, f"build failed: {type(e).__name__}: {e}")
            if _status.available:
                logger.info("kvpack.ops: block-copy kernels %s", _status.reason)
            else:
                logger.warning("kvpack.ops: using the pure-torch block copy fallback (%s)", _status.reason)
        return _status


def region_copier() -> RegionCopier | None:
    """The native region copy if the extension is loaded now, else None. Never waits."""
    module = _module
    return None if module is None else module.copy_regions
