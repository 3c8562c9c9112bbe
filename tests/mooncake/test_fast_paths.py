"""The tier's fast paths: direct multi-region puts, the byte-compare header check, pipelined steps."""

from __future__ import annotations

import numpy as np
import pytest

from fixtures.builders import MEMBER_FP, TOKENS, expect_key, header, item, key, payload
from kvpack.identity.objects import HeaderFastPath, ObjectHeader, decode_header
from kvpack.tiers import mooncake as mc
from kvpack.tiers.base import PutItem, TierStatus
from kvpack.tiers.mooncake import MooncakeTier
from kvpack.tiers.mooncake.puts import DIRECT_MIN_BYTES

pytestmark = pytest.mark.mooncake


@pytest.fixture(scope="module")
def tier(mooncake_cluster):  # type: ignore[no-untyped-def]
    t = MooncakeTier(mooncake_cluster.tier_config())
    assert t.wait_ready(15), f"tier never connected: {t.state}"
    yield t
    t.close()


def _staged(h: ObjectHeader, body: bytes) -> memoryview:
    return memoryview(np.frombuffer(h.encode() + body, dtype=np.uint8).copy())


def test_fast_header_check_accepts_exactly_what_the_full_decode_accepts() -> None:
    k = key("fast-1")
    body = bytes(range(64))
    h = header(k.tenant, k.chunk, k.member, payload_len=len(body), checksum=1234)
    raw = _staged(h, body)
    hit = HeaderFastPath().check(raw, raw.nbytes, expect_key(k, payload_len=len(body)))
    assert hit is not None and hit[0] == decode_header(raw) and hit[1] == len(h.encode())
    # Anything that differs falls back to the full decode (None), which names the reason.
    for exp in (
        expect_key(key("fast-2"), payload_len=64),
        expect_key(k, payload_len=63),
        expect_key(k, token_count=TOKENS + 1, payload_len=64),
        expect_key(k, payload_len=64, token_ids_prefix=(1,)),
        expect_key(k, token_count=None, payload_len=64),
    ):
        assert HeaderFastPath().check(raw, raw.nbytes, exp) is None
    assert HeaderFastPath().check(raw, raw.nbytes - 1, expect_key(k, payload_len=64)) is None
    damaged = np.frombuffer(raw, dtype=np.uint8).copy()
    damaged[30] ^= 1  # inside the checksum field: only the header's own xxh32 can tell
    assert HeaderFastPath().check(memoryview(damaged), raw.nbytes, expect_key(k, payload_len=64)) is None
    upper = expect_key(k, payload_len=64).__class__(MEMBER_FP.upper(), k.tenant, k.chunk, k.member, TOKENS, 64)
    assert HeaderFastPath().check(raw, raw.nbytes, upper) is None


def test_direct_multi_region_put_round_trip(tier: MooncakeTier) -> None:
    """Large payloads go straight from the caller's regions (K and V halves here)."""
    n = DIRECT_MIN_BYTES
    keys = [key(f"direct-{i}") for i in range(3)]
    datas = [payload(900 + i, 2 * n) for i in range(3)]
    items = []
    for k, d in zip(keys, datas):
        base = item(k, d)
        items.append(PutItem(k, base.header, (memoryview(d[:n]), memoryview(d[n:]))))
    assert tier.put_from(items) == [TierStatus.OK] * 3
    dsts = [np.zeros(2 * n, dtype=np.uint8) for _ in keys]
    parts = [(memoryview(d[: n // 2]), memoryview(d[n // 2 :])) for d in dsts]
    res = tier.get_into(keys, parts, [expect_key(k, payload_len=2 * n) for k in keys], True)
    assert all(r.ok for r in res), res
    assert all(np.array_equal(a, b) for a, b in zip(dsts, datas))


def test_mixed_batch_over_many_steps(tier: MooncakeTier) -> None:
    """Small (staged) and large (direct) objects in one call of several pipelined steps."""
    sizes = [64 << 10, 1 << 20, 4096, 3 << 20] * 12
    keys = [key(f"mixed-{i}") for i in range(len(sizes))]
    datas = [payload(2000 + i, s) for i, s in enumerate(sizes)]
    assert tier.put_from([item(k, d) for k, d in zip(keys, datas)]) == [TierStatus.OK] * len(keys)
    dsts = [np.zeros(s, dtype=np.uint8) for s in sizes]
    res = tier.get_into(
        keys, [memoryview(d) for d in dsts], [expect_key(k, payload_len=s) for k, s in zip(keys, sizes)], True
    )
    assert all(r.ok for r in res)
    assert all(np.array_equal(a, b) for a, b in zip(dsts, datas))


def test_plan_is_even() -> None:
    steps = mc.plan_steps([65664] * 1024, [65646] * 1024, 32 << 20, 16 << 20)
    assert len(steps) == 4 and sorted(i for s in steps for i in s) == list(range(1024))
    # Staging that does not fit a slot splits a step; an item larger than a slot is a step alone.
    steps = mc.plan_steps([3 << 20] * 4, [3 << 20] * 4, 4 << 20, 16 << 20)
    assert steps == [[0], [1], [2], [3]]
