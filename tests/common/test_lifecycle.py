"""The transfer lifecycle (`kvpack.store.lifecycle`) over real tiers: pins, evictions between lookup and load, store de-duplication.

A small memory tier (4 objects of 1 KiB) is put under pressure by further
stores between `prepare_load` and `complete_load`: a pinned object must
survive it, an unpinned one found by the lookup and gone at load is counted
as ``evicted_before_load`` (not as a plain miss), and a plan nobody completes
stops pinning at its deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from fixtures.builders import GROUP_FP, MEMBER_FP, chunk_id, expect, make_item
from kvpack import KVPackConfig, KVStore, LoadItem, MemberRole, MemberSpec, StoreKey, TierStatus
from kvpack.config.schema import EvictionPolicyName
from kvpack.policy.eviction import CapacityManager, make_policy
from kvpack.tiers.base import PutItem
from kvpack.tiers.factory import build_tiers

KV = MemberSpec("kv", MEMBER_FP, MemberRole.TARGET)
OBJ = 1024
"""Bytes per object; the memory tier holds `SLOTS` of them."""
SLOTS = 4


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., KVStore]]:
    opened: list[KVStore] = []

    def make(disk: bool = False, pin_timeout_s: float = 30.0) -> KVStore:
        config = KVPackConfig.from_dict(
            {"memory": {"capacity": SLOTS * OBJ}, "disk": {"enabled": disk, "path": str(tmp_path / "disk")}}
        )
        store = KVStore(config, build_tiers(config), pin_timeout_s=pin_timeout_s)
        opened.append(store)
        return store

    yield make
    for store in reversed(opened):
        store.close()


def items(start: int, n: int) -> list[PutItem]:
    return [make_item("t", chunk_id(i), nbytes=OBJ, seed=i)[0] for i in range(start, start + n)]


def put(store: KVStore, start: int, n: int) -> list[TierStatus]:
    out = store.store(items(start, n))
    assert store.flush(10)
    return out


def key(i: int) -> StoreKey:
    return StoreKey("t", GROUP_FP, chunk_id(i), "kv")


def in_memory(store: KVStore, i: int) -> bool:
    return store.tiers[0].contains([key(i)])[0]


def load_items(*chunks: int) -> tuple[list[LoadItem], list[np.ndarray]]:
    out, bufs = [], []
    for i in chunks:
        it = make_item("t", chunk_id(i), nbytes=OBJ, seed=i)[0]
        buf = np.zeros(OBJ, dtype=np.uint8)
        out.append(LoadItem(it.key, memoryview(buf), expect(it)))
        bufs.append(buf)
    return out, bufs


def payload_of(i: int) -> np.ndarray:
    return make_item("t", chunk_id(i), nbytes=OBJ, seed=i)[1]


def test_a_pinned_object_survives_pressure_between_prepare_and_complete(make_store: Callable[..., KVStore]) -> None:
    store = make_store()
    put(store, 0, SLOTS)
    plan = store.prepare_load([key(0)])
    assert plan.located == {key(0): "memory"} and plan.pinned == (key(0),)
    put(store, SLOTS, SLOTS)  # chunk 0 is the least recently used: the first victim, were it not pinned
    assert in_memory(store, 0)
    assert not in_memory(store, 1)  # the pressure was real: the unpinned ones went
    loads, bufs = load_items(0)
    assert [r.ok for r in store.complete_load(plan, loads)] == [True]
    assert np.array_equal(bufs[0], payload_of(0))
    assert store.metrics.value("evicted_before_load") == 0
    put(store, 2 * SLOTS, SLOTS)  # unpinned by complete_load: evictable again
    assert not in_memory(store, 0)


def test_a_store_that_needs_a_pinned_group_is_dropped_not_evicting_it(make_store: Callable[..., KVStore]) -> None:
    store = make_store()
    put(store, 0, SLOTS)
    plan = store.prepare_load([key(i) for i in range(SLOTS)])  # every resident group pinned
    assert put(store, SLOTS, 1) == [TierStatus.NO_SPACE]
    assert all(in_memory(store, i) for i in range(SLOTS))
    store.release(plan)
    assert put(store, SLOTS, 1) == [TierStatus.OK]


@pytest.mark.parametrize("disk", [True, False], ids=["fallback-to-disk", "memory-only"])
def test_eviction_between_lookup_and_load_is_counted_apart_from_misses(
    make_store: Callable[..., KVStore], disk: bool
) -> None:
    store = make_store(disk=disk)
    put(store, 0, 2)
    lookup = store.lookup("t", GROUP_FP, [chunk_id(0), chunk_id(1)], [KV], 16)
    assert lookup.hit_chunks == 2 and lookup.located == {key(0): "memory", key(1): "memory"}
    # another process's lookup (vLLM's scheduler) cannot pin this memory: the pressure comes first
    put(store, 10, SLOTS)
    assert not in_memory(store, 0) and not in_memory(store, 1)
    plan = store.prepare_load(lookup)
    assert plan.pinned == ()  # gone already: nothing to pin
    loads, bufs = load_items(0, 1, 99)  # 99: never stored, a plain miss
    results = store.complete_load(plan, loads)
    assert [r.ok for r in results] == [disk, disk, False]
    assert store.metrics.value("evicted_before_load", tier="memory", tenant="t") == 2
    assert store.metrics.value("load_failures", status="miss") == (1 if disk else 3)
    if disk:
        assert np.array_equal(bufs[0], payload_of(0)) and np.array_equal(bufs[1], payload_of(1))
    text = generate_latest(store.metrics.registry).decode()
    assert 'kvpack_evicted_before_load_total{tenant="t",tier="memory"} 2.0' in text


def test_complete_load_reads_the_tier_the_plan_names(make_store: Callable[..., KVStore]) -> None:
    store = make_store(disk=True)
    put(store, 0, 1)  # in memory and on disk
    loads, bufs = load_items(0)
    plan = store.prepare_load({key(0): "disk"})  # e.g. a lookup that ran before memory held it
    assert store.complete_load(plan, loads)[0].ok
    assert store.metrics.value("loaded_bytes", tier="disk") == OBJ
    assert store.metrics.value("loaded_bytes", tier="memory") == 0  # not every tier again, fastest first
    assert np.array_equal(bufs[0], payload_of(0))


def test_an_abandoned_plan_stops_pinning_at_its_deadline(make_store: Callable[..., KVStore]) -> None:
    store = make_store(pin_timeout_s=0.3)
    put(store, 0, SLOTS)
    lost = store.prepare_load([key(0)])  # never completed, never released
    assert lost.pinned == (key(0),)
    put(store, SLOTS, SLOTS - 1)
    assert in_memory(store, 0)  # within the bound: still pinned
    time.sleep(0.4)
    put(store, 2 * SLOTS, SLOTS)
    assert not in_memory(store, 0)  # past the bound: evictable, no one released it
    store.prepare_load([])  # the next plan sweeps the lost one
    assert store.plans.open_plans == 0


def test_pins_are_counted_and_release_is_idempotent(make_store: Callable[..., KVStore]) -> None:
    store = make_store()
    put(store, 0, SLOTS)
    a, b = store.prepare_load([key(0)]), store.prepare_load([key(0)])
    store.release(a)
    store.release(a)  # a second release of one plan must not drop b's pin
    put(store, SLOTS, SLOTS)
    assert in_memory(store, 0)
    loads, _ = load_items(0)
    assert store.complete_load(b, loads)[0].ok
    put(store, 2 * SLOTS, SLOTS)
    assert not in_memory(store, 0)


def test_capacity_manager_never_picks_a_pinned_victim() -> None:
    mgr = CapacityManager(300, make_policy(EvictionPolicyName.LRU))
    for g in "abc":
        mgr.commit(g, "t", "kv", 100)
    assert mgr.pin("a", time.monotonic() + 60) and not mgr.pin("zz", time.monotonic() + 60)
    plan = mgr.reserve("d", "t", "kv", 100)
    assert plan.victims == ("b",)  # a is older but pinned
    mgr.pin("b", time.monotonic() + 60)
    mgr.pin("c", time.monotonic() - 1)  # already past its deadline: no protection
    assert mgr.reserve("d", "t", "kv", 100).victims == ("c",)
    mgr.pin("c", time.monotonic() + 60)
    assert mgr.reserve("d", "t", "kv", 100).admission.value == "no_space"
    mgr.unpin("a")
    assert mgr.reserve("d", "t", "kv", 100).victims == ("a",)


def test_prepare_store_is_the_one_deduplication(make_store: Callable[..., KVStore]) -> None:
    store = make_store(pin_timeout_s=0.3)
    put(store, 0, 1)
    keys = [key(0), key(1), key(2)]
    assert store.prepare_store(keys) == [key(1), key(2)]  # 0 is stored
    assert store.prepare_store(keys) == []  # 1 and 2 are being stored by the first caller
    assert store.complete_store(items(1, 1)) == [TierStatus.OK]
    assert store.prepare_store(keys) == []  # 1 stored now; 2 still prepared (never completed)
    time.sleep(0.4)
    assert store.prepare_store(keys) == [key(2)]  # the lost preparation expired
