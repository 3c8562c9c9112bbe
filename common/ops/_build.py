"""JIT build and load of the csrc/ kernels as torch custom ops (``torch.ops.kvpack``).

Built on first use with torch.utils.cpp_extension (ninja) into a per-user cache
(``$XDG_CACHE_HOME/kvpack/ext`` or ``~/.cache/kvpack/ext``), one folder per `BuildKey`
(source hash, torch version, flavour; for CUDA also the arch list, nvcc's version and
torch's CUDA version), so a second process (or a second venv, another GPU) reuses or
rebuilds it safely. The CUDA kernel is compiled in only where torch has CUDA, a
GPU is visible, nvcc exists and its major version is torch's (else the torch path
runs, and says why); once loaded, a one-block smoke launch must give the reference
bytes, or the CUDA kernel is not used. A build lock left by a killed build (older
than `STALE_LOCK_S`, its owner process gone) is removed. torch picks the C++
standard. The build is logged once; when no compiler (or ninja) is found, or the
build fails, the pure-torch fallback runs and that is logged once (with the
reason). The only module state is the lock-protected handle below (the status and the extension's Python module).

`region_copier()` never waits: it is the native region copy once the
extension is loaded (by `load_extension`, which an adapter calls at start-up),
else None, and callers copy with numpy; `object_writer()` likewise hands the
disk and host tiers the native batch file write (else they write from Python).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from . import natives
from ._reference import gather_reference
from .paged import PagedKV
from .simd import CpuSimd

logger = logging.getLogger("kvpack.ops")


_SOURCES_CPU = (
    "bindings.cpp",
    "block_copy_cpu.cpp",
    "canonical_copy_cpu.cpp",
    "checksum_cpu.cpp",
    "object_read_cpu.cpp",
    "object_write_cpu.cpp",
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
    "checksum_cpu.h",
    "object_files.h",
    "object_read_cpu.h",
    "object_write_cpu.h",
    "region_copy_cpu.h",
    "transpose_sse2.h",
    "transpose_avx512.h",
    "xxhash.h",
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


STALE_LOCK_S = 600.0
"""A build lock older than this whose owner process is gone was left by a killed build."""


def _nvcc_path() -> str | None:
    from torch.utils import cpp_extension

    nvcc = Path(cpp_extension.CUDA_HOME or "", "bin", "nvcc") if cpp_extension.CUDA_HOME else None
    if nvcc and nvcc.is_file():
        return str(nvcc)
    return shutil.which("nvcc")


def parse_nvcc_version(text: str) -> str | None:
    """``"13.0"`` from ``nvcc --version``'s ``... release 13.0, V13.0.48``; None if absent."""
    m = re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if m else None


def nvcc_version() -> str | None:
    nvcc = _nvcc_path()
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvcc_version(out)


def cuda_major_mismatch(nvcc: str | None, torch_cuda: str | None) -> str | None:
    """Why nvcc `nvcc` cannot build for a torch built with CUDA `torch_cuda` (majors differ)."""
    if nvcc is None or torch_cuda is None:
        return None
    if nvcc.split(".")[0] != torch_cuda.split(".")[0]:
        return f"nvcc {nvcc} and torch's CUDA {torch_cuda} differ in major version"
    return None


def cuda_arch_list() -> str:
    """The archs the CUDA kernel is built for: ``TORCH_CUDA_ARCH_LIST`` (what torch builds
    for), else every visible device's capability (``8.0;9.0``)."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env.strip()
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{a}.{b}" for a, b in caps)


@dataclass(frozen=True)
class BuildKey:
    """What a cached extension was built from: a different value is a different folder."""

    sources: str
    torch_version: str
    flavour: str
    arch: str = ""
    nvcc: str = ""
    torch_cuda: str = ""
    torch_path: str = ""
    """The torch installation compiled against (its folder): two venvs with the same torch
    version write different include and library paths into the build file, so sharing a
    folder made ninja rebuild (a full compile inside an engine's start-up) whenever the
    other venv had built last."""

    def name(self) -> str:
        digest = hashlib.sha256(self.sources.encode())
        for part in (self.torch_version, self.arch, self.nvcc, self.torch_cuda, self.torch_path):
            digest.update(b"\0" + part.encode())
        return f"kvpack_ops_{self.flavour}_{digest.hexdigest()[:12]}"


def cuda_build_possible() -> tuple[bool, str]:
    """Whether the CUDA kernel can be built here, and why not."""
    if torch.version.cuda is None:
        return False, "torch has no CUDA"
    if not torch.cuda.is_available():
        return False, "no CUDA device visible"
    if _nvcc_path() is None:
        return False, "nvcc not found"
    mismatch = cuda_major_mismatch(nvcc_version(), torch.version.cuda)
    if mismatch is not None:
        logger.warning("kvpack.ops: %s; the CUDA kernel is not built, GPU caches use the torch copy", mismatch)
        return False, mismatch
    return True, "CUDA torch, a device and nvcc"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_stale_lock(build_dir: Path, now: float | None = None, alive: Callable[[int], bool] = _pid_alive) -> bool:
    """Remove torch's build lock (``build_dir/lock``) when a killed build left it: older
    than `STALE_LOCK_S` and its owner (``kvpack.owner``, written by `_build_flavour`) not
    alive, or no owner recorded. Returns whether it was removed."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    try:
        owner = int((build_dir / "kvpack.owner").read_text().strip())
    except (OSError, ValueError):
        owner = None
    if owner is not None and alive(owner):
        return False
    lock.unlink(missing_ok=True)
    logger.warning("kvpack.ops: removed a stale build lock %s (%.0f s old, owner %s gone)", lock, age, owner)
    return True


def smoke_launch(device: str = "cuda") -> str | None:
    """One block gathered by the kernel on `device` against the torch reference; the
    failure, or None. (On "cpu" it checks the C++ kernel: what a test can run.)"""

    try:
        cache = torch.arange(2 * 3 * 4 * 2 * 8, dtype=torch.float16, device=device).view(2, 3, 4, 2, 8)
        kv = PagedKV.from_layers([cache])
        out = torch.zeros(kv.layout.slot_bytes, dtype=torch.uint8, device=device)
        want = torch.zeros_like(out)
        ids = torch.tensor([1], dtype=torch.int64, device=device)
        geometry = kv.layout.kernel_geometry(1, 0, kv.layout.tokens_per_block)
        torch.ops.kvpack.gather_blocks([cache], kv.pointer_table(), ids, out, geometry, 16, 0)
        gather_reference(kv, [1], want, 0, kv.layout.tokens_per_block)
        if device != "cpu":
            torch.cuda.synchronize()
        if not torch.equal(out, want):
            return f"the {device} kernel's smoke launch gave other bytes than the torch reference"
    except Exception as e:  # "no kernel image", a launch failure: the torch path runs
        return f"the {device} kernel's smoke launch failed: {type(e).__name__}: {str(e)[:300]}"
    return None


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
    def _gather_fake(tensors, ptr_table, block_ids, out, geometry, ptr_align, stream) -> None:
        return None

    @torch.library.register_fake("kvpack::scatter_blocks")
    def _scatter_fake(tensors, ptr_table, block_ids, src, geometry, ptr_align, stream) -> None:
        return None

    @torch.library.register_fake("kvpack::canonical_copy")
    def _canonical_fake(tensors, ptr_table, block_ids, staging, geometry, ptr_align, stream, gather) -> None:
        return None


def _build_flavour(src: Path, with_cuda: bool, note: str) -> tuple[ExtensionStatus, Any]:
    """Builds (or loads the cached) extension with or without the CUDA kernel."""
    from torch.utils import cpp_extension

    sources = _SOURCES_CPU + (_SOURCES_CUDA if with_cuda else ())
    digest = hashlib.sha256()
    for f in sorted(sources + _HEADERS):
        if (src / f).is_file():
            digest.update(f.encode() + b"\0" + (src / f).read_bytes())
    flavour = "cuda" if with_cuda else "cpu"
    torch_path = os.path.dirname(os.path.realpath(torch.__file__))
    key = BuildKey(digest.hexdigest(), torch.__version__, flavour, torch_path=torch_path)
    if with_cuda:
        key = replace(key, arch=cuda_arch_list(), nvcc=nvcc_version() or "", torch_cuda=torch.version.cuda or "")
    name = key.name()
    build_dir = _cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build_dir)
    (build_dir / "kvpack.owner").write_text(str(os.getpid()))
    # no -std flag: torch's cpp_extension passes the standard its headers need (C++17 or 20)
    cflags = ["-O3", "-fopenmp"] + (["-DKVPACK_WITH_CUDA"] if with_cuda else [])
    prebuilt = (build_dir / f"{name}.so").is_file()
    if not prebuilt:
        logger.info("kvpack.ops: building block-copy kernels (%s) in %s ...", flavour, build_dir)
    t0 = time.monotonic()
    module = cpp_extension.load(
        name=name,
        sources=[str(src / f) for f in sources],
        extra_cflags=cflags,
        extra_cuda_cflags=["-O3"],
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(src)],
        build_directory=str(build_dir),
        is_python_module=True,
        with_cuda=with_cuda,
        verbose=False,
    )
    _register_fakes()
    has_cuda = bool(torch.ops.kvpack.has_cuda())
    if has_cuda:
        failed = smoke_launch()
        if failed is not None:
            logger.warning("kvpack.ops: %s; GPU caches use the torch copy", failed)
            has_cuda, note = False, failed
    how = "loaded cached" if prebuilt else f"built in {time.monotonic() - t0:.1f}s"
    simd = CpuSimd(int(torch.ops.kvpack.cpu_simd())).name.lower()
    reason = f"{how} ({flavour}; CPU canonical copy: {simd}{'' if has_cuda else '; no CUDA kernel: ' + note})"
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
    global _status
    with _lock:
        if _status is None:
            try:
                _status, module = _build()
                if module is not None:
                    natives.loaded(module)
            except Exception as e:  # a failed build must never break the engine
                _status = ExtensionStatus(False, False, f"build failed: {type(e).__name__}: {e}")
            if _status.available:
                logger.info("kvpack.ops: block-copy kernels %s", _status.reason)
            else:
                logger.warning("kvpack.ops: using the pure-torch block copy fallback (%s)", _status.reason)
        return _status
