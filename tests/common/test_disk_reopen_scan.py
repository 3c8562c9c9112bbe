"""A reopen's folder scan reads only the files the index cannot vouch for: an indexed file
unchanged since its row became ready is not opened; a file rewritten, truncated or replaced
since is read again, and a bad one is unindexed (a miss, never a load of wrong bytes)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers import chunk_id, expect, make_item

from kvpack.tiers.base import PutItem, TierStatus
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.disk import scan as disk_index

HOUR_NS = 3600 * 10**9


def _disk(root: Path) -> DiskTier:
    return DiskTier(root, 1 << 30)


def _age(path: Path) -> None:
    """Set the file's times an hour back: written well before its row became ready."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns - HOUR_NS, st.st_mtime_ns - HOUR_NS))


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    real = disk_index._check_file

    def counting(root_fd, key, rel, counters, refuse):  # type: ignore[no-untyped-def]
        reads.append(rel)
        return real(root_fd, key, rel, counters, refuse)

    monkeypatch.setattr(disk_index, "_check_file", counting)
    return reads


def _store(tmp_path: Path, n: int) -> tuple[DiskTier, list[tuple[PutItem, np.ndarray]]]:
    tier = _disk(tmp_path)
    made = [make_item("t", chunk_id(i), seed=i) for i in range(n)]
    assert tier.put_from([item for item, _ in made]) == [TierStatus.OK] * n
    tier.close()
    for item, _ in made:
        _age(tier.path_of(item.key))
    return tier, made


def test_a_reopen_reads_no_header_of_an_unchanged_indexed_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier, made = _store(tmp_path, 6)
    reads = _count_reads(monkeypatch)
    reopened = _disk(tmp_path)
    assert reopened.wait_indexed(30)
    assert reads == []
    assert reopened.contains([item.key for item, _ in made]) == [True] * 6
    item, data = made[0]
    dst = np.empty(len(data), np.uint8)
    assert reopened.get_into([item.key], [dst.data], [expect(item)], True)[0].ok
    assert bytes(dst) == bytes(data)
    reopened.close()


def test_a_file_rewritten_or_truncated_since_it_was_indexed_is_read_again_and_unindexed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, made = _store(tmp_path, 4)
    rewritten, truncated, aged_truncated = (tier.path_of(made[i][0].key) for i in (1, 2, 3))
    size = rewritten.stat().st_size
    rewritten.write_bytes(b"\0" * size)  # same size, new mtime: a torn or foreign rewrite
    truncated.write_bytes(truncated.read_bytes()[: size - 100])
    aged_truncated.write_bytes(aged_truncated.read_bytes()[: size - 100])
    _age(aged_truncated)  # an old mtime, but not the size a header plus the row's payload makes
    reads = _count_reads(monkeypatch)
    reopened = _disk(tmp_path)
    assert reopened.wait_indexed(30)
    assert sorted(reads) == sorted(str(p.relative_to(tmp_path)) for p in (rewritten, truncated, aged_truncated))
    assert reopened.counters.startup_rejected == 3
    assert reopened.contains([item.key for item, _ in made]) == [True, False, False, False]
    reopened.close()


def test_a_symlink_put_where_an_indexed_file_was_is_read_again_and_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, made = _store(tmp_path, 2)
    target = tier.path_of(made[1][0].key)
    elsewhere = tmp_path.parent / f"{tmp_path.name}-copy.kvp"
    elsewhere.write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to(elsewhere)
    reopened = _disk(tmp_path)
    assert reopened.wait_indexed(30)
    assert reopened.counters.refused_unsafe >= 1  # the scan opened it (no lstat shortcut) and refused it
    item, data = made[1]
    dst = np.empty(len(data), np.uint8)
    got = reopened.get_into([item.key], [dst.data], [expect(item)], True)[0]
    assert not got.ok and got.status is TierStatus.REJECTED  # never followed, never loaded
    assert elsewhere.exists() and target.is_symlink()
    reopened.close()
