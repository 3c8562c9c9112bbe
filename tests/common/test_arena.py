"""The memory tier's slab arena: new slabs are resident when made, and made outside the
tier's lock, so a lookup, pin or load never waits for the kernel's page faults."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fixtures.builders import chunk_id, expect, make_item
from kvpack.config.schema import EvictionPolicyName
from kvpack.policy.eviction import make_policy
from kvpack.tiers import arena as arena_module
from kvpack.tiers.arena import SlabArena
from kvpack.tiers.base import TierStatus
from kvpack.tiers.memory import MemoryTier

WAIT_S = 5.0
"""Bound on every wait in these tests (a reader held by the lock fails here instead of hanging)."""


def _resident_bytes() -> int:
    fields = Path("/proc/self/statm").read_text().split()
    import resource

    return int(fields[1]) * resource.getpagesize()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="residency is read from /proc/self/statm")
@pytest.mark.parametrize("populate", [True, False], ids=["madv_populate_write", "touch_each_page"])
def test_a_new_slab_is_resident_before_a_store_writes_it(populate: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not populate:  # the path for kernels older than 5.14
        monkeypatch.setattr(arena_module, "_MADV_POPULATE_WRITE", None)
    nbytes = 32 << 20
    before = _resident_bytes()
    slab = arena_module._system_slab(nbytes, pin=False)  # noqa: SLF001 - the fault-in itself is under test
    grown = _resident_bytes() - before
    assert slab.nbytes == nbytes and slab.flags.writeable
    assert grown >= 0.9 * nbytes, f"only {grown} of {nbytes} bytes resident after the slab was made"
    assert not slab[:: 1 << 20].any()  # fresh anonymous memory reads as zeros


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(), reason="the kernel has no transparent huge pages"
)
def test_a_new_slab_never_asks_for_huge_pages() -> None:
    """A huge-page fault may make the faulting thread compact memory first: in a vLLM CPU
    engine that cost the save thread 4-5x the CPU of 4 KiB pages on the engine's cores
    (module docstring). So a slab is advised against huge pages, whatever THP's setting."""
    slab = arena_module._system_slab(8 << 20, pin=False)  # noqa: SLF001 - the mapping itself is under test
    mapping = _mapping_of(slab.ctypes.data)
    flags = mapping["VmFlags"].split()
    assert "nh" in flags and "hg" not in flags, flags
    assert mapping["AnonHugePages"] == "0 kB"


def test_ordered_slabs_stay_within_the_bound_and_a_refused_one_is_handed_back(monkeypatch: pytest.MonkeyPatch) -> None:
    a = SlabArena(slab_bytes=1 << 16, limit_bytes=1 << 18)
    orders = a.order([4096] * 40)  # 160 KiB of slots wanted
    assert sum(o.nbytes for o in orders) >= 40 * 4096 and a.reserved_bytes <= a.limit_bytes
    # a second batch ordering before the first is adopted still stays within the bound
    more = a.order([4096] * 100)
    assert a.reserved_bytes <= a.limit_bytes
    a.make(orders)
    a.adopt(orders)
    assert a.free_bytes() == sum(o.nbytes for o in orders)
    slots = [a.alloc(4096) for _ in range(40)]
    assert all(s is not None and s.nbytes == 4096 for s in slots)
    reserved = a.reserved_bytes

    def refuse(nbytes: int, pin: bool) -> np.ndarray:
        raise MemoryError

    monkeypatch.setattr(arena_module, "_system_slab", refuse)
    a.make(more)
    a.adopt(more)
    assert a.reserved_bytes == reserved - sum(o.nbytes for o in more)  # nothing made, nothing kept reserved
    assert a.alloc(3 * 4096) is None  # growing in place: refused, so no slot, and nothing reserved
    assert a.reserved_bytes == reserved - sum(o.nbytes for o in more)


def _bounded(call: Callable[[], object]) -> object:
    """`call()` on another thread; fails the test if it does not return within WAIT_S."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(call()), daemon=True)
    t.start()
    t.join(WAIT_S)
    assert out, f"blocked for {WAIT_S}s behind a put that was making a slab"
    return out[0]


def test_lookups_pins_and_loads_do_not_wait_for_a_put_that_makes_a_slab(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = MemoryTier(64 << 20, make_policy(EvictionPolicyName.LRU), pin=False)
    stored, data = make_item("t", chunk_id(1), nbytes=1 << 16, seed=1)
    assert tier.put_from([stored]) == [TierStatus.OK]
    real = arena_module._system_slab  # noqa: SLF001
    making, release = threading.Event(), threading.Event()

    def slow_slab(nbytes: int, pin: bool) -> np.ndarray:  # the kernel faulting a large slab in, stretched
        making.set()
        release.wait(WAIT_S)
        return real(nbytes, pin)

    monkeypatch.setattr(arena_module, "_system_slab", slow_slab)
    second, second_data = make_item("t", chunk_id(2), nbytes=1 << 16, seed=2)  # needs a new slab
    put: list[list[TierStatus]] = []
    writer = threading.Thread(target=lambda: put.append(tier.put_from([second])), daemon=True)
    writer.start()
    try:
        assert making.wait(WAIT_S)
        started = time.monotonic()
        assert _bounded(lambda: tier.contains([stored.key, second.key])) == [True, False]
        assert _bounded(lambda: tier.pin([stored.key], time.monotonic() + 10)) == [True]
        dst = np.zeros_like(data)
        got = _bounded(lambda: tier.get_into([stored.key], [dst], [expect(stored)], verify_checksum=True))
        assert [r.status for r in got] == [TierStatus.OK] and np.array_equal(dst, data)  # type: ignore[attr-defined]
        tier.unpin([stored.key])
        assert time.monotonic() - started < WAIT_S and not put  # all of it while the slab was still being made
    finally:
        release.set()
        writer.join(WAIT_S)
    assert put == [[TierStatus.OK]]
    dst = np.zeros_like(second_data)
    assert [r.status for r in tier.get_into([second.key], [dst], [expect(second)], True)] == [TierStatus.OK]
    assert np.array_equal(dst, second_data)


def test_a_released_batch_of_slots_comes_back_in_the_order_it_was_given() -> None:
    """`release_many` (a batch's evicted slots): the next allocations get those slots back
    in the order they were released (within a slab, ascending addresses, as a fresh slab
    hands them out), so a conversion into them walks memory forward (in reverse it ran slower)."""
    a = SlabArena(slab_bytes=1 << 16, limit_bytes=1 << 18)
    first = [a.alloc(4096) for _ in range(16)]
    addrs = [int(s.ctypes.data) for s in first if s is not None]
    assert len(addrs) == 16
    reserved = a.reserved_bytes
    a.release_many(first)
    del first
    again = [a.alloc(4096) for _ in range(16)]
    assert [int(s.ctypes.data) for s in again if s is not None] == addrs
    assert a.reserved_bytes == reserved
