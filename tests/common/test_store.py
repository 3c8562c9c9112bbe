"""KVStore: groups, draft policy, tenants, tails, read-through, back-pressure, broken tiers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from fixtures.builders import GROUP_FP, MEMBER_FP, chunk_id, expect, make_item
from fixtures.tiers import BrokenTier, SlowTier
from kvpack import KVPackConfig, KVStore, LoadItem, MemberRole, MemberSpec, StoreKey, TierStatus
from kvpack.identity.objects import Expectation, RejectReason
from kvpack.policy.tails import tail_chunk
from kvpack.tiers.base import PutItem, Tier
from kvpack.tiers.factory import build_tiers

KV = MemberSpec("kv", MEMBER_FP, MemberRole.TARGET)
DRAFT = MemberSpec("draft", MEMBER_FP, MemberRole.DRAFT)


@pytest.fixture
def keep() -> Iterator[Callable[[KVStore], KVStore]]:
    """`keep(store)` returns `store` and closes it after the test, also when the test fails."""
    opened: list[KVStore] = []

    def register(store: KVStore) -> KVStore:
        opened.append(store)
        return store

    yield register
    for store in reversed(opened):
        store.close()


@pytest.fixture
def make_store(keep: Callable[[KVStore], KVStore]) -> Callable[..., KVStore]:
    """`make_store(tmp_path, **overrides)`: memory + disk under `tmp_path`, closed after the test."""

    def make(tmp_path: Path, **overrides: object) -> KVStore:
        data: dict = {"disk": {"path": str(tmp_path / "disk")}, "memory": {"capacity": "64MiB"}}
        data.update(overrides)
        return keep(KVStore.from_config(KVPackConfig.from_dict(data)))

    return make


def put_chunks(store: KVStore, tenant: str, n: int, members: Sequence[str] = ("kv",), start: int = 0) -> None:
    items = [
        make_item(tenant, chunk_id(i), m, seed=i, checksum=False)[0] for i in range(start, start + n) for m in members
    ]
    assert store.store(items) == [TierStatus.OK] * len(items)
    assert store.flush(10)


def test_full_hit_needs_every_member(tmp_path: Path, make_store: Callable[..., KVStore]) -> None:
    store = make_store(tmp_path)
    put_chunks(store, "t", 4, ("kv", "draft"))
    put_chunks(store, "t", 2, ("kv",), start=4)  # target only: draft missing for chunks 4, 5
    chunks = [chunk_id(i) for i in range(8)]
    res = store.lookup("t", GROUP_FP, chunks, [KV, DRAFT], 16)
    assert (res.full_chunks, res.target_chunks, res.hit_chunks) == (4, 6, 4)
    assert res.partial and res.missing == {"draft": 2}
    assert store.metrics.value("partial_hits", missing_member="draft") == 2
    assert store.metrics.value("hit_tokens", tenant="t") == 64
    assert store.metrics.value("full_hits") == 0  # a partial lookup is never counted as full


def test_target_only_policy_reports_target_prefix_and_counts_partial(
    tmp_path: Path, make_store: Callable[..., KVStore]
) -> None:
    store = make_store(tmp_path, draft_policy="target_only")
    put_chunks(store, "t", 2, ("kv", "draft"))
    put_chunks(store, "t", 2, ("kv",), start=2)
    res = store.lookup("t", GROUP_FP, [chunk_id(i) for i in range(4)], [KV, DRAFT], 16)
    assert res.hit_chunks == 4 and res.full_chunks == 2
    assert res.members_to_load(0) == ("kv", "draft")
    assert res.members_to_load(3) == ("kv",)
    assert store.metrics.value("partial_hits", missing_member="draft") == 2


def test_no_draft_member_means_no_extra_cost(tmp_path: Path, make_store: Callable[..., KVStore]) -> None:
    store = make_store(tmp_path)
    put_chunks(store, "t", 3)
    res = store.lookup("t", GROUP_FP, [chunk_id(i) for i in range(3)], [KV], 16)
    assert res.hit_chunks == 3 and not res.partial
    assert store.metrics.value("full_hits", tenant="t") == 1


@pytest.mark.parametrize("tiers", [("memory",), ("disk",), ("memory", "disk")])
def test_tenants_never_see_each_other(
    tmp_path: Path, tiers: tuple[str, ...], make_store: Callable[..., KVStore]
) -> None:
    store = make_store(
        tmp_path, memory={"enabled": "memory" in tiers}, disk={"enabled": "disk" in tiers, "path": str(tmp_path / "d")}
    )
    put_chunks(store, "alpha", 3)
    chunks = [chunk_id(i) for i in range(3)]
    assert store.lookup("alpha", GROUP_FP, chunks, [KV], 16).hit_chunks == 3
    assert store.lookup("beta", GROUP_FP, chunks, [KV], 16).hit_chunks == 0
    # even asking for alpha's exact object with beta's key finds nothing
    item, _ = make_item("alpha", chunk_id(0))
    beta_key = StoreKey("beta", GROUP_FP, chunk_id(0), "kv")
    res = store.load(
        [LoadItem(beta_key, memoryview(np.empty(1024, np.uint8)), Expectation(MEMBER_FP, "beta", chunk_id(0), "kv"))]
    )
    assert not res[0].ok


def test_load_read_through_and_promotion(tmp_path: Path, make_store: Callable[..., KVStore]) -> None:
    store = make_store(tmp_path)
    item, payload = make_item("t", chunk_id(1), checksum=False)
    store.store([item])
    store.flush(10)
    store.tiers[0].remove_groups([item.key.group])  # only on disk now
    dst = np.zeros(1024, np.uint8)
    assert store.load([LoadItem(item.key, memoryview(dst), expect(item))])[0].ok
    assert np.array_equal(dst, payload)
    assert store.tiers[0].contains([item.key]) == [True]  # promoted
    assert store.metrics.value("loaded_bytes", tier="disk") == 1024


def test_corrupt_disk_object_is_refused_and_counted(tmp_path: Path, make_store: Callable[..., KVStore]) -> None:
    store = make_store(tmp_path, memory={"enabled": False})
    item, _ = make_item("t", chunk_id(1), checksum=False)
    store.store([item])
    store.flush(10)
    disk = store.tiers[0]
    path = disk.path_of(item.key)  # type: ignore[attr-defined]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x55
    path.write_bytes(bytes(raw))
    res = store.load([LoadItem(item.key, memoryview(np.empty(1024, np.uint8)), expect(item))])[0]
    assert res.status is TierStatus.REJECTED and res.reason is RejectReason.CHECKSUM
    assert store.metrics.value("rejected_objects", reason="checksum") == 1
    assert store.metrics.value("load_failures", tenant="t") == 1
    # the damaged object is gone, so it is not looked up and refused again
    assert not path.exists()
    assert store.lookup("t", GROUP_FP, [chunk_id(1)], [KV], 16).hit_chunks == 0
    assert store.store([item]) == [TierStatus.OK]
    assert store.load([LoadItem(item.key, memoryview(np.empty(1024, np.uint8)), expect(item))])[0].ok


def test_tail_longest_common_prefix_rounded_to_unit(tmp_path: Path, make_store: Callable[..., KVStore]) -> None:
    store = make_store(tmp_path)
    parent = chunk_id(9)
    tail_tokens = tuple(range(100, 140))  # 40 computed tokens of a partial block
    item, _ = make_item("t", tail_chunk(parent), "kv", token_ids=tail_tokens, token_count=40, checksum=False)
    store.store([item])
    query = list(range(100, 123)) + [7, 7, 7]  # shares 23 tokens
    match = store.tails.find("t", GROUP_FP, parent, query, [KV], match_unit=1)
    assert match is not None and match.tokens == 23 and match.stored_tokens == 40
    assert store.tails.find("t", GROUP_FP, parent, query, [KV], match_unit=8).tokens == 16  # type: ignore[union-attr]
    assert store.tails.find("t", GROUP_FP, parent, [1, 2, 3], [KV], 1) is None
    assert store.tails.find("other", GROUP_FP, parent, query, [KV], 1) is None
    assert store.tails.find("t", GROUP_FP, chunk_id(8), query, [KV], 1) is None


def test_tail_overwritten_between_lookup_and_load_is_refused(
    tmp_path: Path, make_store: Callable[..., KVStore]
) -> None:
    store = make_store(tmp_path)
    chunk = tail_chunk(None)
    first, _ = make_item("t", chunk, token_ids=tuple(range(20)), token_count=20, checksum=False)
    store.store([first])
    match = store.tails.find("t", GROUP_FP, None, list(range(20)), [KV], 1)
    assert match is not None
    second, _ = make_item("t", chunk, seed=5, token_ids=tuple(range(50, 70)), token_count=20, checksum=False)
    store.store([second])
    assert store.flush(10)  # every tier now holds the second tail
    exp = Expectation(MEMBER_FP, "t", chunk, "kv", token_ids_prefix=match.token_ids[: match.tokens])
    res = store.load([LoadItem(first.key, memoryview(np.empty(1024, np.uint8)), exp)])[0]
    assert res.status is TierStatus.REJECTED and res.reason is RejectReason.TOKENS


def test_tail_needs_draft_member_under_recompute(tmp_path: Path, make_store: Callable[..., KVStore]) -> None:
    store = make_store(tmp_path)
    chunk = tail_chunk(None)
    store.store([make_item("t", chunk, "kv", token_ids=(1, 2, 3, 4), token_count=4, checksum=False)[0]])
    assert store.tails.find("t", GROUP_FP, None, [1, 2, 3, 4], [KV, DRAFT], 1) is None
    assert store.metrics.value("partial_hits", missing_member="draft") == 1
    store.store([make_item("t", chunk, "draft", token_ids=(1, 2, 3, 4), token_count=4, checksum=False)[0]])
    match = store.tails.find("t", GROUP_FP, None, [1, 2, 3, 4], [KV, DRAFT], 1)
    assert match is not None and match.members == ("kv", "draft")


def test_wait_budget_bounds_a_steps_remote_waits(tmp_path: Path, keep: Callable[[KVStore], KVStore]) -> None:
    """A remote tier that answers every call just inside its own bound would still stall an
    engine step by the sum of its calls. Once the step's budget is spent, lookups skip it
    (fewer hits, counted, never a longer step); the next step asks it again. Local tiers
    are always asked."""
    from kvpack.config.schema import EvictionPolicyName
    from kvpack.policy.budget import WaitBudget
    from kvpack.policy.eviction import make_policy
    from kvpack.tiers.disk import DiskTier
    from kvpack.tiers.memory import MemoryTier

    remote = SlowTier(
        DiskTier(tmp_path / "remote", 1 << 30),
        0.0,
        lookup_delay_s=0.2,
        remote=True,
    )
    memory = MemoryTier(1 << 26, make_policy(EvictionPolicyName.LRU), pin=False)
    store = keep(KVStore(KVPackConfig(), [memory, remote]))
    items = [make_item("t", chunk_id(i), checksum=False)[0] for i in range(4)]
    assert remote.inner.put_from(items[:3]) == [TierStatus.OK] * 3  # chunks 0-2 only remote
    assert memory.put_from(items[3:]) == [TierStatus.OK]  # chunk 3 only local
    tail, _ = make_item("t", tail_chunk(chunk_id(2)), checksum=False, token_ids=(5, 6, 7), token_count=3)
    assert remote.inner.put_from([tail]) == [TierStatus.OK]
    chunks = [chunk_id(i) for i in range(3)]

    budget = WaitBudget(0.3)
    start = time.monotonic()
    hits = [store.lookup("t", GROUP_FP, chunks, [KV], 16, budget).hit_chunks for _ in range(10)]
    took = time.monotonic() - start
    assert hits[0] == 3, "the remote tier is asked while the budget lasts"
    assert hits[-1] == 0, "a spent budget skips the remote tier"
    assert remote.lookup_calls <= 3, remote.lookup_calls  # 0.2 s each: the third starts after 0.3 s
    assert store.metrics.value("budget_skips", tier="slow") == 10 - remote.lookup_calls
    assert took < 1.5, f"ten lookups took {took:.2f}s: the budget did not bound them (unbounded: 2.0 s)"
    assert store.tails.find("t", GROUP_FP, chunk_id(2), [5, 6, 7], [KV], 1, budget) is None
    assert store.contains([items[3].key], budget) == [True], "local tiers are asked past the budget"

    budget.renew()  # the next engine step
    assert store.lookup("t", GROUP_FP, chunks, [KV], 16, budget).hit_chunks == 3
    match = store.tails.find("t", GROUP_FP, chunk_id(2), [5, 6, 7], [KV], 1, budget)
    assert match is not None and match.tokens == 3


def test_a_load_inside_an_engine_step_never_waits_on_a_remote_tier(
    tmp_path: Path, keep: Callable[[KVStore], KVStore]
) -> None:
    """`complete_load(local_only=True)` (vLLM's loads inside a step): an object only a remote
    tier holds is a miss and the remote tier is not asked (its read would hold the step up to
    the tier's bound, once per load in that step); off the step the same load reads it."""
    from kvpack.config.schema import EvictionPolicyName
    from kvpack.policy.eviction import make_policy
    from kvpack.tiers.disk import DiskTier
    from kvpack.tiers.memory import MemoryTier

    remote = SlowTier(DiskTier(tmp_path / "remote", 1 << 30), 0.0, remote=True, get_delay_s=0.2)
    memory = MemoryTier(1 << 26, make_policy(EvictionPolicyName.LRU), pin=False)
    store = keep(KVStore(KVPackConfig(), [memory, remote]))
    (far, far_data), (near, near_data) = make_item("t", chunk_id(0), seed=1), make_item("t", chunk_id(1), seed=2)
    assert remote.inner.put_from([far]) == [TierStatus.OK]
    assert memory.put_from([near]) == [TierStatus.OK]

    def load(local_only: bool) -> tuple[list[TierStatus], list[np.ndarray]]:
        dsts = [np.zeros(it.nbytes, np.uint8) for it in (far, near)]
        items = [LoadItem(it.key, d.data, expect(it)) for it, d in zip((far, near), dsts)]
        got = store.complete_load(store.prepare_load([far.key, near.key]), items, local_only=local_only)
        return [r.status for r in got], dsts

    statuses, dsts = load(local_only=True)
    assert statuses == [TierStatus.MISS, TierStatus.OK]
    assert np.array_equal(dsts[1], near_data)
    assert remote.get_calls == 0
    statuses, dsts = load(local_only=False)
    assert statuses == [TierStatus.OK, TierStatus.OK]
    assert np.array_equal(dsts[0], far_data) and remote.get_calls == 1


def test_a_write_back_thread_writes_what_is_queued_as_one_batch_newest_per_key() -> None:
    """Objects queued while a write-back thread writes reach its next call together (one index
    transaction per tier); of two stores of one key in that batch only the newer is written."""
    from dataclasses import replace

    from kvpack.store.writeback import WriteBack

    started, held = threading.Event(), threading.Event()
    calls: list[list[tuple[str, int | None]]] = []

    def write(items: list[PutItem]) -> None:
        calls.append([(it.key.chunk, it.accepted_ns) for it in items])
        started.set()
        assert held.wait(10.0)

    back = WriteBack(1, 64, write)
    try:
        first = replace(make_item("t", chunk_id(9))[0], accepted_ns=0)
        assert back.enqueue(first)
        assert started.wait(10.0)  # the thread writes `first` and holds there
        for n, c in enumerate([0, 1, 2, 0, 1], start=1):
            assert back.enqueue(replace(make_item("t", chunk_id(c), seed=n)[0], accepted_ns=n))
        held.set()
        assert back.flush(10.0) and back.pending == 0
    finally:
        held.set()
        back.close()
    assert calls == [[(chunk_id(9), 0)], [(chunk_id(0), 4), (chunk_id(1), 5), (chunk_id(2), 3)]]


def test_a_write_back_batch_stays_within_its_byte_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch is cut at `MAX_BATCH_BYTES` (a remote put has one deadline per call): five queued
    objects of 1 KiB under a 2 KiB bound arrive as 2 + 2 + 1, in order."""
    from kvpack.store.writeback import WriteBack

    monkeypatch.setattr("kvpack.store.writeback.MAX_BATCH_BYTES", 2048)
    started, held = threading.Event(), threading.Event()
    calls: list[list[str]] = []

    def write(items: list[PutItem]) -> None:
        calls.append([it.key.chunk for it in items])
        started.set()
        assert held.wait(10.0)

    back = WriteBack(1, 64, write)
    try:
        assert back.enqueue(make_item("t", chunk_id(9))[0])
        assert started.wait(10.0)
        for c in range(5):
            assert back.enqueue(make_item("t", chunk_id(c), nbytes=1024)[0])
        held.set()
        assert back.flush(10.0)
    finally:
        held.set()
        back.close()
    assert calls[1:] == [[chunk_id(0), chunk_id(1)], [chunk_id(2), chunk_id(3)], [chunk_id(4)]]


def test_find_tail_reads_every_slot_in_one_call_per_tier(tmp_path: Path, keep: Callable[[KVStore], KVStore]) -> None:
    """Tail lookups run on the engine's scheduler thread: all slots and members of a
    parent are peeked in one batched call per tier, not one call per slot and member."""
    from kvpack.tiers.disk import DiskTier

    remote = SlowTier(DiskTier(tmp_path / "remote", 1 << 30), 0.0, remote=True)
    store = keep(KVStore(KVPackConfig(), [remote]))
    for slot, ids in enumerate([(1, 2, 3), (1, 2, 9, 9)]):
        for member in ("kv", "draft"):
            item, _ = make_item(
                "t", tail_chunk(chunk_id(0), slot), member, checksum=False, token_ids=ids, token_count=len(ids)
            )
            assert remote.put_from([item]) == [TierStatus.OK]
    match = store.tails.find("t", GROUP_FP, chunk_id(0), [1, 2, 9, 9, 4], [KV, DRAFT], 1)
    assert match is not None and match.tokens == 4 and set(match.members) == {"kv", "draft"}
    assert remote.lookup_calls == 1
    chunk, stored = store.tails.place("t", GROUP_FP, chunk_id(0), ["kv", "draft"], [1, 2, 3])
    assert (chunk, stored) == (tail_chunk(chunk_id(0), 0), True)
    assert remote.lookup_calls == 2


def test_backpressure_drops_and_counts_instead_of_blocking(tmp_path: Path, keep: Callable[[KVStore], KVStore]) -> None:
    from kvpack.config.schema import EvictionPolicyName
    from kvpack.policy.eviction import make_policy
    from kvpack.tiers.disk import DiskTier
    from kvpack.tiers.memory import MemoryTier

    depth = 4
    cfg = KVPackConfig.from_dict({"write_queue_depth": depth, "io_threads": 1})
    gate = threading.Event()
    slow = SlowTier(DiskTier(tmp_path, 1 << 30), 0.0, gate)
    store = keep(KVStore(cfg, [MemoryTier(1 << 26, make_policy(EvictionPolicyName.LRU), pin=False), slow]))
    items = [make_item("t", chunk_id(i), checksum=False)[0] for i in range(20)]
    start = time.perf_counter()
    statuses = store.store(items)
    elapsed = time.perf_counter() - start
    gate.set()
    assert statuses == [TierStatus.OK] * 20  # memory took them all
    dropped = int(store.metrics.value("store_dropped", tier="slow", reason="backpressure"))
    # Accepted: the queue's `depth`, plus the one batch the write-back thread took before the gated
    # write held it (it takes what its queue holds at that moment: none yet, or 1 to `depth`).
    assert depth <= 20 - dropped <= 2 * depth, dropped
    assert elapsed < 5  # did not wait for the gated tier (generous; not a timing assert of speed)
    assert store.flush(10)
    assert sum(slow.contains([it.key for it in items])) == 20 - dropped  # every accepted one arrived


def test_a_tier_that_raises_degrades_to_a_miss(tmp_path: Path, keep: Callable[[KVStore], KVStore]) -> None:
    from kvpack.config.schema import EvictionPolicyName
    from kvpack.policy.eviction import make_policy
    from kvpack.tiers.memory import MemoryTier

    cfg = KVPackConfig.from_dict({})
    store = keep(
        KVStore(cfg, [MemoryTier(1 << 26, make_policy(EvictionPolicyName.LRU), pin=False), BrokenTier(None, 0)])
    )  # type: ignore[arg-type]
    item, payload = make_item("t", chunk_id(1), checksum=False)
    assert store.store([item]) == [TierStatus.OK]
    assert store.flush(5)
    assert store.lookup("t", GROUP_FP, [chunk_id(1), chunk_id(2)], [KV], 16).hit_chunks == 1
    other, _ = make_item("t", chunk_id(2))
    res = store.load([LoadItem(other.key, memoryview(np.empty(1024, np.uint8)), expect(other))])
    assert res[0].status is TierStatus.ERROR
    assert store.metrics.value("tier_errors", tier="broken") >= 2
    store.close()


def test_closed_store_refuses_stores(tmp_path: Path, make_store: Callable[..., KVStore]) -> None:
    store = make_store(tmp_path)
    store.close()
    assert store.store([make_item("t", chunk_id(1))[0]]) == [TierStatus.UNAVAILABLE]


def test_metrics_served_on_first_free_port(tmp_path: Path, make_store: Callable[..., KVStore]) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
        # base is taken by this socket while it is open: the store takes the next one
        s.listen()
        store = make_store(tmp_path, metrics_port=base)
        assert store.metrics_port is not None and store.metrics_port != base
        put_chunks(store, "acme", 1)
        body = urllib.request.urlopen(f"http://127.0.0.1:{store.metrics_port}/metrics", timeout=5).read().decode()
    assert 'kvpack_stored_objects_total{tenant="acme",tier="memory"} 1.0' in body
    store.close()


def test_regression_writeback_keeps_per_key_order(tmp_path: Path, make_store: Callable[..., KVStore]) -> None:
    # Found by test_tail_overwritten...: with several write-back threads, an older
    # store of a key could reach disk after a newer one and win.
    store = make_store(tmp_path, io_threads=4)
    versions = [make_item("t", chunk_id(1), seed=s, checksum=False) for s in range(40)]
    for item, _ in versions:
        store.store([item])
    assert store.flush(20)
    disk = store.tiers[1]
    dst = np.empty(1024, np.uint8)
    assert disk.get_into([versions[-1][0].key], [memoryview(dst)], [expect(versions[-1][0])], True)[0].ok
    assert np.array_equal(dst, versions[-1][1])


class LaggingDisk(SlowTier):
    """The real disk tier, whose put of `held` waits until the put of `after` has returned: a
    write-back thread that lags behind another one."""

    name = "disk"

    def __init__(self, inner: Tier, held: StoreKey, after: StoreKey) -> None:
        super().__init__(inner, 0.0)
        self.held, self.after, self.passed = held, after, threading.Event()

    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        if any(it.key == self.held for it in items):
            assert self.passed.wait(10), "the put of `after` never came"
        out = self.inner.put_from(items)
        if any(it.key == self.after for it in items):
            self.passed.set()
        return out


def test_regression_newest_store_evicted_when_writeback_reorders(tmp_path: Path, keep: Callable[..., KVStore]) -> None:
    # Found by test_lookups_only_see_own_entries (a FlakyFailure): the write-back's threads reach the
    # disk in their own order; older stores admitted after the newest evicted it as the least recent
    # one, and once reads pushed it out of memory its owner missed it.
    config = KVPackConfig.from_dict(
        {"io_threads": 2, "memory": {"capacity": "64MiB"}, "disk": {"path": str(tmp_path / "d"), "capacity": "4KiB"}}
    )
    memory, disk = build_tiers(config)
    items = [make_item("t", chunk_id(i), seed=i, checksum=False) for i in range(64)]
    # a key always goes to write-back thread hash(key) % io_threads: four older stores on one, the newest on the other
    older = [it for it in items if hash(it[0].key) % 2 == 0][:4]
    newest = next(it for it in items if hash(it[0].key) % 2 == 1)
    store = keep(KVStore(config, [memory, LaggingDisk(disk, held=older[0][0].key, after=newest[0].key)]))
    for item, _ in [*older, newest]:
        assert store.store([item]) == [TierStatus.OK]
    assert store.flush(10)
    # the disk holds 4 objects: it keeps the 4 newest stores, whatever order they reached it in
    assert disk.contains([it.key for it, _ in [*older, newest]]) == [False, True, True, True, True]
    memory.remove_groups([newest[0].key.group])  # out of memory: the owner loads it from disk
    dst = np.empty(1024, np.uint8)
    assert store.load([LoadItem(newest[0].key, dst.data, expect(newest[0]))])[0].ok
    assert np.array_equal(dst, newest[1])


def test_regression_concurrent_continuations_keep_their_own_tails(
    tmp_path: Path, make_store: Callable[..., KVStore]
) -> None:
    # Found by the demo and the soak: one tail per parent meant requests that share a
    # prefix overwrote each other's tail, and a repeated prompt lost its n-1 hit.
    store = make_store(tmp_path)
    parent = chunk_id(3)
    tails = [tuple(range(100, 110)) + (i,) * 5 for i in range(3)]  # share 10 tokens, then diverge
    for i, ids in enumerate(tails):
        chunk, stored = store.tails.place("t", GROUP_FP, parent, ["kv"], ids)
        assert not stored
        store.store([make_item("t", chunk, token_ids=ids, token_count=len(ids), seed=i, checksum=False)[0]])
    assert store.flush(10)
    for ids in tails:
        match = store.tails.find("t", GROUP_FP, parent, list(ids), [KV], 1)
        assert match is not None and match.tokens == len(ids) and match.token_ids == ids
        assert store.tails.place("t", GROUP_FP, parent, ["kv"], ids)[1]  # already stored: nothing to write
    # a continuation of tail 0 replaces it rather than taking another slot
    longer = tails[0] + (42,)
    chunk, stored = store.tails.place("t", GROUP_FP, parent, ["kv"], longer)
    assert not stored and chunk == store.tails.find("t", GROUP_FP, parent, list(tails[0]), [KV], 1).chunk  # type: ignore[union-attr]


def test_evictions_are_counted_per_tenant(tmp_path: Path, make_store: Callable[..., KVStore]) -> None:
    store = make_store(tmp_path, memory={"capacity": "4KiB"}, disk={"enabled": False})
    for i in range(6):  # 6 KiB into a 4 KiB tier, one store at a time: two groups must go
        put_chunks(store, "acme", 1, start=i)
    assert store.metrics.value("evictions", tier="memory", tenant="acme") == 2
    assert store.metrics.value("evicted_bytes", tier="memory") == 2 * 1024


@pytest.mark.parametrize("memory", [True, False])
def test_batches_on_two_copy_threads_store_and_load_bit_exact(
    tmp_path: Path, memory: bool, keep: Callable[[KVStore], KVStore]
) -> None:
    """A store built with copy_threads=2 (the SGLang backend's setting): one batch of
    multi-region objects big enough to be split, through memory+disk or disk alone."""
    data: dict = {"disk": {"path": str(tmp_path / "disk")}, "memory": {"capacity": "256MiB", "enabled": memory}}
    store = keep(KVStore.from_config(KVPackConfig.from_dict(data), copy_threads=2))
    made = [make_item("t", chunk_id(i), seed=i, nbytes=1 << 20, checksum=False) for i in range(10)]
    items = [PutItem(it.key, it.header, (memoryview(p[:1000]), memoryview(p[1000:]))) for it, p in made]
    assert store.store(items) == [TierStatus.OK] * 10
    assert store.flush(10)
    assert store.contains([it.key for it in items]) == [True] * 10
    dsts = [np.zeros(1 << 20, np.uint8) for _ in made]
    got = store.load([LoadItem(it.key, memoryview(d), expect(it)) for it, d in zip(items, dsts)])
    assert all(r.ok for r in got)
    assert all(np.array_equal(d, p) for d, (_, p) in zip(dsts, made))
    assert store.metrics.value("loaded_bytes", tenant="t") == 10 << 20
    store.close()
