"""The host store's arena (kvpack.tiers.host.pages, .catalog): one mapping per process, pages owned
through the index, torn reads caught by the pages' stamps (issue 37).

- a record laid over scattered pages comes back byte for byte (the runs and regions a copy walks);
- every page is free, in limbo or held by exactly one object, through puts, evictions,
  replacements and removals; pages of an object evicted while its writer still writes it are not
  handed to anyone until that writer finishes;
- a load whose object's pages were given to another object and rewritten while it read them
  answers a miss (counted), never the other object's bytes and never a refusal; without the
  stamps' check the same load returns the wrong bytes (the check is what the test needs);
- a second tier (another process's view) reads what the first wrote through its own mapping,
  and a store keeps the size it was made with.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from fixtures.builders import chunk_id, make_item
from kvpack.identity.objects import Expectation
from kvpack.tiers.base import PutItem, TierStatus
from kvpack.tiers.disk.rows import group_id
from kvpack.tiers.host import HostTier, host_root
from kvpack.tiers.host.catalog import writer_name
from kvpack.tiers.host.pages import ARENA, Geometry, page_runs, pair_up, spans

CAPACITY = 256 << 10  # 64 pages of 4 KiB
PAYLOAD = 6000  # a header and this payload take two pages


@pytest.fixture
def name() -> Iterator[str]:
    n = f"pages-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    shutil.rmtree(host_root(n), ignore_errors=True)


def _items(first: int, count: int, nbytes: int = PAYLOAD) -> list[PutItem]:
    return [make_item("t", chunk_id(first + i), nbytes=nbytes, seed=first + i)[0] for i in range(count)]


def _expect(item: PutItem) -> Expectation:
    h = item.header
    return Expectation(h.fingerprint, h.tenant, h.chunk, h.member, h.token_count, h.payload_len)


def _load(tier: HostTier, item: PutItem) -> tuple[TierStatus, bytes]:
    dst = np.zeros(item.header.payload_len, np.uint8)
    (got,) = tier.get_into([item.key], [dst.data], [_expect(item)], True)
    return got.status, dst.tobytes()


def _census_whole(tier: HostTier) -> tuple[int, int, int]:
    free, limbo, held = tier.page_census()
    assert free + limbo + held == Geometry.for_capacity(CAPACITY).pages, (free, limbo, held)
    assert held * Geometry.for_capacity(CAPACITY).page_bytes == tier.usage().used_bytes
    return free, limbo, held


def test_a_record_over_scattered_pages_round_trips() -> None:
    page = 4096
    pages = [7, 8, 9, 2, 3, 11]
    runs = page_runs(pages)
    assert runs == ((7, 3), (2, 2), (11, 1))
    area = np.zeros(12 * page, np.uint8)
    record = np.random.default_rng(0).integers(0, 256, 5 * page + 100, dtype=np.uint8)
    regions = [area[o : o + n] for o, n in spans(runs, page, 0, record.nbytes)]
    for dst, src in pair_up(regions, [record[:1000], record[1000:]]):
        dst[:] = src
    back = np.concatenate([area[o : o + n] for o, n in spans(runs, page, 0, record.nbytes)])
    assert np.array_equal(back, record)
    assert spans(runs, page, 3 * page - 10, 3 * page + 10) == [(10 * page - 10, 10), (2 * page, 10)]


def test_every_page_is_free_in_limbo_or_held_once_through_puts_evictions_and_removals(name: str) -> None:
    tier = HostTier(name, CAPACITY)
    try:
        assert _census_whole(tier) == (64, 0, 0)
        assert tier.put_from(_items(0, 20)) == [TierStatus.OK] * 20
        assert _census_whole(tier) == (24, 0, 40)
        assert tier.put_from(_items(100, 20)) == [TierStatus.OK] * 20  # evicts the 8 oldest
        assert _census_whole(tier) == (0, 0, 64)
        assert tier.put_from(_items(100, 3)) == [TierStatus.OK] * 3  # replaces: their old pages freed
        assert _census_whole(tier) == (0, 0, 64)
        assert tier.remove_groups([it.key.group for it in _items(100, 5)]) == 5
        assert _census_whole(tier) == (10, 0, 54)
        for item in _items(105, 15) + _items(8, 12):
            assert _load(tier, item) == (TierStatus.OK, bytes(item.payload))
    finally:
        tier.close()


def test_pages_of_an_object_removed_mid_write_wait_for_their_writer(name: str) -> None:
    """Writer A admits an object; B (another process) cannot evict it while A writes, and when B
    removes it (a damaged group, say) its pages go to limbo: B's puts never get them, and A's
    finish frees them."""
    a, b = HostTier(name, CAPACITY), HostTier(name, CAPACITY)
    try:
        cat_a, cat_b = a._host_catalog, b._host_catalog
        item = _items(0, 1)[0]
        writer = writer_name(cat_a.owner)
        ok, _, mine = cat_a.admit_pages(
            "t", [(item.key, cat_a.geometry.charge(item.header.encoded_len, PAYLOAD), 1)], {}, writer
        )
        assert ok == [True]
        held = {p for f, n in mine[(group_id(item.key.group), item.key.member)].runs for p in range(f, f + n)}
        others = _items(1, 32)  # 64 pages: the whole arena
        assert b.put_from(others).count(TierStatus.OK) == 31  # A's object is not evicted while written
        assert sum(cat_b.lookup([it.key for it in others])) == 31
        assert _census_whole(b) == (0, 0, 64)  # A's 2 pages still its own
        assert b.remove_groups([item.key.group]) == 1  # removed while A writes: its pages wait in limbo
        assert _census_whole(b) == (0, 2, 62)
        assert b.put_from(_items(40, 1)) == [TierStatus.OK]  # room comes from an eviction, not from limbo
        taken = set()
        for extent in cat_b.ready_extents([it.key for it in others + _items(40, 1)]):
            if extent is not None:
                taken |= {p for f, n in extent.runs for p in range(f, f + n)}
        assert not taken & held, "a page was handed out while its writer could still write it"
        assert cat_a.finish([item.key], writer) == [False]  # removed while written
        assert _census_whole(a) == (2, 0, 62)
    finally:
        a.close()
        b.close()


def test_a_load_whose_pages_were_rewritten_meanwhile_is_a_miss_never_the_other_bytes(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader looked its object up (it holds the index's answer: `ready_extents`), then another
    process evicted it and began writing another object into the same pages. The stamps changed:
    a miss, counted, verified or not. With the stamps' check off, the unverified load (the
    integrity key's path) returns the other object's bytes as a hit: the check is what stops it."""
    reader, writer = HostTier(name, CAPACITY), HostTier(name, CAPACITY)
    try:
        victim = _items(0, 1)[0]
        assert writer.put_from([victim]) == [TierStatus.OK]
        stale = reader._host_catalog.ready_extents([victim.key])
        runs = stale[0].runs  # type: ignore[union-attr]
        assert writer.remove_groups([victim.key.group]) == 1
        writer._pages.begin_writes([runs])  # another object's writer took the pages...
        page = writer._pages.geometry.page_bytes
        first, count = runs[-1]
        writer._pages.area[(first + count - 1) * page : (first + count) * page] = 0xAB  # ...and wrote into the last
        monkeypatch.setattr(reader._host_catalog, "ready_extents", lambda keys: stale)
        dst = np.zeros(PAYLOAD, np.uint8)
        for verify in (True, False):
            (got,) = reader.get_into([victim.key], [dst.data], [_expect(victim)], verify)
            assert got.status is TierStatus.MISS
        assert reader.torn == 2
        monkeypatch.setattr(type(reader._pages), "stamped", lambda self, runs, gen: True)
        monkeypatch.setattr(type(reader._pages), "stamped_many", lambda self, extents, gens: [True] * len(extents))
        (got,) = reader.get_into([victim.key], [dst.data], [_expect(victim)], False)
        assert got.status is TierStatus.OK and dst.tobytes() != bytes(victim.payload)
    finally:
        reader.close()
        writer.close()


def test_a_second_view_reads_the_first_ones_objects_and_the_store_keeps_its_size(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    first = HostTier(name, CAPACITY)
    try:
        items = _items(0, 8)
        assert first.put_from(items) == [TierStatus.OK] * 8
        second = HostTier(name, 4 * CAPACITY)  # asks for more: the store keeps the size it was made with
        try:
            assert second.capacity_bytes == CAPACITY
            assert "memory.capacity" in caplog.text
            assert [_load(second, it) for it in items] == [(TierStatus.OK, bytes(it.payload)) for it in items]
            assert second.peek_headers([it.key for it in items]) == [it.header for it in items]
        finally:
            second.close()
    finally:
        first.close()
    again = HostTier(name, CAPACITY)  # the last user's exit left it whole
    try:
        assert _load(again, items[3]) == (TierStatus.OK, bytes(items[3].payload))
    finally:
        again.close()


def test_a_batch_of_stamps_is_written_and_checked_per_extent(name: str) -> None:
    tier = HostTier(name, CAPACITY)
    try:
        pages = tier._pages
        extents = [((7, 3), (2, 2)), ((11, 1),), ((20, 4),)]
        pages.end_writes(extents, [5, 9, 13])
        assert pages.stamps[[7, 8, 9, 2, 3]].tolist() == [5] * 5 and pages.stamps[11] == 9
        assert pages.stamps[20:24].tolist() == [13] * 4 and pages.stamps[[1, 4, 10, 12, 19, 24]].tolist() == [0] * 6
        assert pages.stamped_many(extents, [5, 9, 13]) == [True, True, True]
        pages.stamps[3] = 0  # the last page of the first extent's second run: being rewritten
        assert pages.stamped_many(extents, [5, 9, 13]) == [False, True, True]
        pages.begin_writes([((11, 1),)])
        assert pages.stamped_many(extents, [5, 9, 13]) == [False, False, True]
        assert pages.stamped_many(extents, [5, 9, 14]) == [False, False, False]
    finally:
        tier.close()


def test_a_store_whose_arena_was_removed_starts_again_empty(name: str) -> None:
    """The arena file deleted behind kvpack's back (the index kept): the next open makes a new one and
    forgets what the index held (misses, never bytes of a vanished arena); the pages are whole again."""
    first = HostTier(name, CAPACITY)
    items = _items(0, 4)
    try:
        assert first.put_from(items) == [TierStatus.OK] * 4
    finally:
        first.close()
    os.unlink(os.path.join(host_root(name), ARENA))
    again = HostTier(name, CAPACITY)
    try:
        assert [_load(again, it)[0] for it in items] == [TierStatus.MISS] * 4
        assert _census_whole(again) == (64, 0, 0)
        assert again.put_from(items) == [TierStatus.OK] * 4
        assert _load(again, items[2]) == (TierStatus.OK, bytes(items[2].payload))
    finally:
        again.close()


def test_a_lent_view_is_its_object_until_another_writer_takes_its_pages(name: str) -> None:
    """`HostTier.lend` hands out a payload where it lies in the mapping (no copy): the bytes are
    the object's, and ``held()`` after the caller's copy says so. Once another process's writer
    took the pages (evicted, rewriting them), ``held()`` is False for that object (counted in
    `torn`): the caller's copy is not the object. A load that verifies checksums is never lent
    (its checksum must cover the bytes the caller reads: `get_into` copies, then verifies), so
    a payload damaged in the shared memory is refused there."""
    reader, writer = HostTier(name, CAPACITY), HostTier(name, CAPACITY)
    try:
        a, b, c = _items(0, 3)
        assert writer.put_from([a, b, c]) == [TierStatus.OK] * 3
        verified, _ = reader.lend([a.key, b.key, c.key], [_expect(a), _expect(b), _expect(c)], True)
        assert verified == [None, None, None]
        at = writer._pages.area.tobytes().find(bytes(c.payload))
        writer._pages.area[at + 100] ^= 0xFF  # c's payload damaged in the shared memory
        assert _load(reader, c)[0] is TierStatus.REJECTED
        got, held = reader.lend([a.key, b.key], [_expect(a), _expect(b)], False)
        assert [bytes(lent[1]) if lent else None for lent in got] == [bytes(a.payload), bytes(b.payload)]
        assert held() == [True, True]
        runs = reader._host_catalog.ready_extents([b.key])[0].runs  # type: ignore[union-attr]
        assert writer.remove_groups([b.key.group]) == 1
        writer._pages.begin_writes([runs])  # another object's writer took b's pages
        assert held() == [True, False] and reader.torn == 1
    finally:
        reader.close()
        writer.close()
