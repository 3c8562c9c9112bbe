"""The native region copy (`kvpack.ops.region_copier`): byte-exact against numpy for
every alignment and length around the streaming threshold, errors before any byte
moves, and the memory tier's stores through it are byte-exact."""

from __future__ import annotations

import numpy as np
import pytest

from kvpack.ops import load_extension, region_copier

STREAM_MIN = 16 * 1024  # KVP_STREAM_MIN_BYTES in csrc/region_copy_cpu.h


@pytest.fixture(scope="module")
def copy_regions():  # type: ignore[no-untyped-def]
    status = load_extension()
    if not status.available:
        pytest.skip(f"kvpack.ops extension not built here: {status.reason}")
    copier = region_copier()
    assert copier is not None, "extension loaded but no region copier"
    return copier


@pytest.mark.parametrize("streaming", [True, False])
def test_regions_copied_exactly_at_every_alignment(copy_regions, streaming: bool) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 8 << 20, dtype=np.uint8)
    dst = np.full(8 << 20, 0xEE, dtype=np.uint8)
    lengths = [0, 1, 15, 63, 64, 65, STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 1, 192 << 10, (192 << 10) + 13, 1 << 20]
    pairs, expect = [], dst.copy()
    d_off = s_off = 0
    for i, n in enumerate(lengths):
        d_off += i % 17  # destinations at every alignment mod 16
        s_off += (3 * i) % 29
        pairs.append((dst[d_off : d_off + n], src[s_off : s_off + n]))
        expect[d_off : d_off + n] = src[s_off : s_off + n]
        d_off += n
        s_off += n
    copy_regions(pairs, streaming)
    assert np.array_equal(dst, expect)  # every region, and not one byte around them


def test_memoryviews_and_arrays_mix(copy_regions) -> None:  # type: ignore[no-untyped-def]
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 17, dtype=np.uint8)
    copy_regions([(dst[: 1 << 16], memoryview(src)), (memoryview(dst)[1 << 16 :], src.tobytes())], True)
    assert np.array_equal(dst[: 1 << 16], src) and np.array_equal(dst[1 << 16 :], src)


def test_bad_pairs_raise_before_any_byte_moves(copy_regions) -> None:  # type: ignore[no-untyped-def]
    src = np.ones(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    good = (dst[:1024], src[:1024])
    with pytest.raises(ValueError, match="pair 1 has 2048 destination bytes and 1024"):
        copy_regions([good, (dst[:2048], src[:1024])], True)
    with pytest.raises((BufferError, TypeError)):  # read-only destination
        copy_regions([good, (src.tobytes(), src)], True)
    with pytest.raises((BufferError, ValueError)):  # not contiguous
        copy_regions([good, (dst[::2], src[: 1 << 15])], True)
    with pytest.raises(ValueError, match="tuple"):
        copy_regions([good, [dst, src]], True)
    assert not dst.any(), "a refused batch copied part of itself"


def test_memory_tier_stores_through_the_native_copy(copy_regions) -> None:  # type: ignore[no-untyped-def]
    from kvpack.config.schema import EvictionPolicyName
    from kvpack.identity.keys import StoreKey
    from kvpack.identity.objects import Expectation, ObjectHeader
    from kvpack.policy.eviction import make_policy
    from kvpack.tiers.base import PutItem, TierStatus
    from kvpack.tiers.memory import MemoryTier

    used: list[int] = []

    def counting_copier():  # type: ignore[no-untyped-def]
        def copy(pairs, streaming):  # type: ignore[no-untyped-def]
            used.append(len(pairs))
            copy_regions(pairs, streaming)

        return copy

    tier = MemoryTier(64 << 20, make_policy(EvictionPolicyName.LRU), copy_threads=2, region_copier=counting_copier)
    rng = np.random.default_rng(3)
    pages = [
        (rng.integers(0, 256, 96 << 10, dtype=np.uint8), rng.integers(0, 256, 96 << 10, dtype=np.uint8))
        for _ in range(64)
    ]
    items, fp = [], "f" * 32
    for i, (k, v) in enumerate(pages):
        header = ObjectHeader(fp, "t", f"{i:064x}", "kv", 16, k.nbytes + v.nbytes, None)
        items.append(PutItem(StoreKey("t", fp, f"{i:064x}", "kv"), header, (memoryview(k), memoryview(v))))
    assert tier.put_from(items) == [TierStatus.OK] * len(items)
    assert sum(used) == 2 * len(items), "the stores did not go through the native copy"
    dsts = [np.zeros(192 << 10, dtype=np.uint8) for _ in pages]
    expected = [Expectation(fp, "t", it.header.chunk, "kv", 16, it.header.payload_len) for it in items]
    results = tier.get_into([it.key for it in items], [memoryview(d) for d in dsts], expected, False)
    assert all(r.ok for r in results)
    for d, (k, v) in zip(dsts, pages):
        assert np.array_equal(d[: k.nbytes], k) and np.array_equal(d[k.nbytes :], v)
