"""The host store's edges between processes of one user, with real processes and real files:

- what is loaded is what was verified: a payload forged in the shared mapping by another
  writer (a second mapping of the arena, as any process of the user has) right between the
  load's checks and the engine's copy is never loaded; once it is there, the load refuses it
  (a miss and a counted refusal), the engine recomputes;
- a child forked without exec does not keep its dead parent's registration alive;
- a process that holds the index's lock (a kvpack process stopped inside a transaction)
  never stalls a save: the save is dropped as a timeout and counted, the pages come back.
"""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fixtures.builders import GROUP_FP, MEMBER_FP, TOKENS, chunk_id, make_item
from kvpack import KVPackConfig, MemberObject, PagePart, Session
from kvpack.tiers.base import PutItem, TierStatus
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.host import HostTier, host_root
from kvpack.tiers.host.owners import dead_owners, live_users
from kvpack.tiers.host.pages import ARENA, Geometry

PAGE = 16 << 10
CAPACITY = 1 << 20
HOLDER = """
import fcntl, os, sqlite3, sys
root, how = sys.argv[1], sys.argv[2]
if how in ("file", "both"):
    fd = os.open(root + "/.kvpack-store.index.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
if how in ("sqlite", "both"):
    db = sqlite3.connect(root + "/.kvpack-store.index", isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
print("HELD", flush=True)
sys.stdin.read()
"""
"""A second process holding the index's write lock until its stdin closes: the lock file (as every
kvpack writer takes it first), SQLite's own lock, or both (a kvpack process stopped mid-transaction)."""
FORKER = """
import os, sys
sys.path.insert(0, sys.argv[2])
from fixtures.builders import GROUP_FP
from kvpack import KVPackConfig, Session
cfg = KVPackConfig.from_dict({"memory": {"mode": "host", "host_name": sys.argv[1], "capacity": 1 << 20},
                              "disk": {"enabled": False}})
session = Session.start(cfg, GROUP_FP)
print("OWNER", session.store.tiers[0].owner_token, flush=True)
if os.fork() == 0:
    print("CHILD", session.store.tiers[0].owner_token, flush=True)
    sys.stdin.read()
os._exit(0)
"""
"""A kvpack process on a host store that forks a child without exec and dies at once (no close)."""


@pytest.fixture
def name() -> Iterator[str]:
    n = f"edges-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    shutil.rmtree(host_root(n), ignore_errors=True)


def host_session(name: str) -> Session:
    cfg = KVPackConfig.from_dict(
        {"memory": {"mode": "host", "host_name": name, "capacity": CAPACITY}, "disk": {"enabled": False}}
    )
    return Session.start(cfg, GROUP_FP)


def test_a_payload_forged_in_the_mapping_between_the_check_and_the_copy_is_never_loaded(name: str) -> None:
    """The engine's copy (a part's `finish`, as SGLang's conversion) runs after the load's checks;
    another writer of the mapping strikes right before it. Every page the load reports restored
    holds its stored bytes; afterwards the forged page is refused (counted), not loaded."""
    session = host_session(name)
    kv = MemberObject("kv", MEMBER_FP, TOKENS, PAGE)
    rng = np.random.default_rng(7)
    pages = [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(4)]
    chunks = [chunk_id(i) for i in range(4)]
    try:
        assert all(session.save_pages("t", kv, chunks, lambda todo: [pages[j].data for j in todo]))
        fd = os.open(f"{host_root(name)}/{ARENA}", os.O_RDWR)
        hostile = mmap.mmap(fd, 0)  # the other writer's own mapping of the arena
        os.close(fd)
        at = hostile.find(pages[1].tobytes())
        assert at > 0
        forged = bytes(255 - b for b in pages[1].tobytes()[:64])

        def forge() -> None:
            hostile[at : at + 64] = forged

        engine = [np.zeros(PAGE, np.uint8) for _ in chunks]
        bufs = [np.zeros(PAGE, np.uint8) for _ in chunks]

        def finish(ok: list[bool], views: list[memoryview | None]) -> None:
            forge()  # between the load's verification and the engine's copy
            for j, (good, view) in enumerate(zip(ok, views)):
                if good:
                    engine[j][:] = np.frombuffer(view, np.uint8) if view is not None else bufs[j]

        part = PagePart(list(range(4)), session.page_reads("t", kv, chunks, [b.data for b in bufs]), finish)
        ok = session.load_pages([part], 4, lent=True, tenant="t")
        for j, good in enumerate(ok):
            assert not good or np.array_equal(engine[j], pages[j]), f"page {j}: forged bytes loaded as a hit"
        again = [np.zeros(PAGE, np.uint8) for _ in chunks]
        results = session.complete_load(
            session.prepare_load(session.page_reads("t", kv, chunks, [b.data for b in again]))
        ).results
        assert [r.ok for r in results] == [True, False, True, True]
        assert session.store.metrics.value("rejected_objects", reason="checksum") == 1
        hostile.close()
    finally:
        session.close()


def test_a_forked_child_does_not_keep_its_dead_parents_registration_alive(name: str) -> None:
    tests = str(Path(__file__).resolve().parent.parent)
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKER, name, tests], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdin is not None
    said = dict(proc.stdout.readline().split() for _ in range(2))
    assert proc.wait() == 0  # the parent is dead; its forked child lives, waiting on stdin
    parent, child = said["OWNER"], said["CHILD"]
    root = host_root(name)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with dead_owners(fd, set()) as dead:
            assert parent in dead, "the dead parent's registration is held by its forked child"
        assert child != parent and live_users(root) == 1  # the child registered as a user of its own
        proc.stdin.close()
        assert proc.stdout.read() == ""  # the child ended (its end of the pipe closed)
        with dead_owners(fd, set()) as dead:
            assert child in dead
    finally:
        os.close(fd)


def _census(tier: HostTier) -> tuple[int, int, int]:
    free, limbo, held = tier.page_census()
    assert free + limbo + held == Geometry.for_capacity(CAPACITY).pages
    return free, limbo, held


def _items(first: int, n: int) -> list[PutItem]:
    return [make_item("t", chunk_id(first + i), nbytes=3000, seed=first + i)[0] for i in range(n)]


def _hold(root: str, how: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, root, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "HELD"
    return proc


def _release(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait() == 0


@pytest.mark.parametrize("how", ["file", "sqlite", "both"])
def test_a_save_never_waits_for_a_stopped_holder_of_the_host_index(name: str, how: str) -> None:
    """The save is dropped (TIMEOUT, counted as ``index_busy``) within the write bound, not after
    the 10 s start-up wait; once the holder is gone the same objects are stored."""
    tier = HostTier(name, CAPACITY)
    try:
        items = _items(0, 3)
        holder = _hold(tier.root.as_posix(), how)
        try:
            assert tier.put_from(items) == [TierStatus.TIMEOUT] * 3
            assert tier.counters.removed["index_busy"] == 3
        finally:
            _release(holder)
        assert tier.put_from(items) == [TierStatus.OK] * 3
        assert _census(tier)[1] == 0
    finally:
        tier.close()


def test_a_put_whose_end_cannot_have_the_index_is_dropped_and_its_pages_come_back(name: str) -> None:
    """The holder takes the lock while the put copies its objects (after their admission): their
    end (`HostCatalog.finish`) times out, so they are not found yet (a miss, never a stall); the
    next put ends that put too (its objects were written whole), and no page is left in limbo."""
    holders: list[subprocess.Popen[str]] = []

    def take_lock_once() -> None:
        if not holders:
            holders.append(_hold(host_root(name), "both"))

    tier = HostTier(name, CAPACITY, region_copier=lambda: (take_lock_once(), None)[1])
    try:
        items = _items(0, 3)
        assert tier.put_from(items) == [TierStatus.TIMEOUT] * 3
        assert tier.counters.removed["index_busy"] == 3
        _release(holders[0])
        assert tier.contains([it.key for it in items]) == [False] * 3
        assert tier.put_from(_items(10, 1)) == [TierStatus.OK]
        assert tier.contains([it.key for it in items]) == [True] * 3
        _, limbo, held = _census(tier)
        assert limbo == 0 and held == 4
    finally:
        tier.close()


def test_a_disk_save_never_waits_for_a_stopped_holder_of_the_disk_index(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "store", CAPACITY)
    try:
        holder = _hold(str(tmp_path / "store"), "both")
        try:
            assert tier.put_from(_items(0, 2)) == [TierStatus.TIMEOUT] * 2
            assert tier.counters.removed["index_busy"] == 2
        finally:
            _release(holder)
        assert tier.put_from(_items(0, 2)) == [TierStatus.OK] * 2
    finally:
        tier.close()
