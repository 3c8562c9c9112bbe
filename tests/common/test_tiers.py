"""Memory and disk tiers: the shared contract, corruption, restart, concurrency, failure."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fixtures.builders import chunk_id, expect, make_item
from kvpack.config.schema import EvictionPolicyName
from kvpack.identity.keys import GroupKey
from kvpack.identity.objects import RejectReason
from kvpack.policy.eviction import make_policy
from kvpack.tiers.base import Tier, TierStatus
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.disk.fs import MARKER
from kvpack.tiers.memory import MemoryTier

TierFactory = Callable[[int], Tier]


@pytest.fixture(params=["memory", "disk"])
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> TierFactory:
    def build(capacity: int = 1 << 30) -> Tier:
        policy = make_policy(EvictionPolicyName.LRU)
        if request.param == "memory":
            return MemoryTier(capacity, policy, pin=False)
        return DiskTier(tmp_path / "disk", capacity)

    return build


def test_put_contains_get_remove(make_tier: TierFactory) -> None:
    tier = make_tier(1 << 30)
    items = [make_item("t", chunk_id(i), seed=i) for i in range(4)]
    assert tier.put_from([it for it, _ in items]) == [TierStatus.OK] * 4
    assert tier.contains([it.key for it, _ in items]) == [True] * 4
    dsts = [np.full(1024, 0xAB, np.uint8) for _ in items]
    res = tier.get_into(
        [it.key for it, _ in items], [memoryview(d) for d in dsts], [expect(it) for it, _ in items], True
    )
    assert all(r.ok for r in res)
    for (_, payload), dst in zip(items, dsts):
        assert np.array_equal(payload, dst)
    assert tier.remove_groups([items[0][0].key.group]) == 1
    assert tier.contains([items[0][0].key, items[1][0].key]) == [False, True]


def test_caller_buffer_reusable_after_put(make_tier: TierFactory) -> None:
    tier = make_tier(1 << 30)
    item, payload = make_item("t", chunk_id(1))
    original = payload.copy()
    tier.put_from([item])
    payload[:] = 0  # the tier must have taken a copy
    dst = np.empty(1024, np.uint8)
    assert tier.get_into([item.key], [memoryview(dst)], [expect(item)], False)[0].ok
    assert np.array_equal(dst, original)


def test_missing_is_a_miss(make_tier: TierFactory) -> None:
    tier = make_tier(1 << 30)
    item, _ = make_item("t", chunk_id(1))
    res = tier.get_into([item.key], [memoryview(np.empty(1024, np.uint8))], [expect(item)], True)
    assert res[0].status is TierStatus.MISS


def test_wrong_size_destination_is_rejected(make_tier: TierFactory) -> None:
    tier = make_tier(1 << 30)
    item, _ = make_item("t", chunk_id(1))
    tier.put_from([item])
    res = tier.get_into([item.key], [memoryview(np.empty(512, np.uint8))], [expect(item)], True)
    assert res[0].status is TierStatus.REJECTED and res[0].reason is RejectReason.LENGTH


def test_fingerprint_mismatch_is_rejected(make_tier: TierFactory) -> None:
    tier = make_tier(1 << 30)
    item, _ = make_item("t", chunk_id(1))
    tier.put_from([item])
    from dataclasses import replace

    wrong = replace(expect(item), fingerprint="ff" * 16)
    res = tier.get_into([item.key], [memoryview(np.empty(1024, np.uint8))], [wrong], True)
    assert res[0].status is TierStatus.REJECTED and res[0].reason is RejectReason.FINGERPRINT


def test_capacity_evicts_whole_groups(make_tier: TierFactory) -> None:
    tier = make_tier(4 * 1024)
    for i in range(3):
        for member in ("kv", "draft"):
            tier.put_from([make_item("t", chunk_id(i), member, seed=i)[0]])
    usage = tier.usage()
    assert usage.used_bytes <= 4 * 1024
    # Each surviving group has both members: eviction never split one.
    present = {i: tier.contains([make_item("t", chunk_id(i), m)[0].key for m in ("kv", "draft")]) for i in range(3)}
    assert all(p in ([True, True], [False, False]) for p in present.values()), present
    assert present[2] == [True, True] and present[0] == [False, False]


def test_object_larger_than_capacity_is_no_space(make_tier: TierFactory) -> None:
    tier = make_tier(512)
    assert tier.put_from([make_item("t", chunk_id(1))[0]]) == [TierStatus.NO_SPACE]


def test_concurrent_overlapping_puts_and_gets(make_tier: TierFactory) -> None:
    tier = make_tier(1 << 30)
    errors: list[str] = []
    keys = 16

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for step in range(60):
            i = int(rng.integers(keys))
            item, payload = make_item("t", chunk_id(i), seed=i)  # same key -> same bytes
            if step % 2:
                tier.put_from([item])
            else:
                dst = np.full(1024, 0xAB, np.uint8)
                res = tier.get_into([item.key], [memoryview(dst)], [expect(item)], True)[0]
                if res.ok and not np.array_equal(dst, payload):
                    errors.append(f"torn read of {i}")
                elif res.status not in (TierStatus.OK, TierStatus.MISS):
                    errors.append(f"{res.status} for {i}: {res.reason} {res.detail}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # within capacity nothing is lost: every key put is still there
    written = [make_item("t", chunk_id(i), seed=i)[0] for i in range(keys)]
    tier.put_from(written)
    assert all(tier.contains([w.key for w in written]))


# -- disk-only ------------------------------------------------------------------------


def _disk(root: Path, capacity: int = 1 << 30) -> DiskTier:
    return DiskTier(root, capacity)


def _stored_file(tier: DiskTier, item_key) -> Path:  # type: ignore[no-untyped-def]
    return tier.path_of(item_key)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("payload_flip", RejectReason.CHECKSUM),
        ("header_flip", RejectReason.HEADER_CHECKSUM),
        ("truncate", RejectReason.TRUNCATED),
        ("magic", RejectReason.BAD_MAGIC),
    ],
)
def test_disk_corruption_is_a_named_miss(tmp_path: Path, damage: str, reason: RejectReason) -> None:
    tier = _disk(tmp_path)
    item, _ = make_item("t", chunk_id(7))
    tier.put_from([item])
    path = _stored_file(tier, item.key)
    raw = bytearray(path.read_bytes())
    if damage == "payload_flip":
        raw[-10] ^= 0xFF
    elif damage == "header_flip":
        raw[40] ^= 0x01
    elif damage == "truncate":
        raw = raw[:-100]
    elif damage == "magic":
        raw[0:4] = b"PKL\x80"
    path.write_bytes(bytes(raw))
    res = tier.get_into([item.key], [memoryview(np.empty(1024, np.uint8))], [expect(item)], True)[0]
    assert res.status is TierStatus.REJECTED
    assert res.reason is reason


def test_disk_checksum_only_checked_when_asked(tmp_path: Path) -> None:
    # The negative control for the corruption test above: without verification a
    # flipped payload byte goes unnoticed, so the checksum is what catches it.
    tier = _disk(tmp_path)
    item, _ = make_item("t", chunk_id(7))
    tier.put_from([item])
    path = _stored_file(tier, item.key)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert tier.get_into([item.key], [memoryview(np.empty(1024, np.uint8))], [expect(item)], False)[0].ok


def test_disk_restart_finds_every_entry(tmp_path: Path) -> None:
    tier = _disk(tmp_path)
    items = [make_item(t, chunk_id(i), m, seed=i) for t in ("a", "b") for i in range(5) for m in ("kv", "draft")]
    tier.put_from([it for it, _ in items])
    (tmp_path / "a" / "junk.tmp.1.2").write_bytes(b"half")
    reopened = _disk(tmp_path)
    assert reopened.usage().objects == len(items)
    assert reopened.usage().used_bytes == tier.usage().used_bytes
    for it, payload in items:
        dst = np.empty(1024, np.uint8)
        assert reopened.get_into([it.key], [memoryview(dst)], [expect(it)], True)[0].ok
        assert np.array_equal(dst, payload)


def test_disk_restart_drops_corrupt_headers(tmp_path: Path) -> None:
    tier = _disk(tmp_path)
    item, _ = make_item("t", chunk_id(1))
    good, _ = make_item("t", chunk_id(2))
    tier.put_from([item, good])
    path = tier.path_of(item.key)
    path.write_bytes(b"\x80\x04garbage-pickle-like-bytes")
    reopened = _disk(tmp_path)
    assert reopened.startup_rejected == 1
    assert reopened.contains([item.key, good.key]) == [False, True]


class _Bomb:
    """Unpickling this creates `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return (os.system, (f"touch {self.path}",))


def test_a_pickle_written_over_a_stored_object_is_refused_and_never_run(tmp_path: Path) -> None:
    """An object file replaced by a pickle (the stored length kept, so only its own bytes
    can tell) is refused by its magic on load, and nothing unpickles it."""
    import pickle

    tier = _disk(tmp_path / "store")
    item, _ = make_item("t", chunk_id(1))
    assert tier.put_from([item]) == [TierStatus.OK]
    sentinel = tmp_path / "unpickled"
    path = tier.path_of(item.key)
    bomb = pickle.dumps(_Bomb(str(sentinel)))
    path.write_bytes(bomb + bytes(path.stat().st_size - len(bomb)))
    res = tier.get_into([item.key], [memoryview(np.empty(1024, np.uint8))], [expect(item)], True)[0]
    assert res.status is TierStatus.REJECTED and res.reason is RejectReason.BAD_MAGIC, res
    assert not sentinel.exists()


def test_disk_shared_by_two_processes_sees_new_files(tmp_path: Path) -> None:
    writer, reader = _disk(tmp_path), _disk(tmp_path)
    item, payload = make_item("t", chunk_id(3))
    writer.put_from([item])
    assert reader.contains([item.key]) == [True]
    dst = np.empty(1024, np.uint8)
    assert reader.get_into([item.key], [memoryview(dst)], [expect(item)], True)[0].ok
    assert np.array_equal(dst, payload)


def test_disk_directory_removed_mid_run_is_an_error_not_a_crash(tmp_path: Path) -> None:
    root = tmp_path / "store"
    tier = _disk(root)
    item, _ = make_item("t", chunk_id(1))
    tier.put_from([item])
    shutil.rmtree(root)
    res = tier.get_into([item.key], [memoryview(np.empty(1024, np.uint8))], [expect(item)], True)[0]
    assert res.status is TierStatus.MISS
    # writes recreate the folder
    assert tier.put_from([make_item("t", chunk_id(2))[0]]) == [TierStatus.OK]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions; covered by the blocked-path test")
def test_disk_unwritable_directory_is_an_error(tmp_path: Path) -> None:  # pragma: no cover - non-root only
    tier = _disk(tmp_path)
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        assert tier.put_from([make_item("t", chunk_id(1))[0]]) == [TierStatus.ERROR]
    finally:
        tmp_path.chmod(stat.S_IRWXU)


def test_disk_blocked_path_is_an_error_not_a_crash(tmp_path: Path) -> None:
    root = tmp_path / "store"
    tier = _disk(root)
    item, _ = make_item("t", chunk_id(1))
    # A regular file where the tenant folder should be: writes cannot succeed, even as root.
    (root / "t").write_bytes(b"not a folder")
    assert tier.put_from([item]) == [TierStatus.ERROR]
    assert tier.usage().objects == 0


def test_disk_tenants_live_in_separate_folders(tmp_path: Path) -> None:
    tier = _disk(tmp_path)
    a, _ = make_item("alpha", chunk_id(1))
    tier.put_from([a])
    assert (tmp_path / "alpha").is_dir()
    assert not (tmp_path / "beta").exists()
    b_key = type(a.key)("beta", a.key.fingerprint, a.key.chunk, a.key.member)
    assert tier.contains([b_key]) == [False]


def test_memory_recycles_slots_but_never_one_still_borrowed() -> None:
    tier = MemoryTier(1 << 20, make_policy(EvictionPolicyName.LRU), pin=False)
    first, payload = make_item("t", chunk_id(1), seed=1)
    tier.put_from([first])
    borrowed = tier.borrow(first.key)
    assert borrowed is not None
    # Overwrite the key many times: the borrowed slot must never be reused...
    for seed in range(2, 10):
        tier.put_from([make_item("t", chunk_id(1), seed=seed)[0]])
        tier.put_from([make_item("t", chunk_id(2), seed=seed)[0]])
    assert np.array_equal(np.asarray(borrowed[1]), payload)
    reserved = tier._arena.reserved_bytes  # noqa: SLF001 - white-box check of reuse
    # ...and once the borrow ends, it is not lost either: it becomes free again.
    free_before = tier._arena.free_bytes()  # noqa: SLF001
    del borrowed
    assert tier._arena.free_bytes() == free_before + 1024  # noqa: SLF001
    # Unshared slots were reused all along: one slab served every put.
    assert tier._arena.reserved_bytes == reserved  # noqa: SLF001


def test_memory_batch_larger_than_capacity_keeps_what_fits() -> None:
    tier = MemoryTier(4 * 1024, make_policy(EvictionPolicyName.LRU), pin=False)
    items = [make_item("t", chunk_id(i), seed=i) for i in range(6)]
    statuses = tier.put_from([it for it, _ in items])
    # the first two were evicted by later items of the same batch before they were visible
    assert statuses == [TierStatus.NO_SPACE] * 2 + [TierStatus.OK] * 4
    for (it, payload), st in zip(items, statuses):
        dst = np.empty(1024, np.uint8)
        res = tier.get_into([it.key], [memoryview(dst)], [expect(it)], False)[0]
        assert res.ok == (st is TierStatus.OK)
        if res.ok:
            assert np.array_equal(dst, payload)
    assert tier.usage().used_bytes == 4 * 1024


def test_memory_multi_region_payloads_round_trip() -> None:
    tier = MemoryTier(1 << 20, make_policy(EvictionPolicyName.LRU), pin=False)
    item, payload = make_item("t", chunk_id(1))
    k, v = memoryview(payload[:300]), memoryview(payload[300:])
    from dataclasses import replace

    assert tier.put_from([replace(item, payload=(k, v))]) == [TierStatus.OK]
    a, b = np.full(700, 1, np.uint8), np.full(324, 2, np.uint8)
    assert tier.get_into([item.key], [(memoryview(a), memoryview(b))], [expect(item)], True)[0].ok
    assert np.array_equal(np.concatenate([a, b]), payload)


def test_disk_batch_larger_than_capacity_leaves_no_stray_files(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "disk", 4 * 1024, io_threads=2)
    items = [make_item("t", chunk_id(i), seed=i) for i in range(6)]
    statuses = tier.put_from([it for it, _ in items])
    # admitted one by one: the first two were evicted by later items of the batch
    assert statuses == [TierStatus.NO_SPACE] * 2 + [TierStatus.OK] * 4
    files = sorted(p.name for p in (tmp_path / "disk").rglob("*") if p.is_file() and not p.name.startswith(MARKER))
    assert len(files) == 4 and tier.usage().used_bytes == 4 * 1024
    assert tier.contains([it.key for it, _ in items]) == [False] * 2 + [True] * 4


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_batches_on_two_io_threads_round_trip_in_order(tmp_path: Path, kind: str) -> None:
    """Batches big enough to be split over the tier's threads (1 MiB objects, multi-region)."""
    policy = make_policy(EvictionPolicyName.LRU)
    tier: Tier = (
        MemoryTier(1 << 30, policy, pin=False, copy_threads=2)
        if kind == "memory"
        else DiskTier(tmp_path / "disk", 1 << 30, io_threads=2)
    )
    from dataclasses import replace

    items = [make_item("t", chunk_id(i), seed=i, nbytes=1 << 20) for i in range(12)]
    split = [replace(it, payload=(memoryview(p[:4096]), memoryview(p[4096:]))) for it, p in items]
    assert tier.put_from(split) == [TierStatus.OK] * 12
    dsts = [np.zeros(1 << 20, np.uint8) for _ in items]
    got = tier.get_into(
        [it.key for it, _ in items], [memoryview(d) for d in dsts], [expect(it) for it, _ in items], True
    )
    assert [r.status for r in got] == [TierStatus.OK] * 12
    for d, (_, p) in zip(dsts, items):
        assert np.array_equal(d, p)
    tier.close()


def test_memory_batch_eviction_reports_every_group_and_recycles_every_slot_but_a_lent_one() -> None:
    """A batch that evicts many groups at once (`MemoryTier._drop_groups_locked`, one
    `SlabArena.release_many`): each victim group is reported once with its bytes, in the
    policy's order, the victims are gone and the batch is stored, every victim's slot is
    reused by the next batch without a new slab, except one still lent, which keeps its
    bytes until the view goes and is then free again."""
    tier = MemoryTier(8 * 1024, make_policy(EvictionPolicyName.LRU), pin=False)
    heard: list[tuple[GroupKey, int]] = []
    tier.on_evict = lambda group, nbytes: heard.append((group, nbytes))
    old = [make_item("t", chunk_id(i), seed=i) for i in range(8)]
    assert tier.put_from([it for it, _ in old]) == [TierStatus.OK] * 8
    lent = tier.lend([old[2][0].key], [expect(old[2][0])])[0]
    assert lent is not None
    reserved = tier._arena.reserved_bytes  # noqa: SLF001 - white-box check of reuse
    new = [make_item("t", chunk_id(100 + i), seed=100 + i) for i in range(5)]
    assert tier.put_from([it for it, _ in new]) == [TierStatus.OK] * 5
    victims = [old[i][0].key.group for i in (0, 1, 3, 4, 5)]  # LRU order; the lend touched chunk 2
    assert heard == [(g, 1024) for g in victims]  # every field of each group (built from the tier's ids)
    assert {g: 1 for g, _ in heard} == dict.fromkeys(victims, 1)  # and hashed as the constructor's
    assert tier.contains([it.key for it, _ in old]) == [i in (2, 6, 7) for i in range(8)]
    assert tier.contains([it.key for it, _ in new]) == [True] * 5
    assert tier._arena.reserved_bytes == reserved  # noqa: SLF001 - no slab for the new batch
    assert tier.remove_groups([old[2][0].key.group]) == 1  # the lent object's group goes...
    assert np.array_equal(np.asarray(lent[1]), old[2][1])  # ...its lent view still reads its bytes
    free = tier._arena.free_bytes()  # noqa: SLF001
    del lent
    assert tier._arena.free_bytes() == free + 1024  # noqa: SLF001
