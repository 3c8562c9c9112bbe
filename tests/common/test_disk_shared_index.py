"""The disk tier's shared, persistent index: one capacity authority per folder across real
processes, no start-up wait on a store that is not indexed yet, older stores opened or refused."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import chunk_id, expect, make_item

from fixtures.scan_pace import pace_scan
from fixtures.warm_start import KVPACK_MODULES, warm_starts
from kvpack.errors import ConfigError
from kvpack.operate.inspect_store import summarize
from kvpack.tiers.base import PutItem, TierStatus
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.disk.fs import MARKER
from kvpack.tiers.index.catalog import INDEX_NAME

KIB = 1024
TESTS = Path(__file__).resolve().parents[1]

_WRITER = """
import sys
sys.path.insert(0, {tests!r})
from fixtures.builders import chunk_id, make_item
from kvpack.config.schema import EvictionPolicyName
from kvpack.policy.eviction import make_policy
from kvpack.tiers.disk import DiskTier
root, capacity, proc, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tier = DiskTier(root, capacity, io_threads=2)
for lo in range(0, count, 8):
    ids = [proc * 100000 + i for i in range(lo, min(count, lo + 8))]
    tier.put_from([make_item("t", chunk_id(i), seed=i)[0] for i in ids])
tier.close()
"""


def _disk(root: Path, capacity: int = 1 << 30, **kw: object) -> DiskTier:
    return DiskTier(root, capacity, **kw)  # type: ignore[arg-type]


def _drop_index(root: Path) -> None:
    """Make `root` look like a store written before the persistent index (format 1 files only)."""
    for p in root.iterdir():
        if p.name.startswith(INDEX_NAME):
            p.unlink()


def test_three_processes_share_one_capacity_and_every_load_is_exact_or_a_miss(tmp_path: Path) -> None:
    root, capacity, per_proc = tmp_path / "store", 64 * KIB, 192  # each process writes 3C
    _disk(root, capacity).close()
    code = _WRITER.format(tests=str(TESTS))
    procs = [  # forked from a process that imported torch (kvpack's native I/O)
        warm_starts().start_script(
            sys.executable, ["-c", code, str(root), str(capacity), str(p), str(per_proc)], dict(os.environ),
            None, None, modules=KVPACK_MODULES,
        )
        for p in range(3)
    ]  # fmt: skip
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    held = sum(t.payload_bytes for t in summarize(root).tenants.values())
    assert held <= 1.1 * capacity
    reader = _disk(root, capacity)
    assert reader.usage().used_bytes <= capacity
    hits = 0
    for p in range(3):
        for i in range(per_proc):
            item, payload = make_item("t", chunk_id(p * 100000 + i), seed=p * 100000 + i)
            dst = np.zeros(KIB, np.uint8)
            res = reader.get_into([item.key], [memoryview(dst)], [expect(item)], True)[0]
            if res.ok:
                hits += 1
                assert np.array_equal(dst, payload)
            else:
                assert res.status is TierStatus.MISS
    assert 0.5 * capacity / KIB <= hits <= 1.1 * capacity / KIB


def test_a_store_without_an_index_answers_before_its_index_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = _disk(tmp_path)
    items = [make_item("t", chunk_id(i), seed=i) for i in range(300)]
    assert writer.put_from([it for it, _ in items]) == [TierStatus.OK] * 300
    writer.close()
    _drop_index(tmp_path)
    gate, paced = threading.Event(), threading.Event()

    def pace() -> None:  # the scan stops after its first leaf folder until the test lets it go
        paced.set()
        gate.wait(30)

    pace_scan(monkeypatch, pace)
    opened = _disk(tmp_path, open_scan_s=0.05)
    try:
        assert paced.wait(10) and not opened.index_complete()
        keys = [it.key for it, _ in items]
        assert opened.contains(keys) == [True] * 300  # answered from the folder
        assert opened.contains([make_item("t", chunk_id(5000))[0].key]) == [False]
        item, payload = items[123]
        dst = np.zeros(KIB, np.uint8)
        assert opened.get_into([item.key], [memoryview(dst)], [expect(item)], True)[0].ok
        assert np.array_equal(dst, payload)
        assert opened.put_from([make_item("t", chunk_id(4000), seed=4000)[0]]) == [TierStatus.OK]
    finally:
        gate.set()
    assert opened.wait_indexed(30)
    assert opened.usage().objects == 301 and opened.usage().used_bytes == 301 * KIB
    assert _disk(tmp_path).contains([it.key for it, _ in items]) == [True] * 300


def test_a_second_process_waits_for_no_scan_while_another_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = _disk(tmp_path)
    items = [make_item("t", chunk_id(i), seed=i)[0] for i in range(50)]
    writer.put_from(items)
    writer.close()
    _drop_index(tmp_path)
    gate = threading.Event()
    pace_scan(monkeypatch, lambda: gate.wait(30))
    builder = _disk(tmp_path, open_scan_s=0.01)
    try:
        other = _disk(tmp_path, open_scan_s=5.0)  # the build lock is held: it does not scan, nor wait
        assert not other.index_complete()
        assert other.contains([it.key for it in items]) == [True] * 50
    finally:
        gate.set()
    assert builder.wait_indexed(30)
    assert other.wait_indexed(0) and other.usage().objects == 50
    assert summarize(tmp_path).indexed


def test_a_crashed_writers_file_is_indexed_and_a_damaged_one_unindexed_on_reopen(tmp_path: Path) -> None:
    tier = _disk(tmp_path)
    a, b = make_item("t", chunk_id(1), seed=1)[0], make_item("t", chunk_id(2), seed=2)[0]
    tier.put_from([a, b])
    tier.close()
    # a file written whose row was lost (another store's file copied in), and a damaged one
    orphan, _ = make_item("t", chunk_id(3), seed=3)
    other = _disk(tmp_path / "other")
    other.put_from([orphan])
    os.makedirs(tier.path_of(orphan.key).parent, exist_ok=True)
    tier.path_of(orphan.key).write_bytes(other.path_of(orphan.key).read_bytes())
    tier.path_of(b.key).write_bytes(b"garbage")
    reopened = _disk(tmp_path)
    assert reopened.counters.startup_rejected == 1
    assert reopened.contains([a.key, b.key, orphan.key]) == [True, False, True]
    assert reopened.usage().used_bytes == 2 * KIB


def test_an_index_of_another_schema_is_rebuilt_never_misread(tmp_path: Path) -> None:
    import sqlite3

    tier = _disk(tmp_path)
    item, _ = make_item("t", chunk_id(1), seed=1)
    tier.put_from([item])
    tier.close()
    db = sqlite3.connect(tmp_path / INDEX_NAME)
    db.execute("UPDATE meta SET v='0' WHERE k='schema'")
    db.execute("UPDATE tenants SET used=123456789")
    db.commit()
    db.close()
    reopened = _disk(tmp_path)
    assert reopened.wait_indexed(30)
    assert reopened.usage().used_bytes == KIB and reopened.contains([item.key]) == [True]


def test_a_store_of_another_format_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text("kvpack store\nformat 0\n")
    with pytest.raises(ConfigError) as err:
        _disk(tmp_path)
    assert err.value.field == "disk.path" and "another format" in str(err.value)


def test_a_symlinked_or_unreadable_index_is_refused_clearly_and_nothing_is_written_there(tmp_path: Path) -> None:
    root, outside = tmp_path / "store", tmp_path / "precious.db"
    _disk(root).close()
    _drop_index(root)
    outside.write_bytes(b"not yours")
    (root / INDEX_NAME).symlink_to(outside)
    with pytest.raises(ConfigError) as err:
        _disk(root)
    assert err.value.field == "disk.path" and "not a regular file" in str(err.value)
    assert outside.read_bytes() == b"not yours"
    (root / INDEX_NAME).unlink()
    (root / INDEX_NAME).write_bytes(b"garbage, not SQLite" * 100)
    with pytest.raises(ConfigError) as err:
        _disk(root)
    assert "delete it" in str(err.value)


class _HeldWrite:
    """Holds every file write of the process (kvpack's `write_all`) until `release`: the window
    between a put's index row and its file, as another process in the middle of a put sees it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from kvpack.tiers.disk import writes as disk_mod

        self.entered, self._gate = threading.Event(), threading.Event()
        real = disk_mod.write_all

        def held(fd: int, buffers: list[bytes | memoryview]) -> None:
            self.entered.set()
            self._gate.wait(30)
            real(fd, buffers)

        monkeypatch.setattr(disk_mod, "write_all", held)
        self.statuses: list[list[TierStatus]] = []
        self._thread: threading.Thread | None = None

    def put(self, tier: DiskTier, items: list[PutItem]) -> None:
        self._thread = threading.Thread(target=lambda: self.statuses.append(tier.put_from(items)))
        self._thread.start()
        assert self.entered.wait(10)

    def release(self) -> list[TierStatus]:
        self._gate.set()
        assert self._thread is not None
        self._thread.join(30)
        return self.statuses[0]


def test_an_object_being_written_is_not_found_by_another_process_until_its_file_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = _disk(tmp_path), _disk(tmp_path)
    item, payload = make_item("t", chunk_id(1), seed=1)
    held = _HeldWrite(monkeypatch)
    held.put(writer, [item])
    dst = np.zeros(KIB, np.uint8)
    try:
        assert reader.contains([item.key]) == [False]  # indexed (admitted), its file still to come
        assert reader.usage().used_bytes == KIB  # its bytes are reserved all the same
        assert reader.get_into([item.key], [memoryview(dst)], [expect(item)], True)[0].status is TierStatus.MISS
        assert reader.usage().used_bytes == KIB  # a miss on a write in progress keeps its row
    finally:
        assert held.release() == [TierStatus.OK]
    assert reader.contains([item.key]) == [True]
    assert reader.get_into([item.key], [memoryview(dst)], [expect(item)], True)[0].ok
    assert np.array_equal(dst, payload)


def test_a_miss_on_a_written_object_forgets_it_at_once(tmp_path: Path) -> None:
    writer, reader = _disk(tmp_path), _disk(tmp_path)
    item, _ = make_item("t", chunk_id(1), seed=1)
    assert writer.put_from([item]) == [TierStatus.OK]
    writer.path_of(item.key).unlink()  # removed behind kvpack's back (an operator, a crash)
    dst = memoryview(np.zeros(KIB, np.uint8))
    assert reader.get_into([item.key], [dst], [expect(item)], True)[0].status is TierStatus.MISS
    assert reader.contains([item.key]) == [False] and reader.usage().used_bytes == 0
    assert writer.contains([item.key]) == [False]


def test_a_file_deleted_while_no_process_had_the_store_open_is_not_found_after_reopening(tmp_path: Path) -> None:
    tier = _disk(tmp_path)
    items = [make_item("t", chunk_id(i), seed=i)[0] for i in range(3)]
    items.append(make_item("t", chunk_id(1), member="v", seed=9)[0])  # a second member of group 1
    assert tier.put_from(items) == [TierStatus.OK] * 4
    tier.close()
    tier.path_of(items[1].key).unlink()
    reopened = _disk(tmp_path, open_scan_s=30.0)  # opening waits for the reconcile scan (at most this long)
    assert reopened.contains([it.key for it in items]) == [True, False, True, True]
    usage = reopened.usage()
    assert (usage.used_bytes, usage.objects, usage.groups) == (3 * KIB, 3, 3)
    assert reopened.tenant_used("t") == 3 * KIB


def test_a_crashed_writers_row_is_dropped_by_the_scan_after_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpack.tiers.disk import tier as disk_mod

    writer = _disk(tmp_path)
    kept, _ = make_item("t", chunk_id(2), seed=2)
    assert writer.put_from([kept]) == [TierStatus.OK]
    item, _ = make_item("t", chunk_id(1), seed=1)
    held = _HeldWrite(monkeypatch)
    held.put(writer, [item])  # never ends while the next process opens: as a writer that crashed
    try:
        assert _disk(tmp_path, open_scan_s=30.0).usage().used_bytes == 2 * KIB  # young: a write in progress
        monkeypatch.setattr(disk_mod, "WRITE_GRACE_S", 0.0)
        reopened = _disk(tmp_path, open_scan_s=30.0)
        assert reopened.usage().used_bytes == KIB and reopened.contains([kept.key, item.key]) == [True, False]
    finally:
        statuses = held.release()
    assert statuses == [TierStatus.NO_SPACE]  # its row was dropped meanwhile: the late file is removed again
    assert not writer.path_of(item.key).exists()


def test_a_store_that_arrives_late_never_evicts_a_newer_one(tmp_path: Path) -> None:
    # Recency is when `KVStore.store` accepted an object (`PutItem.accepted_ns`), not when the
    # write-back delivered it: a full folder evicts only less recent groups for a late arrival,
    # and refuses one older than every resident group (in store order it would have gone first).
    tier = DiskTier(tmp_path / "store", 2 * KIB)
    base = 1_000_000  # ns: older than any tick the index takes from the clock
    stamped = [replace(make_item("t", chunk_id(i), seed=i)[0], accepted_ns=base + i) for i in range(4)]
    assert tier.put_from([stamped[2]]) == [TierStatus.OK]  # the newer two arrive first
    assert tier.put_from([stamped[3]]) == [TierStatus.OK]
    assert tier.put_from([stamped[0]]) == [TierStatus.NO_SPACE]  # older than both: refused, nothing evicted
    assert tier.contains([it.key for it in stamped]) == [False, False, True, True]
    late = replace(make_item("t", chunk_id(9), seed=9)[0], accepted_ns=base + 4)  # newer than every resident
    assert tier.put_from([late]) == [TierStatus.OK]
    assert tier.contains([stamped[2].key, stamped[3].key, late.key]) == [False, True, True]
    assert tier.counters.removed == {"evicted": 1}
    tier.close()


def test_close_ends_the_background_index_build_and_nothing_writes_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a process that opens a store and closes it (a script, `kvpack config`) while the folder scan still
    # runs must leave no thread writing the index behind it: the next start scans again instead
    writer = _disk(tmp_path)
    items = [make_item("t", chunk_id(i << 248), seed=i)[0] for i in range(40)]  # 40 leaf folders
    writer.put_from(items)
    writer.close()
    _drop_index(tmp_path)
    scanning = threading.Event()

    def pace() -> None:
        scanning.set()
        threading.Event().wait(0.5)  # a slow folder: the whole build would outlast close's bound many times

    pace_scan(monkeypatch, pace)
    tier = _disk(tmp_path, open_scan_s=0.0)
    assert scanning.wait(30)
    tier.close()
    assert not [t for t in threading.enumerate() if t.name == "kvpack-disk-index" and t.is_alive()]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith(INDEX_NAME)}
    monkeypatch.undo()  # the folder is fast again
    reopened = _disk(tmp_path, open_scan_s=30.0)  # the build starts over and completes
    try:
        assert reopened.wait_indexed(300) and reopened.usage().objects == 40
    finally:
        reopened.close()
    assert before, "the closed build kept what it had indexed"
