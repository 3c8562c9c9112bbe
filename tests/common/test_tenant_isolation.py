"""Tenant isolation as a property: whatever tenants store, lookups and loads in
tenant B never see an entry only tenant A stored, on any tier."""

from __future__ import annotations

import tempfile
from contextlib import closing

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures.builders import GROUP_FP, MEMBER_FP, chunk_id, make_item
from kvpack import KVPackConfig, KVStore, LoadItem, MemberSpec, StoreKey
from kvpack.identity.objects import Expectation

TENANTS = ["alpha", "beta", "gamma"]
KV = MemberSpec("kv", MEMBER_FP)


@settings(max_examples=25, deadline=None)
@given(
    writes=st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(0, 7)), max_size=20),
    tiers=st.sampled_from([("memory",), ("disk",), ("memory", "disk")]),
    capacity=st.sampled_from(["4KiB", "64MiB"]),
)
def test_lookups_only_see_own_entries(writes: list[tuple[str, int]], tiers: tuple[str, ...], capacity: str) -> None:
    with (
        tempfile.TemporaryDirectory() as d,
        closing(
            KVStore.from_config(
                KVPackConfig.from_dict(
                    {
                        "memory": {"enabled": "memory" in tiers, "capacity": capacity},
                        "disk": {"enabled": "disk" in tiers, "path": d, "capacity": capacity},
                    }
                )
            )
        ) as store,
    ):
        written: dict[str, set[int]] = {t: set() for t in TENANTS}
        for tenant, i in writes:
            item, _ = make_item(tenant, chunk_id(i), seed=i, checksum=False)
            store.store([item])
            written[tenant].add(i)
        assert store.flush(10)
        last = writes[-1] if writes else None  # the newest object: never the one evicted, whatever the capacity
        for tenant in TENANTS:
            presence = store.contains_members(tenant, GROUP_FP, [chunk_id(i) for i in range(8)], ["kv"])
            for i, p in enumerate(presence):
                if p["kv"]:
                    assert i in written[tenant], f"{tenant} sees chunk {i} it never stored"
                dst = np.empty(1024, np.uint8)
                res = store.load(
                    [
                        LoadItem(
                            StoreKey(tenant, GROUP_FP, chunk_id(i), "kv"),
                            memoryview(dst),
                            Expectation(MEMBER_FP, tenant, chunk_id(i), "kv"),
                        )
                    ]
                )[0]
                if res.ok:
                    assert i in written[tenant]
                    assert res.header is not None and res.header.tenant == tenant
                if capacity == "64MiB" or (tenant, i) == last:  # nothing evicted: the owner finds its own
                    assert p["kv"] == (i in written[tenant]), f"{tenant}: chunk {i} stored={i in written[tenant]}"
                    assert res.ok == (i in written[tenant]), f"{tenant}: chunk {i} load {res.status}"
