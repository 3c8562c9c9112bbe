"""Issue 15, resource bounds: memory within a stated bound of `memory.capacity`,
per-tenant state freed when a tenant stores nothing, Prometheus labels bounded,
thread counts capped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import GROUP_FP, MEMBER_FP, chunk_id, make_item

from kvpack.config.schema import EvictionPolicyName, KVPackConfig
from kvpack.errors import ConfigError
from kvpack.identity.keys import StoreKey
from kvpack.identity.objects import ObjectHeader
from kvpack.observe.metrics import Metrics
from kvpack.policy.eviction import CapacityManager, make_policy
from kvpack.store import KVStore
from kvpack.tiers.base import PutItem, TierStatus
from kvpack.tiers.memory import MemoryTier

MIB = 1 << 20


def _bound(capacity: int) -> int:
    """The stated bound: capacity + 2 slabs of capacity/8 (4 KiB .. 64 MiB)."""
    return capacity + 2 * min(64 * MIB, max(4096, capacity // 8))


def _item(i: int, nbytes: int, tenant: str = "t") -> PutItem:
    payload = np.full(nbytes, i % 251, np.uint8)
    header = ObjectHeader(MEMBER_FP, tenant, chunk_id(i), "kv", 16, nbytes, None)
    return PutItem(StoreKey(tenant, GROUP_FP, chunk_id(i), "kv"), header, memoryview(payload))


def test_objects_of_distinct_sizes_stay_within_the_bound_of_a_48mib_tier() -> None:
    capacity = 48 * MIB
    tier = MemoryTier(capacity, make_policy(EvictionPolicyName.LRU), pin=False)
    peak = 0
    for i in range(6):
        assert tier.put_from([_item(i, 40 * MIB + i)]) == [TierStatus.OK]
        peak = max(peak, tier._arena.reserved_bytes)  # noqa: SLF001 - bytes taken from the system
    assert peak <= _bound(capacity)
    assert tier.contains([_item(5, 1).key]) == [True]
    tier.close()


def test_a_64kib_tier_never_takes_more_than_its_bound() -> None:
    capacity = 64 << 10
    tier = MemoryTier(capacity, make_policy(EvictionPolicyName.LRU), pin=False)
    stored = 0
    for i in range(60):
        statuses = tier.put_from([_item(i, 1000 + 37 * i)])
        stored += statuses == [TierStatus.OK]
        assert tier._arena.reserved_bytes <= _bound(capacity)  # noqa: SLF001
    assert stored >= 50  # most stores still fit: the bound costs reuse, not the tier
    tier.close()


def test_uniform_objects_still_reuse_their_slots() -> None:
    capacity = 8 * MIB
    tier = MemoryTier(capacity, make_policy(EvictionPolicyName.LRU), pin=False)
    for i in range(200):  # 25 tier-fulls of 256 KiB objects
        assert tier.put_from([_item(i, 256 << 10)]) == [TierStatus.OK]
    assert tier._arena.reserved_bytes <= _bound(capacity)  # noqa: SLF001
    assert tier.usage().objects == 32
    tier.close()


def test_tenants_leave_no_state_behind_once_evicted() -> None:
    manager = CapacityManager(4096, make_policy(EvictionPolicyName.LRU))
    for n in range(2000):
        plan = manager.reserve(("g", n), f"salt-{n}", "kv", 1024)
        for victim in plan.victims:
            manager.release(victim)
        manager.commit(("g", n), f"salt-{n}", "kv", 1024)
    assert len(manager.tenants()) == 4
    assert len(manager._tenant_used) == 4  # noqa: SLF001
    for group in manager.groups():
        manager.release(group)
    assert manager.tenants() == [] and manager._tenant_used == {}  # noqa: SLF001


def test_20000_tenants_cost_bounded_labels_and_no_folders(tmp_path: Path) -> None:
    config = KVPackConfig.from_dict(
        {
            "memory": {"capacity": "64KiB"},
            "disk": {"path": str(tmp_path / "d"), "capacity": "64KiB"},
            "metrics_max_tenants": 8,
            "io_threads": 1,
        }
    )
    store = KVStore.from_config(config)
    n = 2000
    for i in range(n):
        item, _ = make_item(f"salt-{i}", chunk_id(i), nbytes=1024, checksum=False)
        store.lookup(item.key.tenant, GROUP_FP, [chunk_id(i)], [], 16)
        store.store([item])
    assert store.flush(30)
    series = {k for name, values in store.metrics.snapshot().items() for k in values}
    tenants = {part.split("=", 1)[1] for k in series for part in k.split(",") if part.startswith("tenant=")}
    assert len(tenants) <= 8 + 2  # 8 tenants seen first, the configured default, "other"
    assert "other" in tenants
    samples = sum(1 for line in _prometheus_text(store.metrics).splitlines() if line and not line.startswith("#"))
    assert samples < 2000
    dirs = [p for p in (tmp_path / "d").rglob("*") if p.is_dir()]
    assert len(dirs) <= 3 * 64  # folders of tenants with something stored only (64 KiB / 1 KiB objects)
    store.close()


def _prometheus_text(metrics: Metrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


def test_configured_tenants_always_keep_their_label() -> None:
    metrics = Metrics.for_config(
        KVPackConfig.from_dict(
            {"tenant": "acme", "metrics_max_tenants": 1, "eviction": {"tenant_quotas": {"vip": "1MiB"}}}
        )
    )
    for t in ("a", "b", "c", "vip", "acme"):
        metrics.inc("lookups", tenant=t)
    assert metrics.value("lookups", tenant="a") == 1
    assert metrics.value("lookups", tenant="b") == 2  # b and c are "other"
    assert metrics.value("lookups", tenant="other") == 2
    assert metrics.value("lookups", tenant="vip") == 1 and metrics.value("lookups", tenant="acme") == 1


def test_thread_counts_are_capped_with_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="between 1 and 64") as err:
        KVPackConfig.from_dict({"io_threads": 2000})
    assert err.value.field == "io_threads"
