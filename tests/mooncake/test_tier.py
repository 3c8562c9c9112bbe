"""MooncakeTier against a real master + holder: round trips, verification, overwrite, removal."""

from __future__ import annotations

import numpy as np
import pytest

from fixtures.builders import GROUP_FP, expect_key, item, key, payload
from fixtures.mooncake import raw_client, raw_put
from kvpack.identity.objects import RejectReason
from kvpack.tiers.base import TierStatus
from kvpack.tiers.mooncake import MooncakeTier, TierState

pytestmark = pytest.mark.mooncake


@pytest.fixture(scope="module")
def tier(mooncake_cluster):  # type: ignore[no-untyped-def]
    t = MooncakeTier(mooncake_cluster.tier_config())
    assert t.wait_ready(15), f"tier never connected: {t.state}"
    yield t
    t.close()


@pytest.fixture(scope="module")
def raw(mooncake_cluster):  # type: ignore[no-untyped-def]
    store = raw_client(mooncake_cluster.master_address)
    yield store
    store.close()


@pytest.mark.parametrize("nbytes", [1, 4096, 1 << 20, 5 << 20])
def test_round_trip_bit_exact(tier: MooncakeTier, nbytes: int) -> None:
    keys = [key(f"rt{nbytes}-{i}") for i in range(3)]
    datas = [payload(i + nbytes, nbytes) for i in range(3)]
    assert tier.put_from([item(k, d) for k, d in zip(keys, datas)]) == [TierStatus.OK] * 3
    assert tier.contains(keys + [key("never-stored")]) == [True, True, True, False]
    dsts = [np.full(nbytes, 0xEE, dtype=np.uint8) for _ in keys]
    res = tier.get_into(keys, [memoryview(d) for d in dsts], [expect_key(k, payload_len=nbytes) for k in keys], True)
    assert [r.status for r in res] == [TierStatus.OK] * 3
    for got, want in zip(dsts, datas):
        assert np.array_equal(got, want)


def test_batch_larger_than_one_step(tier: MooncakeTier) -> None:
    """40 MiB in one call spans several sub-batches of a lane; all come back."""
    keys = [key(f"big-{i}") for i in range(10)]
    datas = [payload(100 + i, 4 << 20) for i in range(10)]
    assert tier.put_from([item(k, d) for k, d in zip(keys, datas)]) == [TierStatus.OK] * 10
    dsts = [np.zeros(4 << 20, dtype=np.uint8) for _ in keys]
    res = tier.get_into(keys, [memoryview(d) for d in dsts], [expect_key(k) for k in keys], False)
    assert all(r.ok for r in res), [r.status for r in res]
    assert all(np.array_equal(a, b) for a, b in zip(dsts, datas))


def test_miss_is_miss_not_empty_data(tier: MooncakeTier) -> None:
    dst = np.full(64, 0xEE, dtype=np.uint8)
    (res,) = tier.get_into([key("absent")], [memoryview(dst)], [expect_key(key("absent"))], True)
    assert res.status is TierStatus.MISS
    assert (dst == 0xEE).all()


def test_wrong_destination_size_is_rejected(tier: MooncakeTier) -> None:
    k = key("size")
    tier.put_from([item(k, payload(1, 1000))])
    (res,) = tier.get_into([k], [memoryview(np.zeros(999, dtype=np.uint8))], [expect_key(k)], True)
    assert (res.status, res.reason) == (TierStatus.REJECTED, RejectReason.LENGTH)


def test_expectation_mismatch_is_rejected(tier: MooncakeTier) -> None:
    k = key("tokens")
    tier.put_from([item(k, payload(2, 256))])
    (res,) = tier.get_into(
        [k], [memoryview(np.zeros(256, dtype=np.uint8))], [expect_key(k, token_count=TOKENS_OTHER)], True
    )
    assert (res.status, res.reason) == (TierStatus.REJECTED, RejectReason.TOKEN_COUNT)


TOKENS_OTHER = 17


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        ("flip_payload", RejectReason.CHECKSUM),
        ("garbage", RejectReason.BAD_MAGIC),
        ("truncate", RejectReason.TRUNCATED),
        ("other_member", RejectReason.MEMBER),
        ("empty", RejectReason.TRUNCATED),
    ],
)
def test_corrupted_object_is_rejected_then_overwritten(
    tier: MooncakeTier, raw, corrupt: str, reason: RejectReason
) -> None:  # type: ignore[no-untyped-def]
    k = key(f"corrupt-{corrupt}")
    data = payload(7, 8192)
    good = item(k, data, checksum=True)
    blob = good.header.encode() + data.tobytes()
    if corrupt == "flip_payload":
        bad = bytearray(blob)
        bad[-100] ^= 0xFF
        blob = bytes(bad)
    elif corrupt == "garbage":
        blob = bytes(payload(8, len(blob)))
    elif corrupt == "truncate":
        blob = blob[:40]
    elif corrupt == "other_member":
        blob = item(key(k.chunk, "draft"), data, checksum=True).header.encode() + data.tobytes()
    elif corrupt == "empty":
        blob = b"\x00"
    assert raw_put(raw, k.as_str(), blob) == 0
    dst = np.zeros(8192, dtype=np.uint8)
    (res,) = tier.get_into([k], [memoryview(dst)], [expect_key(k)], True)
    assert res.status is TierStatus.REJECTED
    assert res.reason is reason
    # A put of the same key now overwrites the refused object (upsert), and it loads.
    assert tier.put_from([item(k, data)]) == [TierStatus.OK]
    (res,) = tier.get_into([k], [memoryview(dst)], [expect_key(k)], True)
    assert res.ok and np.array_equal(dst, data)


def test_checksum_is_skipped_only_when_not_asked(tier: MooncakeTier, raw) -> None:  # type: ignore[no-untyped-def]
    k = key("nochecksum")
    data = payload(9, 4096)
    bad = bytearray(item(k, data, checksum=True).header.encode() + data.tobytes())
    bad[-1] ^= 1
    raw_put(raw, k.as_str(), bytes(bad))
    dst = np.zeros(4096, dtype=np.uint8)
    assert tier.get_into([k], [memoryview(dst)], [expect_key(k)], True)[0].reason is RejectReason.CHECKSUM
    assert tier.get_into([k], [memoryview(dst)], [expect_key(k)], False)[0].ok  # headers only, as asked


def test_tail_objects_are_overwritten(tier: MooncakeTier) -> None:
    """A tail key is rewritten with new token ids; the new object is what loads."""
    k = key("parent-tail")
    first, second = payload(10, 2048), payload(11, 2048)
    assert tier.put_from([item(k, first, token_ids=list(range(40)))]) == [TierStatus.OK]
    assert tier.put_from([item(k, second, token_ids=list(range(100, 170)))]) == [TierStatus.OK]
    (header,) = tier.peek_headers([k])
    assert header is not None and header.token_ids == tuple(range(100, 170))
    dst = np.zeros(2048, dtype=np.uint8)
    (res,) = tier.get_into(
        [k], [memoryview(dst)], [expect_key(k, token_count=None, token_ids_prefix=tuple(range(100, 170)))], True
    )
    assert res.ok and np.array_equal(dst, second)


def test_peek_long_header(tier: MooncakeTier) -> None:
    """A tail header larger than the first peek read (4 KiB) is read in a second round."""
    k = key("long-tail")
    ids = list(range(3000))
    tier.put_from([item(k, payload(12, 100), token_ids=ids)])
    (header,) = tier.peek_headers([k])
    assert header is not None and header.token_ids == tuple(ids)
    assert tier.peek_headers([key("nothing-here")]) == [None]


def test_remove_groups_removes_every_member(tier: MooncakeTier) -> None:
    a, b, c = key("rm", "kv"), key("rm", "draft"), key("rm2", "kv")
    tier.put_from([item(x, payload(13, 100)) for x in (a, b, c)])
    tier.get_into([a], [memoryview(np.zeros(100, dtype=np.uint8))], [expect_key(a)], False)  # leases it
    assert tier.remove_groups([a.group]) == 2
    assert tier.contains([a, b, c]) == [False, False, True]


def test_state_and_usage(tier: MooncakeTier) -> None:
    assert tier.state == TierState.READY and tier.available
    assert tier.usage().capacity_bytes == 0  # a pure client contributes no segment
    assert GROUP_FP in key("x").as_str()
