"""The disk tier's folder layout on the file system: the folders that hold folders are marked
for spread-out placement (ext4 ``FS_TOPDIR_FL``), the object folders are not, and a store is
read the same with or without the mark."""

from __future__ import annotations

import array
import fcntl
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import chunk_id, expect, make_item

from kvpack.tiers.base import TierStatus
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.disk import fs as disk_fs
from kvpack.tiers.disk.fs import spread_subfolders

_FS_IOC_GETFLAGS = 0x80086601
_FS_TOPDIR_FL = 0x00020000


def _topdir(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        return bool(flags[0] & _FS_TOPDIR_FL)
    finally:
        os.close(fd)


def _supports_topdir(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    fd = os.open(probe, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return spread_subfolders(fd) and _topdir(probe)
    finally:
        os.close(fd)


def test_tenant_and_fingerprint_folders_spread_their_subfolders_and_objects_still_load(tmp_path: Path) -> None:
    if not _supports_topdir(tmp_path):
        pytest.skip("this file system has no FS_TOPDIR_FL (not ext2/3/4)")
    root = tmp_path / "store"
    tier = DiskTier(root, 1 << 30)
    item, data = make_item("t", chunk_id(1), seed=1)
    assert tier.put_from([item]) == [TierStatus.OK]
    path = tier.path_of(item.key)
    leaf, fingerprint, tenant = path.parent, path.parent.parent, path.parent.parent.parent
    assert (_topdir(tenant), _topdir(fingerprint), _topdir(leaf)) == (True, True, False)
    dst = np.empty(len(data), np.uint8)
    assert tier.get_into([item.key], [dst.data], [expect(item)], True)[0].ok
    assert bytes(dst) == bytes(data)
    tier.close()


def test_spread_subfolders_is_best_effort_on_a_file(tmp_path: Path) -> None:
    """Where the flag does not apply (here: an fd the ioctl refuses), it answers False and raises nothing."""
    r, w = os.pipe()
    try:
        assert spread_subfolders(r) is False
    finally:
        os.close(r)
        os.close(w)


def test_regression_write_fails_when_an_eviction_removes_its_new_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by test_lookups_only_see_own_entries (a FlakyFailure): two write-back threads on a full
    # folder; one thread's eviction removed the empty tenant folder the other had just created for
    # its write (`_remove_empty_folders`), and that write answered ERROR instead of retrying.
    tier = DiskTier(tmp_path / "store", 1 << 20)
    real_open_subdir = disk_fs._open_subdir
    raced: list[str] = []

    def open_after_cleanup(dfd: int, part: str, rel: str) -> int:
        if part == "t" and not raced:  # the tenant folder make_dirs just created: empty, so a cleanup may take it
            raced.append(part)
            os.rmdir(part, dir_fd=dfd)
        return real_open_subdir(dfd, part, rel)

    monkeypatch.setattr(disk_fs, "_open_subdir", open_after_cleanup)
    item, data = make_item("t", chunk_id(1), seed=1)
    assert tier.put_from([item]) == [TierStatus.OK]
    assert raced == ["t"]
    dst = np.empty(len(data), np.uint8)
    assert tier.get_into([item.key], [dst.data], [expect(item)], True)[0].ok
    assert bytes(dst) == bytes(data)
    tier.close()
