"""kvpack's tiers seen by a KV-aware router: vLLM's KV events (``kv_events_config``, zmq).

A real vLLM engine publishes on a zmq PUB socket; the test subscribes as a router does (SUB,
with vLLM's replay socket for the batches a late subscriber missed) and decodes with vLLM's
own classes. It sees ``BlockStored`` for each whole block kvpack stored (medium ``CPU`` for the
memory tier, ``STORAGE`` for the disk tier, the tier's name as ``ownership``, the block's
token ids and parent hash) and ``BlockRemoved`` when kvpack's memory tier evicts a block to
make room; what the events say each tier holds is what the tiers then answer. With the shared
host store (``memory.mode: host``), another engine process's saves that evict blocks this
engine announced are withdrawn too (``BlockRemoved``, medium ``CPU``), exactly those; the same
on a disk folder two engines share (medium ``STORAGE``). Blocks another engine process stored
in the shared host store are announced too (``BlockStored`` with vLLM's hashes of their
tokens, those the writer announced), and withdrawn when a third process's saves evict them;
those of a salted request are not (only their writer announces them), and their token ids are
in no facts row.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec  # noqa: E402
import zmq  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm_helpers import (  # noqa: E402
    BLOCK,
    close_llm,
    kv_config,
    live_connectors,
    make_llm,
    metric,
    prompt,
    run,
    start_engine_process,
    stored_files,
)

from kvpack import StoreKey, TenantSource, chunk_hashes, resolve_tenant  # noqa: E402
from kvpack.tiers.host import drop  # noqa: E402
from kvpack.tools.ports import free_port  # noqa: E402

pytestmark = pytest.mark.vllm

TOPIC = "kv"
OBJECT_BYTES = 2 * 2 * BLOCK * 2 * 64 * 4
"""One block of the tiny Llama (2 layers, K and V, 2 KV heads of 64, fp32): 256 KiB."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """A router's side of vLLM's KV events: SUB for the live stream, the replay socket for
    the batches published before it joined (zmq's slow joiner)."""

    def __init__(self, port: int, replay_port: int, bind: bool = False) -> None:
        """`bind`: the router binds its SUB socket on 127.0.0.1 and the engine's publisher connects
        to it (an ``endpoint`` that is neither a wildcard nor ipc); else it connects to the engine's."""
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.bound = bind
        if bind:
            self.sub.bind(f"tcp://127.0.0.1:{port}")
        else:
            self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.replay_addr = f"tcp://127.0.0.1:{replay_port}"
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.batches: dict[int, KVEventBatch] = {}

    def close(self) -> None:
        self.sub.close(linger=0)

    def events(self) -> list[Any]:
        return [e for seq in sorted(self.batches) for e in self.batches[seq].events]

    def wait_for(self, done: Callable[[list[Any]], bool], timeout_s: float = 30.0) -> list[Any]:
        """Receive until `done(events)` holds (or the bound passes: the caller's assert then fails).
        Until a first batch arrives it asks for the batches published so far, once a second: a
        publisher that connects drops its first batch (zmq takes the subscription in at that
        send), and a SUB that connects to a publisher bound after it (zmq's slow joiner) misses
        what was published before the connection came up, which on a busy machine can be every
        batch of the steps the test waits for."""
        deadline = time.monotonic() + timeout_s
        asked = -1.0
        while time.monotonic() < deadline:
            if not self.batches and time.monotonic() - asked >= 1.0:
                asked = time.monotonic()
                self._replay()
            if self.sub.poll(100):
                _topic, seq, payload = self.sub.recv_multipart()
                self.batches[int.from_bytes(seq, "big")] = self.decoder.decode(payload)
            if self.batches and len(self.batches) <= max(self.batches):
                self._replay()  # a gap before the newest: ask the publisher for what was missed
            if done(self.events()):
                break
        return self.events()

    def _replay(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            sock.connect(self.replay_addr)
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            while sock.poll(5000):
                _, _topic, seq, payload = sock.recv_multipart()
                if seq == END_SEQ:
                    break
                self.batches.setdefault(int.from_bytes(seq, "big"), self.decoder.decode(payload))
        finally:
            sock.close(linger=0)


def held(events: list[Any], owner: str) -> set[Any]:
    """Block hashes the events say tier `owner` holds now (stored and not removed since)."""
    now: set[Any] = set()
    for e in events:
        if getattr(e, "ownership", None) != owner:
            continue
        if isinstance(e, BlockStored):
            now.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            now.difference_update(e.block_hashes)
    return now


def _connector(role: str) -> Any:
    (conn,) = [c for c in live_connectors() if c.role.name == role]
    return conn


A = prompt(21, 2 * BLOCK + 45)  # 2 whole blocks + a 45-token tail each
B = prompt(22, 2 * BLOCK + 45)


def _events_config(port: int, replay_port: int) -> dict[str, Any]:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": TOPIC,
    }


def test_a_router_sees_kvpack_blocks_stored_and_evicted_per_tier(tiny_llama: Path, tmp_path: Path) -> None:
    port, replay_port = free_port(), free_port()
    events_config = _events_config(port, replay_port)
    # memory holds 4 objects (a whole block or a tail each): A's 3 and B's 3 do not fit, disk holds all
    extra = {
        "memory": {"capacity": 4 * OBJECT_BYTES},
        "disk": {"path": str(tmp_path / "kv")},
        "trusted_tenants": ["*"],
    }
    subscriber = Subscriber(port, replay_port)
    llm = make_llm(tiny_llama, kv_config(extra), kv_events_config=events_config)
    try:
        worker = _connector("WORKER").worker
        run(llm, A)
        assert worker.flush_before_exit(10, "test")
        run(llm, B)
        assert worker.flush_before_exit(10, "test")
        # a request kvpack refuses to cache (a malformed tenant) saves and loads nothing: its engine
        # step only carries what the tiers did since the last step to the publisher
        run(llm, prompt(23, 20), tenant="not/a tenant")

        memory, disk = worker.session.store.tiers[0], worker.session.store.tiers[1]
        assert (memory.name, disk.name) == ("memory", "disk")
        chunks = {name: chunk_hashes(ids, BLOCK) for name, ids in (("A", A), ("B", B))}
        keys = {
            name: [StoreKey("default", worker.scope.fingerprint, c, "kv") for c in cs] for name, cs in chunks.items()
        }
        in_memory = {name: memory.contains(ks) for name, ks in keys.items()}
        on_disk_now = sum(sum(disk.contains(ks)) for ks in keys.values())
        assert in_memory["B"] == [True, True] and in_memory["A"] != [True, True]  # B's store evicted A's

        blocks = {tuple(ids[i * BLOCK : (i + 1) * BLOCK]) for ids in (A, B) for i in range(2)}

        def settled(events: list[Any]) -> bool:
            announced = {tuple(e.token_ids) for e in events if isinstance(e, BlockStored) and e.ownership == "memory"}
            in_mem = sum(sum(v) for v in in_memory.values())
            return announced >= blocks and (len(held(events, "memory")), len(held(events, "disk"))) == (
                in_mem,
                on_disk_now,
            )

        events = subscriber.wait_for(settled)
        stored = [e for e in events if isinstance(e, BlockStored) and e.ownership in ("memory", "disk")]
        by_tokens = {tuple(e.token_ids): e for e in stored if e.ownership == "memory"}
        hashes: dict[str, list[Any]] = {}
        for name, ids in (("A", A), ("B", B)):
            blocks = [by_tokens[tuple(ids[i * BLOCK : (i + 1) * BLOCK])] for i in range(2)]  # KeyError: not announced
            assert [b.medium for b in blocks] == ["CPU", "CPU"]
            assert [b.block_size for b in blocks] == [BLOCK, BLOCK]
            assert blocks[0].parent_block_hash is None and blocks[1].parent_block_hash == blocks[0].block_hashes[0]
            hashes[name] = [b.block_hashes[0] for b in blocks]
        on_disk = {e.block_hashes[0] for e in stored if e.ownership == "disk"}
        assert {e.medium for e in stored if e.ownership == "disk"} == {"STORAGE"}
        assert on_disk == set(hashes["A"] + hashes["B"])  # the disk evicted nothing

        removed = [e for e in events if isinstance(e, BlockRemoved) and e.ownership == "memory"]
        assert removed and {e.medium for e in removed} == {"CPU"}
        # what the events say each tier holds is what the tiers answer
        now = held(events, "memory")
        for name in ("A", "B"):
            assert [h in now for h in hashes[name]] == in_memory[name]
            assert [h in held(events, "disk") for h in hashes[name]] == disk.contains(keys[name])
    finally:
        close_llm(llm)
        subscriber.close()


H = prompt(31, 3 * BLOCK + 45)  # 3 whole blocks (announced) + a tail (stored, never announced)
OTHER = prompt(32, BLOCK + 45)


def test_a_router_sees_blocks_another_process_evicted_from_the_host_store_withdrawn(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Engine 1 (this process, publishing KV events) stores H's blocks in the shared host store;
    engine 2 (a process of its own, same store) computes another prompt, whose saves evict the
    oldest of them. Engine 1's next steps withdraw exactly the evicted blocks (medium CPU), and
    what the events say the host store holds is what a lookup then finds."""
    name = f"events-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # an object costs its payload and a header page in tmpfs: the store holds 4, not 5 (H's are 4)
    memory = {"mode": "host", "host_name": name, "capacity": 4 * (OBJECT_BYTES + (16 << 10))}
    try:
        _another_process_evicts(tiny_llama, tmp_path, {"memory": memory, "disk": {"enabled": False}}, "CPU")
    finally:
        drop(name)


def test_a_router_sees_blocks_another_process_evicted_from_the_shared_disk_folder_withdrawn(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The same with the disk tier alone (memory off): engine 2 shares engine 1's ``disk.path``
    and its saves evict the oldest of H's files; engine 1's steps withdraw exactly those
    (medium STORAGE, ownership disk)."""
    disk = {"path": str(tmp_path / "kv"), "capacity": 4 * (OBJECT_BYTES + (16 << 10))}
    _another_process_evicts(tiny_llama, tmp_path, {"memory": {"enabled": False}, "disk": disk}, "STORAGE")


def _another_process_evicts(tiny_llama: Path, tmp_path: Path, tiers: dict[str, Any], medium: str) -> None:
    """Engine 1 stores H's blocks on its only tier (shared); engine 2 (a process) evicts some; the
    subscriber sees exactly those withdrawn, once each, and a lookup agrees with the events."""
    port, replay_port = free_port(), free_port()
    extra = {**tiers, "trusted_tenants": ["*"]}
    subscriber = Subscriber(port, replay_port)
    llm = make_llm(tiny_llama, kv_config(extra), kv_events_config=_events_config(port, replay_port))
    try:
        worker = _connector("WORKER").worker
        run(llm, H)
        assert worker.flush_before_exit(10, "test")
        # a step publishes what the tiers did before it: the flush may have landed H's last
        # objects after the run's last step (a request kvpack refuses saves and loads nothing)
        run(llm, prompt(29, 20), tenant="not/a tenant")
        (tier,) = worker.session.store.tiers
        owner = tier.name
        keys = [StoreKey("default", worker.scope.fingerprint, c, "kv") for c in chunk_hashes(H, BLOCK)]
        assert tier.contains(keys) == [True] * 3
        blocks = [tuple(H[i * BLOCK : (i + 1) * BLOCK]) for i in range(3)]

        def announced(events: list[Any]) -> bool:
            return {tuple(e.token_ids) for e in events if isinstance(e, BlockStored)} >= set(blocks)

        events = subscriber.wait_for(announced)
        by_tokens = {tuple(e.token_ids): e for e in events if isinstance(e, BlockStored) and e.ownership == owner}
        hashes = [by_tokens[b].block_hashes[0] for b in blocks]  # KeyError: not announced
        assert {by_tokens[b].medium for b in blocks} == {medium}

        withdrawn = _another_process_evicts_some(
            llm, subscriber, tier, keys, hashes, medium, extra, tiny_llama, tmp_path
        )
        assert metric("shared_withdrawals", "SCHEDULER", tier=owner) == withdrawn
    finally:
        close_llm(llm)
        subscriber.close()


def _another_process_evicts_some(
    llm: Any,
    subscriber: Subscriber,
    tier: Any,
    keys: list[StoreKey],
    hashes: list[Any],
    medium: str,
    extra: dict[str, Any],
    tiny_llama: Path,
    tmp_path: Path,
    seed: int = 23,
) -> int:
    """An engine process's saves evict some of `keys` (announced by `llm` as `hashes`) from the
    shared `tier`; `llm`'s next steps withdraw exactly those, once each, and a lookup agrees with
    the events. Returns how many were withdrawn."""
    owner = tier.name
    other = start_engine_process(tiny_llama, extra, {"OTHER": OTHER}, tmp_path / "other.log")
    assert other.result()["OTHER"].cached == 0
    present = tier.contains(keys)
    assert present.count(False) >= 1 and present.count(True) >= 1, present  # some evicted, some held
    # a request kvpack refuses to cache (a malformed tenant) stores nothing: its engine steps
    # only run this engine's sweeps of the blocks it announced on shared tiers
    run(llm, prompt(seed, 20), tenant="not/a tenant")

    expected = {h for h, ok in zip(hashes, present) if ok}
    events = subscriber.wait_for(lambda ev: held(ev, owner) == expected)
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.ownership == owner]
    withdrawn = [h for e in removed for h in e.block_hashes]
    assert sorted(withdrawn) == sorted(h for h, ok in zip(hashes, present) if not ok)  # exactly, once each
    assert {e.medium for e in removed} == {medium}
    assert tier.contains(keys) == [h in held(events, owner) for h in hashes]  # withdrawn: miss; held: hit
    return len(withdrawn)


P = prompt(41, 3 * BLOCK + 45)  # 3 whole blocks (facts recorded) + a tail (never announced)


def _vllm_hashes(ids: list[int], blocks: int) -> list[Any]:
    """The block hashes vLLM computes for `ids`' first `blocks` blocks in this process (its hash
    function and NONE_HASH): what any engine of the same settings announces for them."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

    fn = get_hash_fn_by_name("sha256")
    out, parent = [], None
    for i in range(blocks):
        parent = hash_block_tokens(fn, parent, ids[i * BLOCK : (i + 1) * BLOCK])
        out.append(parent)
    return [maybe_convert_block_hash(h) for h in out]


def test_a_router_sees_blocks_another_process_stored_in_the_host_store_then_withdrawn(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """Engine 1 (this process, publishing KV events) shares a host store with engine 2, a process
    of its own with KV events on, which computes P: engine 1 announces P's blocks as its own
    loadable ones (BlockStored, medium CPU, ownership host, vLLM's hashes of P's tokens and their
    parent chain), which its lookup then finds. A third process's saves evict some of them;
    engine 1 withdraws exactly those, once each."""
    name = f"facts-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # 5 objects: P's 4 (3 blocks + tail) fit; OTHER's 2 then evict 2 of the oldest
    memory = {"mode": "host", "host_name": name, "capacity": 5 * (OBJECT_BYTES + (16 << 10))}
    try:
        _another_process_stores(tiny_llama, tmp_path, {"memory": memory, "disk": {"enabled": False}}, "CPU")
    finally:
        drop(name)


def test_a_router_sees_blocks_another_process_stored_in_the_shared_disk_folder_then_withdrawn(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The same with the disk tier alone (memory off), engine 2 sharing engine 1's ``disk.path``:
    medium STORAGE, ownership disk."""
    disk = {"path": str(tmp_path / "kv"), "capacity": 5 * (OBJECT_BYTES + (16 << 10))}
    _another_process_stores(tiny_llama, tmp_path, {"memory": {"enabled": False}, "disk": disk}, "STORAGE")


def _another_process_stores(tiny_llama: Path, tmp_path: Path, tiers: dict[str, Any], medium: str) -> None:
    """Engine 2 (a process) stores P on the only tier, shared; engine 1's subscriber sees P's blocks
    announced with vLLM's hashes, once each; engine 3 (a process) evicts some, withdrawn once each."""
    extra = {**tiers, "trusted_tenants": ["*"]}
    port, replay_port = free_port(), free_port()
    subscriber = Subscriber(port, replay_port)
    llm = make_llm(tiny_llama, kv_config(extra), kv_events_config=_events_config(port, replay_port))
    try:
        worker = _connector("WORKER").worker
        (tier,) = worker.session.store.tiers
        owner = tier.name
        keys = [StoreKey("default", worker.scope.fingerprint, c, "kv") for c in chunk_hashes(P, BLOCK)]
        writer_events = _events_config(free_port(), free_port())
        writer = start_engine_process(
            tiny_llama, extra, {"P": P}, tmp_path / "writer.log", kv_events_config=writer_events
        )
        assert writer.result()["P"].cached == 0
        assert tier.contains(keys) == [True] * 3
        # a request kvpack refuses to cache (a malformed tenant) stores nothing: its engine steps
        # only carry what engine 1's scheduler reads of the shared tier to the publisher
        run(llm, prompt(23, 20), tenant="not/a tenant")
        blocks = [tuple(P[i * BLOCK : (i + 1) * BLOCK]) for i in range(3)]

        def announced(events: list[Any]) -> bool:
            return {tuple(e.token_ids) for e in events if isinstance(e, BlockStored)} >= set(blocks)

        events = subscriber.wait_for(announced)
        stored = [e for e in events if isinstance(e, BlockStored) and e.ownership == owner]
        by_tokens = {tuple(e.token_ids): e for e in stored}
        hashes = [by_tokens[b].block_hashes[0] for b in blocks]  # KeyError: not announced
        assert hashes == _vllm_hashes(P, 3)  # the writer's hashes: a router matches them to P's prefix
        assert [by_tokens[b].parent_block_hash for b in blocks] == [None, *hashes[:2]]
        assert {(e.medium, e.block_size) for e in stored} == {(medium, BLOCK)}
        assert len(stored) == 3  # each once; the tail never
        assert tier.contains(keys) == [True] * 3  # what engine 1 announced, its lookup finds
        assert metric("shared_facts", "SCHEDULER", tier=owner, outcome="taken") == 3

        _another_process_evicts_some(llm, subscriber, tier, keys, hashes, medium, extra, tiny_llama, tmp_path, seed=24)
    finally:
        close_llm(llm)
        subscriber.close()


S = prompt(42, 3 * BLOCK + 45)
"""A salted tenant's prompt: 3 whole blocks + a tail."""
SALT = "tenant s"


def test_a_salted_tenants_blocks_another_process_stored_are_not_announced(tiny_llama: Path, tmp_path: Path) -> None:
    """Engine 2 (a process, KV events on an ipc endpoint) stores salted S, then unsalted P, in a
    disk folder engine 1 shares. Engine 1's router binds its SUB socket on 127.0.0.1 and engine 1's
    publisher connects to it (the README's example), with the replay socket on 127.0.0.1. It
    announces P's 3 blocks (the control) and none of S's, with or without token ids; the folder's
    facts rows hold P's blocks only, though S's blocks are stored there."""
    disk_path = tmp_path / "kv"
    extra = {
        "memory": {"enabled": False},
        "disk": {"path": str(disk_path), "capacity": 10 * (OBJECT_BYTES + (16 << 10))},
    }
    port, replay_port = free_port(), free_port()
    subscriber = Subscriber(port, replay_port, bind=True)
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": TOPIC,
    }
    llm = make_llm(tiny_llama, kv_config(extra), kv_events_config=events_config)
    try:
        (tier,) = _connector("WORKER").worker.session.store.tiers
        writer_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/w.sock"}
        writer = start_engine_process(
            tiny_llama,
            extra,
            {"S": S, "P": P},
            tmp_path / "writer.log",
            salts={"S": SALT},
            kv_events_config=writer_events,
        )
        assert writer.result()["P"].cached == 0
        salted = resolve_tenant(TenantSource(salt=SALT), "default").tenant
        assert len(stored_files(disk_path, salted)) == 4  # S's 3 blocks and its tail are on the shared tier
        run(llm, prompt(23, 20), tenant="not/a tenant")  # steps that only publish what engine 1 reads
        blocks = [tuple(P[i * BLOCK : (i + 1) * BLOCK]) for i in range(3)]

        def announced(events: list[Any]) -> bool:
            return {tuple(e.token_ids) for e in events if isinstance(e, BlockStored)} >= set(blocks)

        events = subscriber.wait_for(announced)
        stored = [e for e in events if isinstance(e, BlockStored) and e.ownership == "disk"]
        assert sorted(tuple(e.token_ids) for e in stored) == sorted(blocks)  # P's, each once; none of S's
        rows = tier.facts_after(0, 100)
        assert sorted(r.group.tenant for r in rows) == ["default"] * 3  # no row of the salted tenant
        assert metric("shared_facts", "SCHEDULER", tier="disk", outcome="taken") == 3
    finally:
        close_llm(llm)
        subscriber.close()
