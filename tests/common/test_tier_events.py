"""The tier event feed (kvpack.observe.tier_events): what each tier took and let go, bounded, drops counted."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from fixtures.builders import GROUP_FP, chunk_id, make_item
from kvpack import KVPackConfig, KVStore, StoreKey, TierStatus
from kvpack.identity.keys import GroupKey
from kvpack.observe.tier_events import TierEvent, TierEventFeed, TierEventKind
from kvpack.tiers.host import drop

STORED, REMOVED = TierEventKind.STORED, TierEventKind.REMOVED


def _group(i: int, tenant: str = "t") -> str:
    return StoreKey(tenant, GROUP_FP, chunk_id(i), "kv").group.as_str()


def _store(tmp_path: Path, **overrides: object) -> KVStore:
    data: dict = {"disk": {"path": str(tmp_path / "disk")}, "memory": {"capacity": "64MiB"}}
    data.update(overrides)
    return KVStore.from_config(KVPackConfig.from_dict(data))


def test_a_store_without_a_feed_reports_nothing_and_keeps_no_events(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        item, _ = make_item("t", chunk_id(0))
        assert store.store([item]) == [TierStatus.OK]
        assert store.flush(10)
        assert store.events is None
    finally:
        store.close()


def test_every_tier_reports_the_groups_it_took(tmp_path: Path) -> None:
    store = _store(tmp_path)
    try:
        feed = store.tier_events()
        assert store.tier_events() is feed  # idempotent
        items = [make_item("t", chunk_id(i), m, seed=i)[0] for i in range(3) for m in ("kv", "draft")]
        assert store.store(items) == [TierStatus.OK] * len(items)
        assert store.flush(10)
        events = feed.take()
        # one put into memory: one event per group; the write-back puts one object at a time (any order)
        assert [e.group for e in events if e.tier == "memory"] == [_group(i) for i in range(3)]
        assert {e.group for e in events if e.tier == "disk"} == {_group(i) for i in range(3)}
        assert {e.kind for e in events} == {STORED}
        assert feed.take() == []  # drained
    finally:
        store.close()


def test_evictions_and_removals_are_reported_per_tier(tmp_path: Path) -> None:
    # a memory tier of 4 KiB holds 4 objects of 1 KiB: the fifth store evicts the oldest group
    store = _store(tmp_path, memory={"capacity": "4KiB"}, disk={"enabled": False})
    try:
        feed = store.tier_events()
        for i in range(5):
            assert store.store([make_item("t", chunk_id(i), seed=i)[0]]) == [TierStatus.OK]
        events = feed.take()
        removed = [e for e in events if e.kind is REMOVED]
        assert removed == [TierEvent(REMOVED, "memory", _group(0))]
        assert store.contains([StoreKey("t", GROUP_FP, chunk_id(0), "kv")]) == [False]
        store.remove_groups([GroupKey.parse(_group(4))])
        assert feed.take() == [TierEvent(REMOVED, "memory", _group(4))]
    finally:
        store.close()


def test_the_feed_keeps_the_newest_and_counts_what_it_dropped() -> None:
    dropped: list[int] = []
    feed = TierEventFeed(3, dropped.append)
    keys = [StoreKey("t", GROUP_FP, chunk_id(i), "kv") for i in range(5)]
    feed.stored("memory", keys)
    assert len(feed) == 3 and feed.dropped == 2 and dropped == [2]
    feed.removed("memory", [keys[0].group])  # under a tier's lock: counted later, never called back here
    assert dropped == [2]
    events = feed.take()
    assert dropped == [2, 1] and feed.dropped == 3
    assert [e.group for e in events] == [k.group.as_str() for k in keys[3:]] + [keys[0].group.as_str()]


def test_the_host_tier_reports_its_evictions(tmp_path: Path) -> None:
    """The shared host tier (``memory.mode: host``) announces what it took and withdraws what it
    evicted, under its own name (vLLM's KV events: medium CPU, `vllm_plugin.kv_events.MEDIUMS`)."""
    name = f"events-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # an object (header and 1 KiB payload) costs one 4 KiB page of the arena: 16 KiB holds four
    memory = {"mode": "host", "host_name": name, "capacity": "16KiB"}
    store = _store(tmp_path, memory=memory, disk={"enabled": False})
    try:
        assert [t.name for t in store.tiers] == ["host"]
        feed = store.tier_events()
        for i in range(5):
            assert store.store([make_item("t", chunk_id(i), seed=i)[0]]) == [TierStatus.OK]
        assert store.flush(10)
        events = feed.take()
        assert [e.group for e in events if e.kind is STORED and e.tier == "host"] == [_group(i) for i in range(5)]
        assert [e for e in events if e.kind is REMOVED] == [TierEvent(REMOVED, "host", _group(0))]
        assert store.contains([StoreKey("t", GROUP_FP, chunk_id(i), "kv") for i in (0, 4)]) == [False, True]
    finally:
        store.close()
        drop(name)
