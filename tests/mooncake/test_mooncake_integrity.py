"""Issue 15: the integrity key covers Mooncake too (a real master + holder).

A writer of the cluster without the key replaces a kvpack object with a forged
one carrying a recomputed xxh3: with the key the load is refused
(REJECTED, reason integrity, counted); without it (the negative control) the
forged bytes load."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fixtures.builders import expect_key, item, key, payload
from fixtures.mooncake import raw_client, raw_put
from kvpack.config.schema import DiskTierConfig, KVPackConfig, MemoryTierConfig
from kvpack.identity.objects import RejectReason, payload_checksum
from kvpack.store import KVStore, LoadItem
from kvpack.tiers.base import TierStatus

pytestmark = pytest.mark.mooncake

KEY = "c3" * 32


def _store(cluster, keyed: bool) -> KVStore:  # type: ignore[no-untyped-def]
    config = KVPackConfig(
        memory=MemoryTierConfig(enabled=False),
        disk=DiskTierConfig(enabled=False),
        mooncake=cluster.tier_config(),
        integrity_key=KEY if keyed else "",
    )
    store = KVStore.from_config(config)
    assert store.tiers[0].wait_ready(15)  # type: ignore[attr-defined]
    return store


@pytest.mark.parametrize("keyed", [True, False])
def test_forged_mooncake_object_is_refused_only_with_the_key(mooncake_cluster, keyed: bool) -> None:  # type: ignore[no-untyped-def]
    store = _store(mooncake_cluster, keyed)
    k = key(f"forge-{keyed}")
    data = payload(7, 4096)
    try:
        assert store.store([item(k, data)]) == [TierStatus.OK]
        dst = np.zeros(4096, np.uint8)
        (res,) = store.load([LoadItem(k, memoryview(dst), expect_key(k, payload_len=4096))])
        assert res.ok and np.array_equal(dst, data)
        forged = np.full(4096, 0x41, np.uint8)
        h = replace(item(k, forged).header, checksum=payload_checksum(forged))
        raw = raw_client(mooncake_cluster.master_address)
        try:
            assert raw_put(raw, k.as_str(), h.encode() + forged.tobytes()) == 0
        finally:
            raw.close()
        (res,) = store.load([LoadItem(k, memoryview(dst), expect_key(k, payload_len=4096))])
        if keyed:
            assert res.status is TierStatus.REJECTED and res.reason is RejectReason.INTEGRITY
            assert store.metrics.value("rejected_objects", tier="mooncake", reason="integrity") == 1
        else:
            assert res.ok and np.array_equal(dst, forged)
    finally:
        store.close()
