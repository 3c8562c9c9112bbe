"""Routers' facts on a shared tier (kvpack.observe.router_facts): the writer's save path records them in the
tier's index once the object is ready, they go with their group, and another instance tails them a
bounded slice per call, skipping its own rows and rows of another hash identity. The host store and a
disk folder, two stores each (as two processes)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from fixtures.builders import GROUP_FP, chunk_id, make_item, two_stores
from kvpack import FactsTail, KVPackConfig, KVStore, RouterFacts, Session, StoreKey, TierStatus, shared_fact_tails
from kvpack.observe.metrics import Metrics
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.host import drop

ID = "vllm-sha256-x"


def _key(i: int) -> StoreKey:
    return StoreKey("t", GROUP_FP, chunk_id(i), "kv")


def _put(store: KVStore, chunks: range, origin: str, identity: str = ID) -> None:
    for i in chunks:
        item = make_item("t", chunk_id(i), seed=i)[0]
        facts = RouterFacts(origin, identity, f"facts of {i}".encode())
        assert store.store([replace(item, announce=facts)]) == [TierStatus.OK]


@pytest.fixture(params=["host", "disk"])
def two_processes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[KVStore, KVStore]]:
    """Two stores on one shared tier that holds four 1 KiB objects (memory off for the disk)."""
    if request.param == "disk":
        data = {"memory": {"enabled": False}, "disk": {"path": str(tmp_path / "kv"), "capacity": "4KiB"}}
        with two_stores(data) as stores:
            yield stores
        return
    name = f"facts-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    data = {"memory": {"mode": "host", "host_name": name, "capacity": "16KiB"}, "disk": {"enabled": False}}
    try:
        with two_stores(data) as stores:
            yield stores
    finally:
        drop(name)


def _tail(store: KVStore, origin: str, per_step: int) -> FactsTail:
    (tail,) = shared_fact_tails(Session(store), origin, ("host", "disk"))
    tail.per_step = per_step
    return tail


def test_another_instance_tails_the_facts_a_bounded_slice_per_call(two_processes: tuple[KVStore, KVStore]) -> None:
    writer, reader = two_processes
    _put(writer, range(3), "A")
    _put(writer, range(3, 4), "A", identity="another hash seed")
    _put(reader, range(4, 5), "B")  # evicts group 0 (four fit): its facts go with it
    tail = _tail(reader, "B", per_step=2)
    got = [[(r.group.chunk, r.facts.blob) for r in tail.take(ID)] for _ in range(4)]
    assert got == [[(chunk_id(i), f"facts of {i}".encode()) for i in (1, 2)], [], [], []]
    # the calls read 2, 2 (one of another identity, one this reader's own), then nothing
    counts = {o: reader.metrics.value("shared_facts", tier=tail.tier.name, outcome=o) for o in ("taken", "own")}
    assert counts == {"taken": 2, "own": 1}
    assert reader.metrics.value("shared_facts", tier=tail.tier.name, outcome="other_identity") == 1
    assert writer.metrics.value("shared_facts", tier=tail.tier.name, outcome="recorded") == 4


def test_facts_rows_go_with_their_group(two_processes: tuple[KVStore, KVStore]) -> None:
    writer, reader = two_processes
    _put(writer, range(4), "A")
    tier = writer.tiers[0]
    assert tier.remove_groups([_key(1).group]) == 1
    _put(reader, range(4, 6), "B")  # four fit: the second evicts the oldest left, group 0
    rows = _tail(reader, "C", per_step=100).take(ID)
    assert [r.group.chunk for r in rows] == [chunk_id(i) for i in (2, 3, 4, 5)]
    seqs = [r.seq for r in rows]
    assert seqs == sorted(seqs) and len(set(seqs)) == 4
    _put(writer, range(1, 2), "A")  # stored again (evicting 2): a new row, numbered after every earlier one
    rows = _tail(reader, "C", per_step=100).take(ID)
    assert [r.group.chunk for r in rows] == [chunk_id(i) for i in (3, 4, 5, 1)] and rows[-1].seq > max(seqs)


def test_a_torn_writers_facts_are_never_visible_before_its_object_is_ready(tmp_path: Path) -> None:
    """A writer admitted an object and was killed before writing it: facts recorded for it then are
    not kept; once an object of the group is ready, they are."""
    tier = DiskTier(str(tmp_path / "kv"), 1 << 20)
    try:
        catalog = tier._catalog
        key = _key(7)
        admitted, _ = catalog.admit("t", [(key, 1024, None)], 1 << 20, {})
        assert admitted == [True]
        facts = RouterFacts("A", ID, b"x")
        assert tier.record_facts([(key.group, facts)]) == 0
        assert tier.facts_after(0, 10) == []
        assert catalog.mark_ready([key]) == [True]
        assert tier.record_facts([(key.group, facts)]) == 1
        assert tier.record_facts([(key.group, RouterFacts("B", ID, b"y"))]) == 0  # one row per group: the first's
        assert [(r.group, r.facts) for r in tier.facts_after(0, 10)] == [(key.group, facts)]
        # a blob over the bound is not recorded
        big = RouterFacts("A", ID, b"\0" * ((1 << 16) + 1))
        assert catalog.admit("t", [(_key(8), 1024, None)], 1 << 20, {})[0] == [True]
        assert catalog.mark_ready([_key(8)]) == [True]
        assert tier.record_facts([(_key(8).group, big)]) == 0
    finally:
        tier.close()


def test_no_facts_tail_without_a_shared_tier() -> None:
    store = KVStore.from_config(KVPackConfig.from_dict({"disk": {"enabled": False}}))  # process memory only
    try:
        assert shared_fact_tails(Session(store), "A", ("host", "disk")) == []
    finally:
        store.close()


def test_a_tail_skips_a_step_on_an_index_error() -> None:
    class Broken:
        name = "host"

        def facts_after(self, seq: int, limit: int) -> list[object]:
            raise OSError("index gone")

    tail = FactsTail(Broken(), "A", Metrics())  # type: ignore[arg-type]
    assert tail.take(ID) == [] and tail.cursor == 0
