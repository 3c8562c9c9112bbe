"""`kvpack.Session`, the one door adapters use into the core, over real tiers.

The session builds keys, headers and expectations from engine facts; these tests drive
it the way the adapters do (pages of one member, objects with their own token facts,
two-phase loads) and check what lands in the tiers and what comes back: exact bytes,
refusals of another layout or tenant, de-duplicated saves, and the located hints a
lookup leaves for the load that follows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from fixtures.builders import GROUP_FP, MEMBER_FP, TOKENS, chunk_id
from kvpack import (
    ChunkFacts,
    KVPackConfig,
    KVStore,
    MemberObject,
    MemberRole,
    MemberSpec,
    ObjectIO,
    RejectReason,
    ReportedMemoryIndex,
    Session,
    StoreKey,
    TierStatus,
    validate_chunk_hashes,
)
from kvpack.store.located import LocatedHints
from kvpack.tiers.factory import build_tiers
from kvpack.transfers.handoffs import HandoffWaits
from kvpack.transfers.jobs import LoadJob, LoadTask, PlannedLoad

PAGE = 512
KV = MemberObject("kv", MEMBER_FP, TOKENS, PAGE)
OTHER_LAYOUT = MemberObject("kv", "ab" * 16, TOKENS, PAGE)


@pytest.fixture
def make_session(tmp_path: Path) -> Iterator[Callable[..., Session]]:
    opened: list[KVStore] = []

    def make(memory: bool = True, disk: bool = True) -> Session:
        config = KVPackConfig.from_dict(
            {
                "memory": {"enabled": memory, "capacity": 1 << 20},
                "disk": {"enabled": disk, "path": str(tmp_path / "disk")},
            }
        )
        store = KVStore(config, build_tiers(config))
        opened.append(store)
        return Session(store, GROUP_FP)

    yield make
    for store in reversed(opened):
        store.close()


def pages(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(n)]


def save(
    session: Session, tenant: str, chunks: Sequence[str], data: Sequence[np.ndarray]
) -> tuple[list[bool], list[int]]:
    asked: list[int] = []

    def payloads_of(todo: Sequence[int]) -> list[memoryview]:
        asked.extend(todo)
        return [memoryview(data[i]) for i in todo]

    return session.save_pages(tenant, KV, chunks, payloads_of), asked


def test_keys_asked_again_are_the_same_keys_and_a_changed_field_rebuilds_them(
    make_session: Callable[..., Session],
) -> None:
    """`Session.keys` keeps its last batch (a load asks for the same keys twice): asked
    again it returns equal keys in a fresh list; another tenant, member, group fingerprint
    or chunk list gives that field's keys, and a bad chunk is refused as before."""
    session = make_session(disk=False)
    chunks = [chunk_id(i) for i in range(4)]
    first = session._keys("t", chunks, "kv")
    again = session._keys("t", list(chunks), "kv")
    assert again == first and again is not first
    again.append(first[0])
    assert session._keys("t", chunks, "kv") == first
    # each call changes one field of the call before it
    assert [k.member for k in session._keys("t", chunks, "draft")] == ["draft"] * 4
    session.bind_group("cd" * 16)
    assert {k.fingerprint for k in session._keys("t", chunks, "draft")} == {"cd" * 16}
    assert [k.tenant for k in session._keys("u", chunks, "draft")] == ["u"] * 4
    assert [k.chunk for k in session._keys("u", chunks[::-1], "draft")] == chunks[::-1]
    with pytest.raises(ValueError):
        session._keys("t", [*chunks[:3], "not a chunk hash"], "kv")


def test_pages_round_trip_and_saves_are_deduplicated(make_session: Callable[..., Session]) -> None:
    session = make_session()
    chunks = [chunk_id(i) for i in range(4)]
    data = pages(4)
    ok, asked = save(session, "t", chunks[:2], data[:2])
    assert ok == [True, True] and asked == [0, 1]
    ok, asked = save(session, "t", chunks, data)  # two stored already: only the new two are read
    assert ok == [True] * 4 and asked == [2, 3]
    bufs = [np.zeros(PAGE, np.uint8) for _ in chunks]
    results = session.complete_load(
        session.prepare_load(session.page_reads("t", KV, chunks, [memoryview(b) for b in bufs]))
    ).results
    assert [r.ok for r in results] == [True] * 4
    for got, want in zip(bufs, data):
        np.testing.assert_array_equal(got, want)


def test_a_page_of_another_layout_or_tenant_is_a_miss(make_session: Callable[..., Session]) -> None:
    session = make_session()
    chunks = [chunk_id(i) for i in range(2)]
    save(session, "t", chunks, pages(2))
    buf = np.zeros(PAGE, np.uint8)
    other_layout = session.complete_load(
        session.prepare_load(session.page_reads("t", OTHER_LAYOUT, chunks[:1], [memoryview(buf)]))
    ).results
    other_tenant = session.complete_load(
        session.prepare_load(session.page_reads("u", KV, chunks[:1], [memoryview(buf)]))
    ).results
    assert not other_layout[0].ok and other_layout[0].reason is RejectReason.FINGERPRINT
    assert other_tenant[0].status is TierStatus.MISS  # another tenant's key: not even found


def test_a_lookup_leaves_where_it_found_each_page_for_the_load(make_session: Callable[..., Session]) -> None:
    session = make_session()
    chunks = [chunk_id(i) for i in range(3)]
    data = pages(3, seed=1)
    save(session, "t", chunks, data)
    assert session.store.flush(10)
    spec = MemberSpec("kv", MEMBER_FP, MemberRole.TARGET)
    found = session.lookup("t", chunks, [spec], TOKENS)
    assert found.hit_chunks == 3
    assert all(session.key("t", c, "kv") in session.hints for c in chunks)
    assert session.key("t", chunk_id(9), "kv") not in session.hints
    bufs = [np.zeros(PAGE, np.uint8) for _ in chunks]
    batch = session.prepare_load(session.page_reads("t", KV, chunks, [memoryview(b) for b in bufs]))
    assert batch.plan.located == {session.key("t", c, "kv"): "memory" for c in chunks}
    assert not any(session.key("t", c, "kv") in session.hints for c in chunks)  # the load took its hints
    assert all(r.ok for r in session.complete_load(batch).results)
    np.testing.assert_array_equal(np.stack(bufs), np.stack(data))


def test_objects_carry_their_token_facts(make_session: Callable[..., Session]) -> None:
    session = make_session(memory=False)  # straight to disk: the header is encoded and checked
    tail_ids = (5, 6, 7, 8, 9)
    full, tail = pages(2, seed=2)
    facts_full, facts_tail = ChunkFacts(chunk_id(0), TOKENS), ChunkFacts(chunk_id(1), len(tail_ids), tail_ids)
    saved = session.save("t", [ObjectIO(facts_full, KV, memoryview(full)), ObjectIO(facts_tail, KV, memoryview(tail))])
    assert saved.statuses == [TierStatus.OK, TierStatus.OK]
    assert saved.in_memory == [False, False]  # no memory tier here
    assert [it.header.token_ids for it in saved.items] == [None, tail_ids]
    got_full, got_tail, wrong_tail = (np.zeros(PAGE, np.uint8) for _ in range(3))
    results = session.complete_load(
        session.prepare_load(
            session.reads(
                "t",
                [
                    ObjectIO(facts_full, KV, memoryview(got_full)),
                    ObjectIO(ChunkFacts(chunk_id(1), 3, tail_ids[:3]), KV, memoryview(got_tail)),  # a prefix: loads
                    ObjectIO(ChunkFacts(chunk_id(1), 3, (5, 6, 0)), KV, memoryview(wrong_tail)),  # other ids: refused
                ],
            )
        )
    ).results
    assert [r.ok for r in results] == [True, True, False]
    assert results[2].reason is RejectReason.TOKENS
    np.testing.assert_array_equal(got_full, full)
    np.testing.assert_array_equal(got_tail, tail)


def test_save_without_dedupe_rewrites_and_reports_memory(make_session: Callable[..., Session]) -> None:
    session = make_session(disk=False)
    facts = ChunkFacts(chunk_id(3), TOKENS)
    first, second = pages(2, seed=3)
    assert session.save("t", [ObjectIO(facts, KV, memoryview(first))], dedupe=False).in_memory == [True]
    skipped = session.save("t", [ObjectIO(facts, KV, memoryview(second))])  # stored already: not rewritten
    assert skipped.statuses == [TierStatus.OK]
    buf = np.zeros(PAGE, np.uint8)
    session.complete_load(session.prepare_load(session.reads("t", [ObjectIO(facts, KV, memoryview(buf))]))).results
    np.testing.assert_array_equal(buf, first)
    session.save("t", [ObjectIO(facts, KV, memoryview(second))], dedupe=False)  # a tail slot rewritten in place
    session.complete_load(session.prepare_load(session.reads("t", [ObjectIO(facts, KV, memoryview(buf))]))).results
    np.testing.assert_array_equal(buf, second)


def test_a_reader_session_looks_up_reports_and_refuses_stores(tmp_path: Path) -> None:
    config = KVPackConfig.from_dict({"disk": {"enabled": False}})
    index = ReportedMemoryIndex()
    reader = Session.reader(config, [index], GROUP_FP)
    try:
        facts = ChunkFacts(chunk_id(4), TOKENS)
        refused = reader.save("t", [ObjectIO(facts, KV, memoryview(pages(1)[0]))], dedupe=False)
        assert refused.statuses == [TierStatus.UNAVAILABLE]
        spec = MemberSpec("kv", MEMBER_FP, MemberRole.TARGET)
        assert reader.lookup("t", [chunk_id(4)], [spec], TOKENS).hit_chunks == 0
        from kvpack import ReportedObject

        index.apply([ReportedObject(reader.key("t", chunk_id(4), "kv").as_str(), TOKENS, PAGE)], [])
        assert reader.lookup("t", [chunk_id(4)], [spec], TOKENS).hit_chunks == 1
        assert len(reader.hints) == 0  # a reader's lookups travel to the loading process instead
    finally:
        reader.store.close()


@dataclass
class Handoffs:
    """`HandoffWaits` over a session, recording what it hands on and ends (and when)."""

    waits: HandoffWaits
    ready: dict[str, float]
    ended: dict[str, Exception | None]
    changed: threading.Condition

    def task(self, name: str, chunks: Sequence[str], wait_s: float) -> LoadTask:
        """A load of `chunks` (one ``kv`` object each) that waits at most `wait_s` for them."""
        reads = [ObjectIO(ChunkFacts(c, TOKENS), KV, memoryview(bytearray(PAGE))) for c in chunks]
        planned = PlannedLoad(reads, list(range(len(chunks))), [], lambda good, lent, lane: 0)
        load = LoadJob(name, "t", (), PAGE * len(chunks), lambda _staging: planned, handoff_wait_s=wait_s)
        return LoadTask(load, time.monotonic(), after_saves=0)

    def until(self, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
        """Wait for `done` (AssertionError after `timeout_s`): woken by what is handed on or
        ended, and every 10 ms for what else the waiter changes (what it holds)."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not done():
                assert time.monotonic() < deadline, (self.ready, self.ended)
                self.changed.wait(0.01)


@pytest.fixture
def handoffs(make_session: Callable[..., Session]) -> Iterator[Handoffs]:
    session = make_session(memory=False)
    ready: dict[str, float] = {}
    ended: dict[str, Exception | None] = {}
    changed = threading.Condition()

    def note(into: dict, key: str, value: object) -> None:  # type: ignore[type-arg]
        with changed:
            into[key] = value
            changed.notify_all()

    waits = HandoffWaits(
        session,
        session.store.metrics,
        plan=lambda task: task.job.plan(None),  # type: ignore[arg-type]
        ready=lambda task: note(ready, task.job.job_id, time.monotonic()),
        ended=lambda task, error: note(ended, task.job.job_id, error),
    ).start()
    yield Handoffs(waits, ready, ended, changed)
    waits.close(5.0)


def test_a_handoff_goes_on_as_soon_as_its_objects_land(
    make_session: Callable[..., Session], handoffs: Handoffs
) -> None:
    """A decode instance's handoff: it waits for objects a prefill instance (here another
    store on the same folder) is still writing, and goes on as soon as they are there."""
    writer = make_session(memory=False)
    chunks = [chunk_id(i) for i in range(3)]
    task = handoffs.task("late", chunks, wait_s=30.0)
    handoffs.waits.add(task)
    time.sleep(0.3)  # not to pass: the objects land while the load waits
    landed = time.monotonic()
    save(writer, "t", chunks, pages(3))
    handoffs.until(lambda: "late" in handoffs.ready)
    assert handoffs.ready["late"] - landed < 5.0  # long before its 30 s
    assert task.plan is not None and handoffs.ended == {}


def test_a_handoff_whose_objects_never_land_holds_up_no_other(
    make_session: Callable[..., Session], handoffs: Handoffs
) -> None:
    """One handoff whose prefill instance never stores waits its whole bound; a second, whose
    objects land meanwhile, goes on at once (before, both waited on the load thread in
    turn, and every load queued behind the first outlived its own bound); a cancelled one
    ends without a look. Then: what never landed is counted, and the first goes on too."""
    writer = make_session(memory=False)
    never, landing, cancelled = ([chunk_id(100 * k + i) for i in range(2)] for k in range(1, 4))
    handoffs.waits.add(handoffs.task("never", never, wait_s=5.0))
    handoffs.waits.add(handoffs.task("landing", landing, wait_s=30.0))
    dropped = handoffs.task("cancelled", cancelled, wait_s=30.0)
    handoffs.waits.add(dropped)
    save(writer, "t", landing, pages(2))
    dropped.cancelled = True  # as `TransferRunner.finished` marks a load past its bound
    handoffs.until(lambda: "landing" in handoffs.ready and "cancelled" in handoffs.ended)
    assert "never" not in handoffs.ready  # still waiting: 5 s from its start
    assert handoffs.ended == {"cancelled": None}
    handoffs.until(lambda: "never" in handoffs.ready)
    metrics = handoffs.waits.metrics
    assert metrics.value("handoff_missing", tenant="t") == 2 and metrics.value("handoff_loads", tenant="t") == 2


def test_handoffs_still_waiting_at_close_end_failed(handoffs: Handoffs) -> None:
    """Never reported loaded: their blocks were not written."""
    handoffs.waits.add(handoffs.task("waiting", [chunk_id(7)], wait_s=30.0))
    handoffs.until(lambda: bool(handoffs.waits._waiting))
    handoffs.waits.close(5.0)
    assert isinstance(handoffs.ended["waiting"], RuntimeError) and handoffs.ready == {}


def test_located_hints_are_bounded_oldest_first() -> None:
    hints = LocatedHints(capacity=2)
    keys = [StoreKey("t", GROUP_FP, chunk_id(i), "kv") for i in range(3)]
    for k in keys:
        hints.remember({k: "disk"})
    assert len(hints) == 2 and keys[0] not in hints and keys[2] in hints
    assert hints.take(keys) == {keys[1]: "disk", keys[2]: "disk"}
    assert len(hints) == 0


def test_bad_page_keys_are_refused_with_the_field() -> None:
    with pytest.raises(ValueError):
        validate_chunk_hashes([chunk_id(0), "not-a-hash/.."])
