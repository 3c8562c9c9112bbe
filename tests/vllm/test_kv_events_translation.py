"""RouterEvents (kvpack.vllm_plugin.kv_events) without an engine: which tier events become vLLM events.

The request is the scheduler-side shape `vllm_helpers.fake_request` gives, plus vLLM's block hashes.
"""

from __future__ import annotations

import os
import pickle
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm_helpers import fake_request, prompt  # noqa: E402

from fixtures.builders import item, payload  # noqa: E402
from kvpack import (  # noqa: E402
    KVPackConfig,
    KVStore,
    Session,
    StoreKey,
    TierEvent,
    TierEventKind,
    TierStatus,
    chunk_hashes,
    new_origin,
    shared_fact_tails,
    shared_tier_sweep,
    shared_tier_sweeps,
)
from kvpack.tiers.host import drop  # noqa: E402
from kvpack.vllm_plugin.kv_events import KVPackKVEvents, RouterEvents  # noqa: E402
from kvpack.vllm_plugin.metadata import BlockRef, KVPackConnectorMetadata, TransferJob  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 4
FP = "f" * 32
STORED, REMOVED = TierEventKind.STORED, TierEventKind.REMOVED


def _request(req_id: str, ids: list[int]):  # type: ignore[no-untyped-def]
    req = fake_request(ids, req_id)
    req.block_hashes = [bytes([i]) * 32 + req_id.encode() for i in range(len(ids) // BS)]
    return req


def _saved(events: RouterEvents, req, chunks: list[str]) -> None:  # type: ignore[no-untyped-def]
    events.follow(req)
    refs = tuple(BlockRef(c, (i + 1,), BS) for i, c in enumerate(chunks))
    events.note_saves(KVPackConnectorMetadata(saves=[TransferJob(req.request_id, "default", refs)]))


def _group(chunk: str, fp: str = FP) -> str:
    return StoreKey("default", fp, chunk, "kv").group.as_str()


def test_a_stored_chunk_is_announced_once_per_tier_and_removed_only_where_announced() -> None:
    ids = prompt(1, 3 * BS)
    req = _request("r", ids)
    chunks = [str(c) for c in chunk_hashes(ids, BS)]
    events = RouterEvents(KVPackConfig.from_dict({}), FP, BS, BS)
    _saved(events, req, chunks[:2])
    events.translate(
        [
            TierEvent(STORED, "memory", _group(chunks[0])),
            TierEvent(STORED, "memory", _group(chunks[0])),  # again (a later put): no second announcement
            TierEvent(STORED, "disk", _group(chunks[1])),
            TierEvent(STORED, "memory", _group(chunks[2])),  # never planned here: unknown, not announced
            TierEvent(STORED, "memory", _group(chunks[1], "e" * 32)),  # another model's group on a shared tier
            TierEvent(REMOVED, "disk", _group(chunks[0])),  # never announced on disk
            TierEvent(REMOVED, "memory", _group(chunks[0])),
        ]
    )
    out = events.take()
    assert [type(e) for e in out] == [BlockStored, BlockStored, BlockRemoved]
    first, second, gone = out
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored) and isinstance(gone, BlockRemoved)
    assert (first.medium, first.ownership, first.locality, first.token_ids) == ("CPU", "memory", "LOCAL", ids[:BS])
    assert (second.medium, second.ownership, second.token_ids) == ("STORAGE", "disk", ids[BS : 2 * BS])
    assert second.parent_block_hash == first.block_hashes[0]
    assert (gone.medium, gone.ownership, gone.block_hashes) == ("CPU", "memory", first.block_hashes)
    assert events.take() == []


def test_facts_dropped_for_room_withdraw_what_they_announced() -> None:
    # a router must never keep a block kvpack can no longer withdraw
    ids = prompt(2, 3 * BS)
    chunks = [str(c) for c in chunk_hashes(ids, BS)]
    events = RouterEvents(KVPackConfig.from_dict({}), FP, BS, BS, max_blocks=2)
    req = _request("r", ids)
    _saved(events, req, chunks[:1])
    events.translate([TierEvent(STORED, "memory", _group(chunks[0]))])
    _saved(events, req, chunks[1:3])  # the third chunk's facts push the first's out
    out = events.take()
    assert [type(e) for e in out] == [BlockStored, BlockRemoved]
    assert out[1].block_hashes == out[0].block_hashes


def test_the_workers_events_cross_a_process_boundary() -> None:
    # vLLM pickles a worker's KVConnectorOutput across processes (TP > 1)
    batch = KVPackKVEvents([TierEvent(STORED, "memory", _group("a" * 64))])
    batch.add_events(KVPackKVEvents([TierEvent(REMOVED, "disk", _group("b" * 64))]).get_all_events())
    again = pickle.loads(pickle.dumps(batch))
    assert again.tier_events() == batch.tier_events() and len(again.tier_events()) == 2


def test_a_shared_host_block_is_withdrawn_once_whoever_evicts_it(tmp_path: Path) -> None:
    # the sweep (kvpack.SharedSweep) finds what another process evicted; this process's own
    # removal of a block the sweep withdrew first (or the reverse) adds no second BlockRemoved
    name = f"xlate-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    data = {"memory": {"mode": "host", "host_name": name, "capacity": "64MiB"}, "disk": {"enabled": False}}
    mine, other = (KVStore.from_config(KVPackConfig.from_dict(data)) for _ in range(2))
    try:
        ids = prompt(3, 3 * BS)
        chunks = [str(c) for c in chunk_hashes(ids, BS)]
        sweep = shared_tier_sweep(Session(mine))
        events = RouterEvents(KVPackConfig.from_dict({}), FP, BS, BS, sweeps=[sweep] if sweep is not None else [])
        _saved(events, _request("r", ids), chunks)
        keys = [StoreKey("default", FP, c, "kv") for c in chunks]
        for k in keys:
            assert mine.store([item(k, payload(1, 1024))]) == [TierStatus.OK]
        events.translate([TierEvent(STORED, "host", _group(c)) for c in chunks])
        stored = events.take()
        assert [type(e) for e in stored] == [BlockStored] * 3 and {e.medium for e in stored} == {"CPU"}
        other.remove_groups([keys[0].group, keys[1].group])  # another process evicts two blocks
        events.translate([TierEvent(REMOVED, "host", _group(chunks[1]))])  # ... and this one saw one go too
        out = events.take()  # chunk 1: the own removal; chunk 0: the sweep
        assert sorted((e.block_hashes[0], e.medium) for e in out) == sorted(
            (stored[i].block_hashes[0], "CPU") for i in (0, 1)
        )
        assert all(isinstance(e, BlockRemoved) for e in out)
        events.translate([TierEvent(REMOVED, "host", _group(chunks[0]))])  # late own removal: no duplicate
        assert events.take() == []
        assert mine.metrics.snapshot()["shared_withdrawals"] == {"tier=host": 1.0}
    finally:
        mine.close()
        other.close()
        drop(name)


def test_blocks_another_instance_stored_on_a_shared_tier_are_announced_once_then_withdrawn() -> None:
    # the writer hands its facts to the save (BlockRef.announce); the store records them on the
    # host tier; the reader's steps announce them with the writer's hashes, once, and withdraw
    # them when the tier lets them go; the writer never announces its own rows from the tail
    name = f"xlate-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    data = {"memory": {"mode": "host", "host_name": name, "capacity": "64MiB"}, "disk": {"enabled": False}}
    stores = [KVStore.from_config(KVPackConfig.from_dict(data)) for _ in range(2)]
    try:
        writer, reader = (
            RouterEvents(
                KVPackConfig.from_dict({}),
                FP,
                BS,
                BS,
                sweeps=shared_tier_sweeps(Session(s)),
                tails=shared_fact_tails(Session(s), new_origin()),
                identity=lambda: "same hashes",
            )
            for s in stores
        )
        ids = prompt(4, 3 * BS)
        chunks = [str(c) for c in chunk_hashes(ids, BS)]
        req = _request("w", ids)
        writer.follow(req)
        meta = KVPackConnectorMetadata(
            saves=[TransferJob("w", "default", tuple(BlockRef(c, (1,), BS) for c in chunks))]
        )
        writer.note_saves(meta)
        refs = meta.saves[0].blocks
        assert all(r.announce is not None for r in refs)
        for r in refs:
            put = replace(item(StoreKey("default", FP, r.chunk, "kv"), payload(1, 1024)), announce=r.announce)
            assert stores[0].store([put]) == [TierStatus.OK]
        writer.translate([TierEvent(STORED, "host", _group(c)) for c in chunks])  # its workers' tier events
        own = writer.take()  # only those: its own facts rows are not announced a second time
        out = reader.take()
        assert [type(e) for e in out] == [type(e) for e in own] == [BlockStored] * 3
        assert {(e.medium, e.ownership) for e in out} == {("CPU", "host")}
        assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in out] == [
            (e.block_hashes, e.parent_block_hash, e.token_ids) for e in own
        ]  # the writer's hashes
        assert [tuple(e.token_ids) for e in out] == [tuple(ids[i * BS : (i + 1) * BS]) for i in range(3)]
        assert reader.take() == []  # once
        stores[0].remove_groups([StoreKey("default", FP, chunks[1], "kv").group])
        gone = reader.take()
        assert [(type(e), e.block_hashes) for e in gone] == [(BlockRemoved, own[1].block_hashes)]
    finally:
        for s in stores:
            s.close()
        drop(name)
