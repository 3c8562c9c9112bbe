"""The sweep of announced groups on a shared tier (kvpack.observe.shared_sweep): the host store and a disk
folder; another process's evictions are withdrawn, a bounded slice per step, once each, counted;
the followed set is bounded; nothing is withdrawn while the disk index is still being built."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures.builders import GROUP_FP, chunk_id, make_item, two_stores
from kvpack import (
    KVPackConfig,
    KVStore,
    Session,
    SharedSweep,
    StoreKey,
    TierStatus,
    shared_tier_sweep,
    shared_tier_sweeps,
)
from kvpack.identity.keys import GroupKey
from kvpack.observe.tier_events import TierEvent, TierEventKind
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.disk.catalog import INDEX_NAME
from kvpack.tiers.host import drop

REMOVED = TierEventKind.REMOVED


def _key(i: int) -> StoreKey:
    return StoreKey("t", GROUP_FP, chunk_id(i), "kv")


def _group(i: int) -> GroupKey:
    return _key(i).group


@pytest.fixture
def two_processes(tmp_path: Path) -> Iterator[tuple[KVStore, KVStore]]:
    """Two stores on one host store (each its own tier and owner, as two processes): 16 KiB
    holds four 1 KiB objects (one 4 KiB page each: header and payload)."""
    name = f"sweep-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    data = {"memory": {"mode": "host", "host_name": name, "capacity": "16KiB"}, "disk": {"enabled": False}}
    try:
        with two_stores(data) as stores:
            yield stores
    finally:
        drop(name)


def _put(store: KVStore, chunks: range) -> None:
    for i in chunks:
        assert store.store([make_item("t", chunk_id(i), seed=i)[0]]) == [TierStatus.OK]


def _evictions_withdrawn_a_slice_per_step_once_each(mine: KVStore, other: KVStore, tier: str) -> SharedSweep:
    """`mine` stores four groups, `other`'s saves evict the two oldest: a sweep of two per step
    withdraws exactly those, in its first step, once, counted under `tier`."""
    sweep = shared_tier_sweep(Session(mine))
    assert sweep is not None and sweep.tier.name == tier
    sweep.per_step = 2
    _put(mine, range(4))
    for i in range(4):
        assert sweep.announced(_group(i)) == []
    assert sweep.sweep() == [] and sweep.sweep() == []  # all four held: nothing withdrawn
    _put(other, range(4, 6))  # the other process's saves evict the two oldest groups
    held = mine.contains([_key(i) for i in range(4)])
    assert held == [False, False, True, True]
    steps = [sweep.sweep() for _ in range(3)]
    # the first step checks the two checked longest ago (0, 1): both gone; the next two find 2, 3 held
    assert steps == [
        [TierEvent(REMOVED, tier, _group(0).as_str()), TierEvent(REMOVED, tier, _group(1).as_str())],
        [],
        [],
    ]
    assert len(sweep) == 2 and sweep.withdrawn == 2
    assert mine.metrics.snapshot()["shared_withdrawals"] == {f"tier={tier}": 2.0}
    return sweep


def test_another_process_evictions_are_withdrawn_a_slice_per_step_once_each(
    two_processes: tuple[KVStore, KVStore],
) -> None:
    _evictions_withdrawn_a_slice_per_step_once_each(*two_processes, "host")


def test_a_group_forgotten_after_an_own_removal_is_never_withdrawn_again(
    two_processes: tuple[KVStore, KVStore],
) -> None:
    mine, other = two_processes
    sweep = shared_tier_sweep(Session(mine))
    assert sweep is not None
    _put(mine, range(2))
    sweep.announced(_group(0))
    sweep.announced(_group(1))
    mine.remove_groups([_group(0)])  # this process's own removal: its adapter withdrew it already
    sweep.forget(_group(0))
    assert [e.group for e in sweep.sweep()] == []
    other.remove_groups([_group(1)])
    assert [e.group for e in sweep.sweep()] == [_group(1).as_str()]
    assert sweep.sweep() == [] and len(sweep) == 0


def test_the_followed_set_never_outgrows_what_the_store_can_hold(two_processes: tuple[KVStore, KVStore]) -> None:
    mine, _ = two_processes
    sweep = shared_tier_sweep(Session(mine))
    assert sweep is not None
    _put(mine, range(1))
    sweep.announced(_group(0))
    assert sweep.sweep() == []  # learns a group's bytes: 8 KiB in tmpfs, so 32 KiB holds 4
    assert sweep.limit == 4
    out = [e for i in range(1, 6) for e in sweep.announced(_group(i))]
    assert len(sweep) == 4
    assert out == [TierEvent(REMOVED, "host", _group(i).as_str()) for i in (0, 1)]  # checked longest ago


def test_no_sweep_without_a_shared_tier(tmp_path: Path) -> None:
    store = KVStore.from_config(KVPackConfig.from_dict({"disk": {"enabled": False}}))  # process memory only
    try:
        assert shared_tier_sweep(Session(store)) is None and shared_tier_sweeps(Session(store)) == []
    finally:
        store.close()
    with pytest.raises(ValueError, match="per_step"):
        SharedSweep(store.tiers[0], per_step=0)  # type: ignore[arg-type]


def test_host_and_disk_are_each_swept_by_the_same_rule(tmp_path: Path) -> None:
    data = {"memory": {"mode": "host", "host_name": f"sweep-{uuid.uuid4().hex[:8]}"}, "disk": {"path": str(tmp_path)}}
    store = KVStore.from_config(KVPackConfig.from_dict(data))
    try:
        sweeps = shared_tier_sweeps(Session(store))
        assert [type(s) for s in sweeps] == [SharedSweep, SharedSweep]
        assert [s.tier.name for s in sweeps] == ["host", "disk"]
        assert shared_tier_sweep(Session(store), "disk") is not None
    finally:
        store.close()
        drop(data["memory"]["host_name"])  # type: ignore[index]


@pytest.fixture
def two_disk_processes(tmp_path: Path) -> Iterator[tuple[KVStore, KVStore]]:
    """Two stores on one disk folder, memory off (each its own tier, as two processes): 4 KiB
    holds four 1 KiB objects (the disk tier charges the payload)."""
    data = {"memory": {"enabled": False}, "disk": {"path": str(tmp_path / "kv"), "capacity": "4KiB"}}
    with two_stores(data) as stores:
        yield stores


def test_another_process_evictions_from_a_shared_disk_folder_are_withdrawn_once_each(
    two_disk_processes: tuple[KVStore, KVStore],
) -> None:
    sweep = _evictions_withdrawn_a_slice_per_step_once_each(*two_disk_processes, "disk")
    assert sweep.limit == 4  # the folder holds four groups: the followed set is bounded by it


def test_nothing_is_withdrawn_while_the_disk_index_is_built_then_exactly_what_is_gone(tmp_path: Path) -> None:
    # a large existing folder not indexed yet: the index answers "absent" for every group until
    # the scan ends, so a sweep then would withdraw everything; it skips (without waiting) instead
    writer = DiskTier(tmp_path, 1 << 20)
    _put_tier(writer, range(4))
    writer.close()
    for p in tmp_path.iterdir():
        if p.name.startswith(INDEX_NAME):
            p.unlink()
    gate, paced = threading.Event(), threading.Event()

    def pace(found: int) -> None:  # the scan holds after its first leaf folder until the test lets it go
        paced.set()
        gate.wait(30)

    mine = DiskTier(tmp_path, 1 << 20, open_scan_s=0.01, index_pace=pace)
    try:
        assert paced.wait(10) and not mine.index_complete()
        sweep = SharedSweep(mine)
        for i in range(4):
            sweep.announced(_group(i))
        assert [sweep.sweep() for _ in range(3)] == [[], [], []] and len(sweep) == 4
    finally:
        gate.set()
    assert mine.wait_indexed(30)
    other = DiskTier(tmp_path, 1 << 20)
    try:
        other.remove_groups([_group(2)])
        assert sweep.sweep() == [TierEvent(REMOVED, "disk", _group(2).as_str())]
        assert sweep.sweep() == [] and len(sweep) == 3
    finally:
        other.close()
        mine.close()


def _put_tier(tier: DiskTier, chunks: range) -> None:
    assert tier.put_from([make_item("t", chunk_id(i), seed=i)[0] for i in chunks]) == [TierStatus.OK] * len(chunks)
