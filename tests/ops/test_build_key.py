"""The extension's build key, the nvcc/torch CUDA check, the smoke launch and stale build
locks, with fakes of nvcc and torch versions (no GPU needed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from kvpack.ops import _build
from kvpack.ops._build import (
    STALE_LOCK_S,
    BuildKey,
    clear_stale_lock,
    cuda_arch_list,
    cuda_major_mismatch,
    parse_nvcc_version,
    smoke_launch,
)

NVCC_13 = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Cuda compilation tools, release 13.0, V13.0.48
Build cuda_13.0.r13.0/compiler.36260728_0"""


def test_nvcc_version_is_read_from_its_banner() -> None:
    assert parse_nvcc_version(NVCC_13) == "13.0"
    assert parse_nvcc_version("Cuda compilation tools, release 12.4, V12.4.131") == "12.4"
    assert parse_nvcc_version("not nvcc") is None


def test_a_major_mismatch_between_nvcc_and_torch_cuda_is_refused() -> None:
    assert cuda_major_mismatch("12.4", "13.0") is not None
    assert "12.4" in str(cuda_major_mismatch("12.4", "13.0"))
    assert cuda_major_mismatch("13.0", "13.1") is None
    assert cuda_major_mismatch(None, "13.0") is None


def test_the_build_key_changes_with_arch_nvcc_and_torch_cuda() -> None:
    base = BuildKey("abc", "2.11.0", "cuda", "9.0", "13.0", "13.0")
    others = [
        BuildKey("abc", "2.11.0", "cuda", "8.0", "13.0", "13.0"),
        BuildKey("abc", "2.11.0", "cuda", "9.0", "13.1", "13.0"),
        BuildKey("abc", "2.11.0", "cuda", "9.0", "13.0", "13.1"),
        BuildKey("abc", "2.12.0", "cuda", "9.0", "13.0", "13.0"),
        BuildKey("abd", "2.11.0", "cuda", "9.0", "13.0", "13.0"),
        BuildKey("abc", "2.11.0", "cuda", "9.0", "13.0", "13.0", torch_path="/venvs/other/torch"),
    ]
    names = {base.name(), *(k.name() for k in others)}
    assert len(names) == 1 + len(others)
    assert base.name() == BuildKey("abc", "2.11.0", "cuda", "9.0", "13.0", "13.0").name()
    assert base.name().startswith("kvpack_ops_cuda_")


def test_the_arch_list_follows_torch_cuda_arch_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    assert cuda_arch_list() == "8.0;9.0+PTX"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [(9, 0), (8, 6)][i])
    assert cuda_arch_list() == "8.6;9.0"


def test_a_mismatched_nvcc_means_no_cuda_build_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_build, "_nvcc_path", lambda: "/fake/nvcc")
    monkeypatch.setattr(_build, "nvcc_version", lambda: "12.8")
    ok, why = _build.cuda_build_possible()
    assert not ok and "12.8" in why and "13.0" in why
    monkeypatch.setattr(_build, "nvcc_version", lambda: "13.0")
    assert _build.cuda_build_possible()[0]


def _lock(tmp_path: Path, age_s: float, owner: int | None) -> Path:
    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - age_s
    os.utime(lock, (old, old))
    if owner is not None:
        (tmp_path / "kvpack.owner").write_text(str(owner))
    return lock


def test_a_stale_lock_of_a_gone_owner_is_removed(tmp_path: Path) -> None:
    lock = _lock(tmp_path, STALE_LOCK_S + 60, owner=4242)
    assert clear_stale_lock(tmp_path, alive=lambda pid: False)
    assert not lock.exists()


def test_a_lock_whose_owner_lives_or_that_is_young_stays(tmp_path: Path) -> None:
    lock = _lock(tmp_path, STALE_LOCK_S + 60, owner=4242)
    assert not clear_stale_lock(tmp_path, alive=lambda pid: pid == 4242)
    assert lock.exists()
    lock = _lock(tmp_path, 5, owner=None)
    assert not clear_stale_lock(tmp_path, alive=lambda pid: False)
    assert lock.exists()
    lock.unlink()
    assert not clear_stale_lock(tmp_path)


def test_a_stale_lock_without_an_owner_file_is_removed(tmp_path: Path) -> None:
    lock = _lock(tmp_path, STALE_LOCK_S + 60, owner=None)
    assert clear_stale_lock(tmp_path)
    assert not lock.exists()


def test_the_smoke_launch_passes_on_a_working_kernel_and_reports_a_failing_one(monkeypatch: pytest.MonkeyPatch) -> None:
    if not _build.load_extension().available:
        pytest.skip("no compiler: no kernel to launch")
    assert smoke_launch("cpu") is None

    def broken(*args: object) -> None:
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(torch.ops.kvpack, "gather_blocks", broken)
    failed = smoke_launch("cpu")
    assert failed is not None and "no kernel image" in failed


def test_no_std_flag_overrides_torchs_cpp_standard() -> None:
    src = Path(_build.__file__).read_text()
    assert "-std=c++17" not in src
