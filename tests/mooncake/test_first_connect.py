"""The Mooncake tier's first connect: what an engine's first requests see while it runs.

A tier connects in the background (construction never blocks). Before this was
handled, a put made before the connect finished answered UNAVAILABLE and the
object was dropped (a new engine's first computed prefix never reached the
cluster), and a lookup missed what the cluster held. Now, within
``connect_wait_ms`` of start-up and only while the first connect is still in
progress, puts wait for it and `KVStore.warming_up` says lookups would miss
(vLLM holds the request, SGLang's prefetch thread waits: their own tests). A
master that cannot be reached is not waited for. Real master and holder on
127.0.0.1.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from fixtures.builders import expect_key, item, key, payload
from kvpack.errors import ConfigError
from kvpack.store import KVStore
from kvpack.tiers.base import TierStatus
from kvpack.tiers.mooncake import MooncakeTier, TierState
from kvpack.tools.ports import free_port

pytestmark = pytest.mark.mooncake


def test_a_put_made_before_the_first_connect_is_stored(mooncake_cluster) -> None:  # type: ignore[no-untyped-def]
    """The first thing a new tier does is a put (an engine saving its first prefix)."""
    k, data = key("first-put"), payload(7, 256 << 10)
    writer = MooncakeTier(mooncake_cluster.tier_config())
    try:
        assert writer.put_from([item(k, data)]) == [TierStatus.OK]  # UNAVAILABLE, dropped, before
        assert writer.state is TierState.READY and not writer.warming_up()
    finally:
        writer.close()
    reader = MooncakeTier(mooncake_cluster.tier_config())  # another client, as a second engine is
    try:
        assert reader.wait_warm()
        dst = np.zeros_like(data)
        (res,) = reader.get_into([k], [memoryview(dst)], [expect_key(k)], True)
        assert res.ok and np.array_equal(dst, data)
    finally:
        reader.close()


def test_a_store_is_warm_once_its_tier_connected(mooncake_cluster) -> None:  # type: ignore[no-untyped-def]
    store = KVStore.from_config(mooncake_cluster.kvpack_config())
    try:
        assert store.wait_warm()
        assert not store.warming_up()
        assert store.tiers[0].available
    finally:
        store.close()


def test_an_unreachable_master_is_down_not_warming_up() -> None:
    """Nothing listens: the first attempt fails at once, so nobody waits the whole bound."""
    from kvpack.config.schema import MooncakeTierConfig

    cfg = MooncakeTierConfig(
        enabled=True,
        master_server_address=f"127.0.0.1:{free_port()}",
        global_segment_size=0,
        connect_wait_ms=60_000,
        backoff_s=30,
    )
    tier = MooncakeTier(cfg)
    try:
        start = time.monotonic()
        assert tier.put_from([item(key("down"), payload(1, 64))]) == [TierStatus.UNAVAILABLE]
        assert time.monotonic() - start < 30, "a put waited for a master that cannot be reached"
        assert not tier.warming_up() and tier.state is TierState.CONNECTING
        assert not tier.wait_warm()
    finally:
        tier.close()


def test_connect_wait_zero_never_waits(mooncake_cluster) -> None:  # type: ignore[no-untyped-def]
    tier = MooncakeTier(mooncake_cluster.tier_config(connect_wait_ms=0))
    try:
        assert not tier.warming_up()
        assert tier.wait_ready(15)  # it still connects; it is only never waited for
    finally:
        tier.close()


@pytest.mark.parametrize("value", [-1, 600_001])
def test_connect_wait_out_of_range_names_the_field(value: int) -> None:
    from kvpack.config.schema import KVPackConfig

    with pytest.raises(ConfigError, match=r"mooncake\.connect_wait_ms"):
        KVPackConfig.from_dict(
            {"mooncake": {"enabled": True, "master_server_address": "127.0.0.1:1", "connect_wait_ms": value}}
        )
