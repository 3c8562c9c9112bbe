"""Issue 34: the disk tier writes a batch's object files natively, the GIL released once.

Every test runs with both writers (`kvpack.tiers.disk.writes`): the extension's
``write_objects`` (`kvpack.ops.object_writer`) and the Python fallback a process
without a compiler uses. They must put the same bytes at the same paths, make
missing folders, refuse a symlinked folder (counted, nothing written through it),
and fail one object of a batch without touching the others or leaving a
temporary. The native one makes no Python-level ``writev`` or ``rename``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
from helpers import GROUP_FP, chunk_id, expect, make_item

from fixtures.os_calls import count_os_calls
from kvpack.ops import load_extension, object_writer
from kvpack.ops.natives import NativeJob, ObjectWriter, WriteResult
from kvpack.tiers.base import PutItem, TierStatus
from kvpack.tiers.disk import DiskTier

WRITERS = ("native", "python")
SIZES = (1024, 4096, 5000, (64 << 10) + 3, 300_000)


def _writer(kind: str) -> Callable[[], ObjectWriter | None] | None:
    if kind == "python":
        return None
    status = load_extension()
    if not status.available:
        pytest.skip(f"extension unavailable: {status.reason}")
    assert object_writer() is not None
    return object_writer


def _disk(root: Path, kind: str, io_threads: int = 1) -> DiskTier:
    return DiskTier(root, 1 << 30, io_threads=io_threads, object_writer=_writer(kind))


def _items(tenant: str = "t", first: int = 1) -> list[PutItem]:
    """One item per size, each in its own leaf folder (the chunk's first two hex digits differ)."""
    return [make_item(tenant, _chunk(i, first), nbytes=n, seed=i)[0] for i, n in enumerate(SIZES)]


def _chunk(i: int, first: int) -> str:
    return f"{0x10 * (i + 1):02x}{chunk_id(first)[2:]}"


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".kvpack-store")
    }


def _temps(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*.tmp") if p.is_file()]


@pytest.fixture
def counted_syscalls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Python-level ``os.writev`` and ``os.rename`` calls of the test (counted, then made)."""
    return count_os_calls(monkeypatch, ("writev", "rename"))


@pytest.mark.parametrize("io_threads", [1, 2])
def test_native_files_are_the_python_writers_byte_for_byte(tmp_path: Path, io_threads: int) -> None:
    items = _items()
    py_tier, native_tier = _disk(tmp_path / "py", "python"), _disk(tmp_path / "native", "native", io_threads)
    assert py_tier.put_from(items) == [TierStatus.OK] * len(items)
    assert native_tier.put_from(items) == [TierStatus.OK] * len(items)
    py_files, native_files = _files(tmp_path / "py"), _files(tmp_path / "native")
    assert len(native_files) == len(items) and native_files == py_files
    for item in items:
        dst = np.empty(item.header.payload_len, np.uint8)
        assert native_tier.get_into([item.key], [memoryview(dst)], [expect(item)], True)[0].ok
        assert dst.tobytes() == bytes(item.payload)
    assert native_tier.counters.removed == {} and _temps(tmp_path) == []


@pytest.mark.parametrize("kind", WRITERS)
def test_missing_folders_are_made_again(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "store"
    tier = _disk(root, kind)
    assert tier.put_from(_items(first=1)) == [TierStatus.OK] * len(SIZES)
    for leaf in (root / "t" / GROUP_FP).iterdir():  # every leaf emptied and removed behind kvpack's back
        for f in leaf.iterdir():
            f.unlink()
        leaf.rmdir()
    later = _items(first=2)
    assert tier.put_from(later) == [TierStatus.OK] * len(SIZES)
    assert all(tier.path_of(it.key).is_file() for it in later)


@pytest.mark.parametrize("kind", WRITERS)
def test_a_symlinked_leaf_is_refused_counted_and_never_written_through(tmp_path: Path, kind: str) -> None:
    root, outside = tmp_path / "store", tmp_path / "outside"
    tier = _disk(root, kind)
    items = _items()
    (root / "t" / GROUP_FP).mkdir(parents=True)
    outside.mkdir()
    os.symlink(outside, root / "t" / GROUP_FP / items[1].key.chunk[:2])
    statuses = tier.put_from(items)
    assert statuses == [TierStatus.OK, TierStatus.ERROR] + [TierStatus.OK] * (len(items) - 2)
    assert list(outside.iterdir()) == [] and tier.counters.refused_unsafe == 1
    assert tier.contains([it.key for it in items]) == [s is TierStatus.OK for s in statuses]


@pytest.mark.parametrize("kind", WRITERS)
def test_one_failing_object_fails_alone_and_leaves_no_temporary(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "store"
    tier = _disk(root, kind)
    items = _items()
    (root / "t" / GROUP_FP).mkdir(parents=True)
    (root / "t" / GROUP_FP / items[1].key.chunk[:2]).write_bytes(b"a file where a folder belongs")  # ENOTDIR
    occupied = tier.path_of(items[3].key)  # a non-empty folder at the object's name: the rename fails
    (occupied / "inside").mkdir(parents=True)
    statuses = tier.put_from(items)
    assert statuses == [TierStatus.OK, TierStatus.ERROR, TierStatus.OK, TierStatus.ERROR, TierStatus.OK]
    assert _temps(root) == [] and tier.counters.removed.get("own_temp") == 1  # the rename's temporary
    assert tier.counters.refused_unsafe == 0
    assert tier.contains([it.key for it in items]) == [True, False, True, False, True]


def test_the_native_writer_makes_no_python_file_calls(tmp_path: Path, counted_syscalls: dict[str, int]) -> None:
    native, python = _disk(tmp_path / "native", "native"), _disk(tmp_path / "py", "python")
    counted_syscalls.update(writev=0, rename=0)  # opening wrote each folder's marker
    assert native.put_from(_items()) == [TierStatus.OK] * len(SIZES)
    assert counted_syscalls == {"writev": 0, "rename": 0}
    assert python.put_from(_items()) == [TierStatus.OK] * len(SIZES)  # the check sees the Python writer's calls
    assert counted_syscalls["writev"] >= len(SIZES) and counted_syscalls["rename"] == len(SIZES)


def test_the_native_writer_makes_new_leaf_folders_itself_as_python_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh store's leaves are made inside the native call (from Python each folder is a
    mkdir, an open and a close, each a GIL hand-off): no Python-level mkdir, and the same
    folders with the same modes as the Python writer makes."""
    native, python = _disk(tmp_path / "native", "native"), _disk(tmp_path / "py", "python")
    mkdirs = count_os_calls(monkeypatch, ("mkdir",))
    mkdirs.update(mkdir=0)  # opening the tiers made their roots
    assert native.put_from(_items()) == [TierStatus.OK] * len(SIZES)
    assert mkdirs == {"mkdir": 0}
    assert python.put_from(_items()) == [TierStatus.OK] * len(SIZES)
    assert mkdirs["mkdir"] >= len(SIZES)  # the control: the counter sees the Python writer's folders

    def folders(root: Path) -> dict[str, int]:
        return {str(p.relative_to(root)): p.stat().st_mode for p in sorted(root.rglob("*")) if p.is_dir()}

    assert folders(tmp_path / "native") == folders(tmp_path / "py")
    assert _files(tmp_path / "native") == _files(tmp_path / "py")


def test_without_openat2_the_python_writer_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counted_syscalls: dict[str, int]
) -> None:
    from kvpack.tiers.disk import fs

    tier = _disk(tmp_path / "store", "native")  # the folder is opened with openat2 as usual
    monkeypatch.setattr(fs, "_use_openat2", False)  # then, as after an ENOSYS: fs walks, the native writer is skipped
    counted_syscalls.update(writev=0, rename=0)
    items = _items()
    assert tier.put_from(items) == [TierStatus.OK] * len(items)
    assert counted_syscalls["rename"] == len(items)


def test_an_object_whose_openat2_is_refused_is_written_from_python(
    tmp_path: Path, counted_syscalls: dict[str, int]
) -> None:
    writer = _writer("native")
    native = writer() if writer is not None else None
    assert native is not None

    def refusing(
        root_fd: int, temp_dir_fd: int, jobs: Sequence[NativeJob], fsync: bool, make_leaves: bool
    ) -> list[WriteResult]:
        """The native writer as under a seccomp filter refusing openat2 from the second object on."""
        return [*native(root_fd, temp_dir_fd, jobs[:1], fsync, make_leaves), *[(errno.EPERM, 0)] * (len(jobs) - 1)]

    first = _disk(tmp_path / "store", "native")  # the leaves made first: a retry would reorder the batch
    assert first.put_from(_items(first=2)) == [TierStatus.OK] * len(SIZES)
    first.close()
    tier = DiskTier(tmp_path / "store", 1 << 30, object_writer=lambda: refusing)
    counted_syscalls.update(writev=0, rename=0)
    items = _items()
    assert tier.put_from(items) == [TierStatus.OK] * len(items)
    assert counted_syscalls["rename"] == len(items) - 1  # all but the first written again from Python
    assert {str(tier.path_of(it.key).relative_to(tier.root)) for it in items} <= _files(tmp_path / "store").keys()


@pytest.mark.parametrize("kind", WRITERS)
def test_a_batch_takes_its_temporary_names_from_one_read_of_randomness(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each read of the system's randomness gives the GIL up (in a busy engine process a re-take can
    wait 5 ms): a batch reads once, and its names are distinct and of the pattern the sweep knows."""
    from kvpack.tiers.disk import fs

    tier = _disk(tmp_path / "store", kind)
    reads: list[int] = []
    real = os.urandom

    def counting(n: int) -> bytes:
        reads.append(n)
        return real(n)

    monkeypatch.setattr(os, "urandom", counting)
    items = _items()
    assert tier.put_from(items) == [TierStatus.OK] * len(items)
    assert len(reads) == 1
    names = fs.temp_names(["a.kv.kvp"] * 100)
    assert len(set(names)) == 100 and all(fs.is_temp_name(n) for n in names)
