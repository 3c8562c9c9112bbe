"""The host memory tier (`kvpack.tiers.host`): one store in /dev/shm for every kvpack process.

Real processes (tests/common/host_child.py, each a `kvpack.Session` with
``memory.mode: host`` and the disk off) write and read one host store:

- what one process stored, a second process loads, byte for byte;
- 1, 2 and 4 processes writing 1.5x the budget each: the shared memory (every
  file of the store folder, as tmpfs holds it) plus each writer's resident growth
  stays within 1.05x the budget plus `STAGING_BOUND` per process;
- writers SIGKILLed mid-store five times: every later load is exact or a miss, no
  temporary file or dead owner is left, the index and the files agree, and a store
  of the whole budget succeeds (the space the dead writers had reserved came back
  at once, not after the disk tier's 60 s grace);
- ``memory.mode: auto`` picks the host tier for an engine of several processes or
  beside a live user of the store; /dev/shm too small is one line (host) or a
  warning and the per-process tier (auto);
- stores of another name or user never mix; the integrity key applies;
- a store outlives its processes until dropped (``kvpack host drop``), which a live
  user prevents.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fixtures.builders import GROUP_FP, MEMBER_FP, TOKENS, chunk_id
from fixtures.warm_start import KVPACK_MODULES, ScriptProcess, warm_starts
from kvpack import (
    ChunkFacts,
    ConfigError,
    KVPackConfig,
    KVStore,
    MemberObject,
    MemoryMode,
    ObjectIO,
    Session,
    TierStatus,
)
from kvpack.cli import main
from kvpack.tiers.factory import build_tiers
from kvpack.tiers.host import (
    HostTier,
    disk_store_name,
    drop,
    host_root,
    host_stores,
    memory_mode,
    resolve_memory,
    shm_problem,
    store_name,
)
from kvpack.tiers.host.owners import OWNERS
from kvpack.tiers.host.pages import Geometry
from kvpack.tiers.memory import MemoryTier

CHILD = str(Path(__file__).with_name("host_child.py"))
PAGE = 256 << 10
STAGING_BOUND = 16 << 20
"""What one writer process may hold beyond the shared store (bytes): its batch in flight (8 pages
of 256 KiB), SQLite's page cache (2 MiB) and the allocator's slack."""


@pytest.fixture
def name() -> Iterator[str]:
    n = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    shutil.rmtree(host_root(n), ignore_errors=True)


def child(mode: str, name: str, capacity: int, first: int, count: int) -> ScriptProcess:
    """host_child.py with pipes for stdin and stdout, forked from a process that imported torch."""
    args = [CHILD, mode, name, str(capacity), str(first), str(count), str(PAGE)]
    env = dict(os.environ)
    return warm_starts().start_script(
        sys.executable, args, env, subprocess.PIPE, None, stdin=subprocess.PIPE, modules=KVPACK_MODULES
    )


def line(proc: ScriptProcess, word: str) -> list[int]:
    assert proc.stdout is not None
    for text in proc.stdout:
        if text.startswith(word):
            return [int(x) for x in text.split()[1:]]
    raise AssertionError(f"child ended (rc={proc.wait()}) without {word}")


def held_bytes(root: str) -> int:
    """What tmpfs holds for every file under `root` (allocated blocks)."""
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(root) for f in fs)


def test_a_second_process_loads_what_the_first_stored(name: str) -> None:
    writer = child("store", name, 64 << 20, 0, 32)
    assert line(writer, "STORED") == [32]
    assert writer.wait() == 0
    reader = child("load", name, 64 << 20, 0, 40)
    assert line(reader, "LOADED") == [32, 0, 8]  # 32 exact hits, none wrong, 8 never stored
    assert reader.wait() == 0


def test_a_long_lived_process_sees_what_later_processes_store_and_evict(name: str) -> None:
    """This process keeps the store open (as an engine does) while two others write in turn; its
    lookups see the second's pages and the first's evicted ones. Regression: the index's own file
    checks closed descriptors of files SQLite held, which drops every POSIX lock the process holds on
    them (SQLite's WAL read marks), and this process kept reading the index as it was."""
    import host_child

    capacity = 40 * PAGE  # the second writer's 32 pages push out some of the first's 32
    session = Session.start(host_child.config(name, capacity), GROUP_FP)
    try:
        first = child("store", name, capacity, 0, 32)
        assert line(first, "STORED") == [32] and first.wait() == 0
        assert host_child.load(session, 0, 32, PAGE) == (32, 0, 0)
        second = child("store", name, capacity, 100, 32)
        assert line(second, "STORED") == [32] and second.wait() == 0
        assert host_child.load(session, 100, 32, PAGE) == (32, 0, 0)  # the later process's pages
        hits, wrong, misses = host_child.load(session, 0, 32, PAGE)
        assert wrong == 0 and misses > 0, (hits, misses)  # and the first's it evicted are gone here too
    finally:
        session.close()


@pytest.mark.parametrize("writers", [1, 2, 4])
def test_one_budget_for_every_process_of_the_host(name: str, writers: int) -> None:
    budget = 64 << 20
    each = (budget * 3 // 2) // PAGE  # every writer alone writes 1.5x the budget
    procs = [child("budget", name, budget, 1_000_000 * (w + 1), each) for w in range(writers)]
    try:
        growth = [line(p, "GROWTH")[0] for p in procs]
        shared = held_bytes(host_root(name))  # while every writer still has the store open
    finally:
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
            p.wait()
    total = shared + sum(growth)
    print(f"writers={writers} shared={shared >> 20} MiB growth={[g >> 20 for g in growth]} MiB")
    assert shared > budget * 0.9  # the store filled
    assert total <= 1.05 * budget + writers * STAGING_BOUND


def test_writers_killed_mid_store_leave_exact_loads_and_their_space(name: str) -> None:
    budget = 32 << 20
    root = host_root(name)
    for k in range(5):
        proc = child("loop", name, budget, 10_000 * k, 0)
        line(proc, "STARTED")
        watch = HostTier(name, budget)
        try:  # until it has stored a few pages (and is storing more): then kill it by its pid
            deadline = time.monotonic() + 60
            while watch.usage().objects < 8 * (k + 1) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            watch.close()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    tier = HostTier(name, budget)  # opening reclaims what the dead writers held
    try:
        mine = [tier.owner_token]
        assert [n for n in os.listdir(f"{root}/{OWNERS}") if not n.startswith(".")] == mine, "a dead owner is left"
        free, limbo, held = tier.page_census()
        geometry = Geometry.for_capacity(budget)
        assert free + limbo + held == geometry.pages, "a page is lost or counted twice"
        assert limbo == 0, "a dead writer's pages were not freed"
        assert held * geometry.page_bytes == tier.usage().used_bytes, "the index's bytes and its pages disagree"
    finally:
        tier.close()
    for k in range(5):  # every page any writer may have stored: exact or a miss
        reader = child("load", name, budget, 10_000 * k, 128)
        hits, wrong, _ = line(reader, "LOADED")
        assert wrong == 0
        assert reader.wait() == 0
    whole = budget // (PAGE + geometry.page_bytes)  # an object costs its payload and one page for its header
    writer = child("store", name, budget, 500_000, whole)
    assert line(writer, "STORED") == [whole], "the dead writers' space did not come back"
    assert writer.wait() == 0


def test_loads_racing_other_processes_saves_and_evictions_are_exact_or_a_miss(name: str) -> None:
    """Two processes save the same 48 pages over and over (each save replaces the other's object,
    and the store, 24 pages big, evicts all the time) while a third loads them over and over: every
    hit is exact, and a load that raced a rewrite of its pages is a miss, not a refusal (the pages'
    stamps: without them the checksum refuses such a load, counted as a damaged object, and drops it)."""
    budget = 24 * (PAGE + 4096)
    writers = [child("cycle", name, budget, 0, 48) for _ in range(2)]
    for w in writers:
        line(w, "STARTED")
    reader = child("watch", name, budget, 0, 48)
    line(reader, "STARTED")
    time.sleep(4)  # the race runs this long; any length shows the same: the test needs no timing
    for p in (reader, *writers):
        assert p.stdin is not None
        p.stdin.close()
    hits, wrong, misses, refused = line(reader, "READ")
    for p in (reader, *writers):
        assert p.wait(60) == 0
    print(f"hits={hits} wrong={wrong} misses={misses} refused={refused}")
    assert wrong == 0 and refused == 0
    assert hits > 0 and misses > 0  # the race happened: some loads found their page, some did not


def test_auto_picks_the_host_tier_for_several_processes_or_beside_a_live_user(name: str) -> None:
    def cfg(mode: str, capacity: int = 64 << 20) -> KVPackConfig:
        return KVPackConfig.from_dict(
            {"memory": {"mode": mode, "host_name": name, "capacity": capacity}, "disk": {"enabled": False}}
        )

    assert memory_mode(cfg("auto")) is MemoryMode.PROCESS  # one process, nobody else on the store
    assert memory_mode(cfg("auto"), engine_processes=2) is MemoryMode.HOST
    assert resolve_memory(cfg("auto"), 4).memory.mode is MemoryMode.HOST
    assert memory_mode(cfg("process"), engine_processes=8) is MemoryMode.PROCESS
    other = HostTier(name, 64 << 20)  # another live process's store (an owner of its own)
    try:
        assert memory_mode(cfg("auto")) is MemoryMode.HOST
        tiers = build_tiers(cfg("auto"))
        assert [t.name for t in tiers] == ["host"]
        for t in tiers:
            t.close()
    finally:
        other.close()
    assert memory_mode(cfg("auto")) is MemoryMode.PROCESS  # it left: nobody lives on the store
    unnamed = [KVPackConfig.from_dict({"disk": {"path": p}}) for p in ("/tmp/a", "/tmp/b", "/tmp/a/")]
    assert store_name(unnamed[0]) != store_name(unnamed[1]) and store_name(unnamed[0]) == store_name(unnamed[2])
    assert store_name(KVPackConfig.from_dict({"disk": {"enabled": False}})) == "default"
    assert isinstance(build_tiers(cfg("auto"))[0], MemoryTier)


def test_shared_memory_too_small_is_one_line_or_the_per_process_tier(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    huge = 1 << 50
    assert shm_problem(huge) is not None
    big = KVPackConfig.from_dict({"memory": {"mode": "host", "host_name": name, "capacity": huge}})
    with pytest.raises(ConfigError) as err:
        build_tiers(big)
    assert "memory.mode" in str(err.value) and "\n" not in str(err.value)
    auto = KVPackConfig.from_dict({"memory": {"mode": "auto", "host_name": name, "capacity": huge}})
    with caplog.at_level(logging.WARNING, logger="kvpack"):
        assert memory_mode(auto, engine_processes=2) is MemoryMode.PROCESS
    assert "per-process memory tier" in caplog.text
    assert shm_problem(64 << 20, "/nonexistent-shm") is not None


def test_a_new_store_needs_its_whole_arena_free_an_existing_one_does_not(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arena is allocated whole when a store is made: a /dev/shm big enough but filled by other
    files is one line for a new store (auto falls back to the per-process tier), nothing for one made."""
    real = os.statvfs("/dev/shm")
    fields = {f: getattr(real, f) for f in ("f_frsize", "f_blocks", "f_bavail")}
    fields["f_bavail"] = (8 << 20) // real.f_frsize  # 8 MiB free, whatever the size
    full = type("Statvfs", (), fields)
    monkeypatch.setattr("kvpack.tiers.host.place.os.statvfs", lambda path: full)
    problem = shm_problem(64 << 20, root=host_root(name))
    assert problem is not None and "free" in problem and "\n" not in problem
    monkeypatch.undo()
    HostTier(name, 64 << 20).close()  # made now (the real /dev/shm has room)
    monkeypatch.setattr("kvpack.tiers.host.place.os.statvfs", lambda path: full)
    assert shm_problem(64 << 20, root=host_root(name)) is None


def session(name: str, key: str = "") -> Session:
    """A session on host store `name` (disk off), with integrity key `key` when given."""
    extra = {"integrity_key": key} if key else {}
    config = KVPackConfig.from_dict(
        {"memory": {"mode": "host", "host_name": name, "capacity": 8 << 20}, "disk": {"enabled": False}, **extra}
    )
    return Session(KVStore(config, build_tiers(config)), GROUP_FP)


OBJ = MemberObject("kv", MEMBER_FP, TOKENS, 4096)
DATA = np.arange(4096, dtype=np.uint8)


def loaded(s: Session) -> bool:
    """Did `s` load chunk 1 exactly (False: a miss or a refusal: the buffer's bytes are not the object's)?"""
    buf = np.zeros(4096, np.uint8)
    got = s.complete_load(
        s.prepare_load(s.reads("t", [ObjectIO(ChunkFacts(chunk_id(1), TOKENS), OBJ, buf.data)]))
    ).results
    ok = got[0].status is TierStatus.OK
    assert np.array_equal(buf, DATA) or not ok
    return ok


def test_stores_of_another_name_or_user_never_mix(name: str) -> None:
    assert host_root(name, uid=1) != host_root(name, uid=2)
    other = f"{name}-other"
    sessions = [session(name), session(other), session(name)]
    try:
        assert sessions[0].save_pages("t", OBJ, [chunk_id(1)], lambda todo: [DATA.data]) == [True]
        assert [loaded(s) for s in sessions[1:]] == [False, True]
    finally:
        for s in sessions:
            s.close()
        shutil.rmtree(host_root(other), ignore_errors=True)


def test_the_integrity_key_applies_to_the_host_tier(name: str) -> None:
    writer, stranger, reader = session(name, "11" * 16), session(name, "22" * 16), session(name, "11" * 16)
    try:
        assert writer.save_pages("t", OBJ, [chunk_id(1)], lambda todo: [DATA.data]) == [True]
        assert [loaded(reader), loaded(stranger)] == [True, False]
    finally:
        for s in (writer, stranger, reader):
            s.close()


def test_the_disk_below_the_host_store_is_written_by_the_write_back_threads(name: str, tmp_path: Path) -> None:
    """A save returns once the host store holds its objects; the disk tier gets them from the
    write-back threads, sealed once: a process reading the disk alone, with the same integrity
    key, loads them exactly."""
    key = "33" * 16
    config = KVPackConfig.from_dict(
        {
            "memory": {"mode": "host", "host_name": name, "capacity": 8 << 20},
            "disk": {"path": str(tmp_path / "kv")},
            "integrity_key": key,
        }
    )
    tiers = build_tiers(config)
    disk = tiers[1]
    writers: list[str] = []
    put_from = disk.put_from

    def recorded(items):  # type: ignore[no-untyped-def]
        writers.append(threading.current_thread().name)
        return put_from(items)

    disk.put_from = recorded  # type: ignore[method-assign]
    writer = Session(KVStore(config, tiers), GROUP_FP)
    try:
        assert writer.save_pages("t", OBJ, [chunk_id(1)], lambda todo: [DATA.data]) == [True]
        assert loaded(writer)  # from the host store, at once
        assert writer.store.flush(30.0)
        assert writers and all(w.startswith("kvpack-writeback") for w in writers), writers
    finally:
        writer.close()
    disk_only = KVPackConfig.from_dict(
        {"memory": {"enabled": False}, "disk": {"path": str(tmp_path / "kv")}, "integrity_key": key}
    )
    reader = Session(KVStore(disk_only, build_tiers(disk_only)), GROUP_FP)
    try:
        assert loaded(reader)
    finally:
        reader.close()


def test_past_its_byte_bound_the_host_stores_queue_leaves_the_disk_write_to_the_saver(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind the host store the write-back queue holds copies, at most `HOST_QUEUE_BYTES`: with
    room for one object and that one's disk write held, a save of four writes the other three to
    disk itself; nothing is dropped and a disk-only reader loads all four."""
    monkeypatch.setattr("kvpack.store.writer.HOST_QUEUE_BYTES", DATA.nbytes)
    config = KVPackConfig.from_dict(
        {"memory": {"mode": "host", "host_name": name, "capacity": 8 << 20}, "disk": {"path": str(tmp_path / "kv")}}
    )
    tiers = build_tiers(config)
    disk = tiers[1]
    held = threading.Event()
    writers: list[tuple[str, int]] = []
    put_from = disk.put_from

    def recorded(items):  # type: ignore[no-untyped-def]
        writers.append((threading.current_thread().name, len(items)))
        if threading.current_thread().name.startswith("kvpack-writeback"):
            assert held.wait(30.0)
        return put_from(items)

    disk.put_from = recorded  # type: ignore[method-assign]
    writer = Session(KVStore(config, tiers), GROUP_FP)
    chunks = [chunk_id(i) for i in range(1, 5)]
    try:
        assert writer.save_pages("t", OBJ, chunks, lambda todo: [DATA.data] * len(todo)) == [True] * 4
        assert (threading.current_thread().name, 3) in writers, writers
        held.set()
        assert writer.store.flush(30.0)
        assert writer.store.metrics.value("store_dropped") == 0
    finally:
        held.set()
        writer.close()
    disk_only = KVPackConfig.from_dict({"memory": {"enabled": False}, "disk": {"path": str(tmp_path / "kv")}})
    reader = Session(KVStore(disk_only, build_tiers(disk_only)), GROUP_FP)
    try:
        bufs = [np.zeros(4096, np.uint8) for _ in chunks]
        got = reader.complete_load(
            reader.prepare_load(
                reader.reads("t", [ObjectIO(ChunkFacts(c, TOKENS), OBJ, b.data) for c, b in zip(chunks, bufs)])
            )
        ).results
        assert [r.status for r in got] == [TierStatus.OK] * 4
        assert all(np.array_equal(b, DATA) for b in bufs)
    finally:
        reader.close()


def test_a_store_outlives_its_processes_until_dropped_and_never_under_a_live_user(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = host_root(name)
    tier = HostTier(name, 8 << 20)
    try:
        assert [(s.name, s.users) for s in host_stores() if s.name == name] == [(name, 1)]
        assert drop(name) is not None and os.path.isdir(root)  # a live user: refused, one line
        assert main(["host", "drop", name]) == 2
        assert "1 live user" in capsys.readouterr().err
    finally:
        tier.close()
    assert os.path.isdir(root)  # the last user's exit leaves it (a later process finds its objects)
    assert main(["host"]) == 0 and f"{name}\t" in capsys.readouterr().out
    assert main(["host", "drop", name]) == 0
    assert not os.path.exists(root)
    assert not [n for n in os.listdir(os.path.dirname(root)) if n.startswith(os.path.basename(root) + ".")]
    assert main(["host", "drop", "../etc"]) == 2  # a name, never a path
    assert "not a host store name" in capsys.readouterr().err
    cfg = KVPackConfig.from_dict({"disk": {"path": "/tmp/a"}})
    assert store_name(cfg) == disk_store_name("/tmp/a")
