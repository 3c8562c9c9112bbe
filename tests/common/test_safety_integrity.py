"""Issue 15: with an integrity key, whoever can write the store (but has not the
key) cannot forge an object; without one, a forged payload with a recomputed
xxh3 loads (the negative control: the key is what catches it)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import chunk_id, expect, make_item

from kvpack.config.schema import KVPackConfig
from kvpack.identity.objects import ObjectHeader, RejectReason, payload_checksum
from kvpack.store import KVStore, LoadItem
from kvpack.tiers.base import PutItem, TierStatus
from kvpack.tiers.disk import DiskTier, data_offset

KEY = "a7" * 32


def _store(tmp_path: Path, key: str = KEY, **extra: object) -> KVStore:
    data: dict = {"memory": {"enabled": False}, "disk": {"path": str(tmp_path / "disk")}, **extra}
    if key:
        data["integrity_key"] = key
    return KVStore.from_config(KVPackConfig.from_dict(data))


def _forge(disk: DiskTier, item: PutItem, payload: np.ndarray, header: ObjectHeader | None = None) -> None:
    """Rewrite the object's file as a store writer without the key could: new payload, fresh xxh3."""
    header = header or replace(item.header, checksum=payload_checksum(payload))
    raw = header.encode()
    disk.path_of(item.key).write_bytes(raw.ljust(data_offset(len(raw)), b"\0") + payload.tobytes())


def _load(store: KVStore, item: PutItem) -> tuple[TierStatus, RejectReason | None, np.ndarray]:
    dst = np.empty(item.header.payload_len, np.uint8)
    res = store.load([LoadItem(item.key, memoryview(dst), expect(item))])[0]
    return res.status, res.reason, dst


@pytest.mark.parametrize("keyed", [True, False])
def test_forged_payload_with_recomputed_xxh3(tmp_path: Path, keyed: bool) -> None:
    store = _store(tmp_path, KEY if keyed else "")
    item, payload = make_item("bob", chunk_id(1))
    assert store.store([item]) == [TierStatus.OK]
    status, _, dst = _load(store, item)
    assert status is TierStatus.OK and np.array_equal(dst, payload)
    disk = store.tiers[0]
    assert isinstance(disk, DiskTier)
    forged = np.full_like(payload, 0x41)
    _forge(disk, item, forged)
    status, reason, dst = _load(store, item)
    if keyed:
        assert status is TierStatus.REJECTED and reason is RejectReason.INTEGRITY
        assert store.metrics.value("rejected_objects", reason="integrity") == 1
    else:  # without the key nothing can tell: this is what the key is for
        assert status is TierStatus.OK and np.array_equal(dst, forged)
    store.close()


def test_forged_header_fields_are_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    item, payload = make_item("bob", chunk_id(1), token_ids=tuple(range(16)))
    store.store([item])
    disk = store.tiers[0]
    assert isinstance(disk, DiskTier)
    stored = disk.peek_headers([item.key])[0]
    assert stored is not None
    _forge(disk, item, payload, replace(stored, token_ids=tuple(range(1, 17))))  # same MAC, other token ids
    item2 = replace(item, header=replace(item.header, token_ids=tuple(range(1, 17))))
    status, reason, _ = _load(store, item2)
    assert status is TierStatus.REJECTED and reason is RejectReason.INTEGRITY
    store.close()


def test_another_key_and_unkeyed_objects_are_refused(tmp_path: Path) -> None:
    item, _ = make_item("bob", chunk_id(1))
    writer = _store(tmp_path, "b8" * 32)
    writer.store([item])
    writer.close()
    reader = _store(tmp_path)
    assert _load(reader, item)[:2] == (TierStatus.REJECTED, RejectReason.INTEGRITY)
    reader.close()
    plain, _ = make_item("bob", chunk_id(2))
    unkeyed = _store(tmp_path, "")
    unkeyed.store([plain])
    unkeyed.close()
    reader = _store(tmp_path)
    assert _load(reader, plain)[:2] == (TierStatus.REJECTED, RejectReason.INTEGRITY)
    reader.close()


def test_write_back_through_memory_is_sealed_and_promoted_objects_check(tmp_path: Path) -> None:
    config = {
        "memory": {"capacity": "1MiB"},
        "disk": {"path": str(tmp_path / "disk")},
        "integrity_key": KEY,
        "checksum": "always",
    }
    store = KVStore.from_config(KVPackConfig.from_dict(config))
    item, payload = make_item("bob", chunk_id(1), checksum=False)
    assert store.store([item]) == [TierStatus.OK]
    assert store.flush(10)
    store.close()
    again = KVStore.from_config(KVPackConfig.from_dict(config))
    for _ in range(2):  # from disk (promoted into memory), then from memory (carrying the MAC)
        status, _, dst = _load(again, item)
        assert status is TierStatus.OK and np.array_equal(dst, payload)
    again.close()
