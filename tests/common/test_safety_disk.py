"""Issue 15, disk tier: kvpack never touches what is not its own, never follows
what was planted, never blocks on a FIFO. Every test here failed on 9767245."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import GROUP_FP, chunk_id, expect, make_item

from kvpack.config.schema import DiskTierConfig, KVPackConfig, MemoryTierConfig
from kvpack.errors import ConfigError
from kvpack.identity.objects import RejectReason
from kvpack.store import KVStore
from kvpack.tiers.base import TierStatus
from kvpack.tiers.disk import DiskTier, data_offset

KIB = 1024
MARKER = ".kvpack-store"


def _fs():  # type: ignore[no-untyped-def]
    from kvpack.tiers.disk import fs as disk_fs

    return disk_fs


def _disk(root: Path, capacity: int = 1 << 30, **kw: object) -> DiskTier:
    return DiskTier(root, capacity, **kw)  # type: ignore[arg-type]


def _ours(name: str) -> bool:
    """The marker and the shared index beside it (``.kvpack-store.index``, its -wal/-shm, the build lock)."""
    return name == MARKER or name.startswith(MARKER + ".")


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not _ours(p.name))


def _dst() -> memoryview:
    return memoryview(np.empty(KIB, np.uint8))


# -- the store folder ---------------------------------------------------------------


def test_foreign_folder_is_refused_and_nothing_in_it_is_deleted(tmp_path: Path) -> None:
    planted = ["proj/src/pkg/main.py.tmp.1234", "data/2024/01/report.tmp.csv", "data/2024/01/backup.kvp"]
    for rel in planted:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"user data")
    with pytest.raises(ConfigError) as err:
        _disk(tmp_path)
    assert err.value.field == "disk.path"
    assert _files(tmp_path) == sorted(planted)
    assert not (tmp_path / MARKER).exists()


def test_new_or_empty_folder_is_marked_and_reopened(tmp_path: Path) -> None:
    tier = _disk(tmp_path / "store")
    item, _ = make_item("t", chunk_id(1))
    tier.put_from([item])
    marker = (tmp_path / "store" / MARKER).read_text()
    assert f"format {_fs().STORE_FORMAT}" in marker
    assert _disk(tmp_path / "store").contains([item.key]) == [True]


def test_marker_of_another_format_is_refused(tmp_path: Path) -> None:
    _disk(tmp_path)
    (tmp_path / MARKER).write_text("kvpack store\nformat 99\n")
    with pytest.raises(ConfigError, match="another format") as err:
        _disk(tmp_path)
    assert err.value.field == "disk.path"


@pytest.mark.parametrize("path", ["/", "/etc", "/usr", "/proc/self/kvpack", "/sys/kvpack", "/etc/"])
def test_system_folders_are_refused(path: str) -> None:
    # checked through open_store_root: a failing run must not scan the real /etc
    with pytest.raises(ConfigError) as err:
        _fs().open_store_root(path)
    assert err.value.field == "disk.path"


def _from_config(path: str) -> KVStore:
    config = KVPackConfig(memory=MemoryTierConfig(enabled=False), disk=DiskTierConfig(path=path))
    return KVStore.from_config(config)


@pytest.mark.parametrize("kind", ["file", "under_file", "nul", "long_name", "long_path", "proc"])
def test_unusable_paths_are_config_errors_naming_the_field(tmp_path: Path, kind: str) -> None:
    (tmp_path / "f").write_bytes(b"x")
    path = {
        "file": str(tmp_path / "f"),
        "under_file": str(tmp_path / "f" / "store"),
        "nul": str(tmp_path / "a\x00b"),
        "long_name": str(tmp_path / ("x" * 5000)),
        "long_path": str(tmp_path / "/".join(["y" * 200] * 30)),
        "proc": "/proc/self/kvpack-store",
    }[kind]
    with pytest.raises(ConfigError) as err:
        _from_config(path)
    assert err.value.field == "disk.path"
    with pytest.raises(ConfigError) as err2:  # the config alone already refuses what it can see
        KVPackConfig.from_dict({"disk": {"path": path}}) if kind in ("nul", "long_name", "long_path") else _from_config(
            path
        )
    assert err2.value.field == "disk.path"


# -- temporaries ----------------------------------------------------------------------


def test_only_stale_kvpack_temporaries_are_swept(tmp_path: Path) -> None:
    tier = _disk(tmp_path)
    item, _ = make_item("t", chunk_id(1))
    tier.put_from([item])
    leaf = tier.path_of(item.key).parent
    stale = leaf / _fs().temp_name(tier.path_of(item.key).name)
    fresh = leaf / _fs().temp_name(tier.path_of(item.key).name)
    foreign = [leaf / "notes.tmp.1234", leaf / f"{item.key.chunk}.kv.kvp.tmp.1.2"]
    for p in (stale, fresh, *foreign):
        p.write_bytes(b"half")
    old = time.time() - 3600
    for p in (stale, foreign[0]):
        os.utime(p, (old, old))
    reopened = _disk(tmp_path, stale_temp_s=600)
    assert not stale.exists()
    assert fresh.exists() and all(p.exists() for p in foreign)
    assert reopened.counters.removed == {"stale_temp": 1}


def test_a_writers_in_flight_temporaries_survive_another_open(tmp_path: Path) -> None:
    writer = _disk(tmp_path)
    stop = threading.Event()
    statuses: list[TierStatus] = []

    def write() -> None:
        i = 0
        while not stop.is_set():
            statuses.extend(writer.put_from([make_item("t", chunk_id(i % 8), nbytes=64 * KIB, seed=i)[0]]))
            i += 1

    thread = threading.Thread(target=write)
    thread.start()
    deadline = time.monotonic() + 3.0
    opened = 0
    while time.monotonic() < deadline:
        _disk(tmp_path).close()
        opened += 1
    stop.set()
    thread.join()
    assert opened > 3 and len(statuses) > 20
    assert statuses.count(TierStatus.OK) == len(statuses)


def test_planted_symlinks_at_old_style_temp_paths_are_never_written_through(tmp_path: Path) -> None:
    tier = _disk(tmp_path / "store")
    item, _ = make_item("t", chunk_id(1))
    tier.put_from([item])
    path = tier.path_of(item.key)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    for tid in {threading.get_ident(), *(t.ident for t in threading.enumerate())}:
        os.symlink(victim, f"{path}.tmp.{os.getpid()}.{tid}")
    assert tier.put_from([make_item("t", chunk_id(1), seed=5)[0]]) == [TierStatus.OK]
    assert victim.read_bytes() == b"precious"


# -- what the headers claim -------------------------------------------------------------


def test_a_lying_payload_length_is_refused_and_evicts_nothing(tmp_path: Path) -> None:
    tier = _disk(tmp_path, capacity=64 * KIB)
    bob = [make_item("bob", chunk_id(i), seed=i)[0] for i in range(10)]
    assert tier.put_from(bob) == [TierStatus.OK] * 10
    liar, _ = make_item("alice", chunk_id(99), nbytes=60 * KIB)
    path = tier.path_of(liar.key)
    path.parent.mkdir(parents=True)
    path.write_bytes(liar.header.encode().ljust(data_offset(len(liar.header.encode())), b"\0"))  # 4 KiB, claims 60
    reopened = _disk(tmp_path, capacity=64 * KIB)
    assert reopened.counters.startup_rejected == 1
    assert reopened.contains([b.key for b in bob]) == [True] * 10
    assert all(tier.path_of(b.key).exists() for b in bob)
    assert reopened.usage().used_bytes == 10 * KIB
    res = reopened.get_into([liar.key], [memoryview(np.empty(60 * KIB, np.uint8))], [expect(liar)], True)[0]
    assert res.status is TierStatus.REJECTED and res.reason is RejectReason.TRUNCATED


def test_a_second_process_with_a_smaller_capacity_deletes_nothing(tmp_path: Path) -> None:
    big = _disk(tmp_path, capacity=1 << 20)
    items = [make_item("t", chunk_id(i), seed=i)[0] for i in range(200)]
    assert big.put_from(items) == [TierStatus.OK] * 200
    small = _disk(tmp_path, capacity=16 * KIB)
    assert len(_files(tmp_path)) == 200
    # one index per folder: the small process sees the folder's usage; opening removed nothing
    assert small.usage().objects == 200 and small.counters.removed == {}
    assert small.contains([it.key for it in items]) == [True] * 200
    # its first put bounds the folder by its own capacity, oldest groups first
    extra = make_item("t", chunk_id(999), seed=999)[0]
    assert small.put_from([extra]) == [TierStatus.OK]
    assert small.usage().used_bytes <= 16 * KIB and len(_files(tmp_path)) == 16
    assert small.contains([it.key for it in items[-15:]] + [extra.key]) == [True] * 16


def test_every_removal_is_counted_with_its_reason(tmp_path: Path) -> None:
    tier = _disk(tmp_path, capacity=4 * KIB)
    evicted: list[int] = []
    tier.on_evict = lambda group, nbytes: evicted.append(nbytes)
    tier.put_from([make_item("t", chunk_id(i), seed=i)[0] for i in range(4)])
    tier.put_from([make_item("t", chunk_id(9))[0]])
    tier.remove_groups([make_item("t", chunk_id(9))[0].key.group])
    assert tier.counters.removed == {"evicted": 1, "removed": 1}
    assert evicted == [KIB]


def test_garbage_at_an_object_path_is_left_alone_but_never_reported(tmp_path: Path) -> None:
    tier = _disk(tmp_path)
    item, _ = make_item("t", chunk_id(1))
    tier.put_from([item])
    path = tier.path_of(item.key)
    path.write_bytes(b"\x80\x04 not written by kvpack")
    reopened = _disk(tmp_path)
    assert path.exists()  # kvpack cannot prove it wrote it: it does not delete it
    assert reopened.startup_rejected == 1 and reopened.contains([item.key]) == [False]
    assert reopened.put_from([item]) == [TierStatus.OK]  # its own store replaces it
    assert reopened.contains([item.key]) == [True]


# -- symlinks and special files ----------------------------------------------------------


def test_tenant_folder_replaced_by_a_symlink_is_never_followed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    tier = _disk(root)
    bob, _ = make_item("bob", chunk_id(1), seed=1)
    tier.put_from([bob])
    outside = tmp_path / "outside"
    (outside / GROUP_FP / chunk_id(2)[:2]).mkdir(parents=True)
    keep = outside / GROUP_FP / chunk_id(2)[:2] / f"{chunk_id(2)}.kv.kvp"
    keep.write_bytes(b"not kvpack's")
    os.symlink(outside, root / "eve")
    os.symlink(root / "bob", root / "alice")
    eve, _ = make_item("eve", chunk_id(3))
    alice, _ = make_item("alice", chunk_id(1), seed=7)
    assert tier.put_from([eve, alice]) == [TierStatus.ERROR, TierStatus.ERROR]
    assert sorted(p.name for p in outside.rglob("*") if p.is_file()) == [keep.name]
    dst = np.empty(KIB, np.uint8)
    res = tier.get_into([bob.key], [memoryview(dst)], [expect(bob)], True)[0]
    assert res.ok and np.array_equal(dst, np.frombuffer(bob.payload, np.uint8))  # alice did not replace bob's entry
    res = tier.get_into([alice.key], [_dst()], [expect(alice)], True)[0]
    assert res.status is TierStatus.REJECTED and res.reason is RejectReason.UNSAFE_FILE
    assert tier.contains([alice.key]) == [False]
    reopened = _disk(root)
    assert keep.exists() and reopened.counters.refused_unsafe >= 2
    assert tier.counters.refused_unsafe >= 3


def test_symlink_at_an_object_path_is_refused_not_read(tmp_path: Path) -> None:
    tier = _disk(tmp_path / "store")
    real, _ = make_item("t", chunk_id(1))
    link, _ = make_item("t", chunk_id(2))
    tier.put_from([real])
    os.symlink(tier.path_of(real.key), tier.path_of(link.key))  # same leaf folder: both chunks start "00"
    res = tier.get_into([link.key], [_dst()], [expect(link)], True)[0]
    assert res.status is TierStatus.REJECTED and res.reason is RejectReason.UNSAFE_FILE
    assert tier.peek_headers([link.key]) == [None]


def _within(seconds: float, fn) -> object:  # type: ignore[no-untyped-def]
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked"
    return out[0]


def test_a_fifo_at_an_object_path_never_blocks_load_or_peek(tmp_path: Path) -> None:
    tier = _disk(tmp_path / "store")
    item, _ = make_item("t", chunk_id(1))
    path = tier.path_of(item.key)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    res = _within(5, lambda: tier.get_into([item.key], [_dst()], [expect(item)], True)[0])
    assert res.status is TierStatus.REJECTED and res.reason is RejectReason.UNSAFE_FILE  # type: ignore[attr-defined]
    assert _within(5, lambda: tier.peek_headers([item.key])) == [None]
    assert _within(5, lambda: tier.contains([item.key])) == [False]
    reopened = _within(5, lambda: _disk(tmp_path / "store"))
    assert reopened.counters.refused_unsafe == 1  # type: ignore[attr-defined]


def test_fifo_tail_lookup_through_the_store_returns(tmp_path: Path) -> None:
    from kvpack.policy.groups import MemberRole, MemberSpec
    from kvpack.policy.tails import tail_chunk

    config = KVPackConfig(memory=MemoryTierConfig(enabled=False), disk=DiskTierConfig(path=str(tmp_path / "s")))
    store = KVStore.from_config(config)
    disk = store.tiers[0]
    assert isinstance(disk, DiskTier)
    item, _ = make_item("t", tail_chunk(None), token_ids=(1, 2, 3), token_count=3)
    path = disk.path_of(item.key)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    members = [MemberSpec("kv", MemberRole.TARGET)]
    found = _within(5, lambda: store.tails.find("t", GROUP_FP, None, [1, 2, 3], members, 1))
    assert found is None
    store.close()


# -- folders freed ------------------------------------------------------------------------


def test_folders_of_a_tenant_with_nothing_stored_are_removed(tmp_path: Path) -> None:
    tier = _disk(tmp_path, capacity=8 * KIB)
    for n in range(40):  # 40 tenants (cache_salt values), one store each, most evicted
        tier.put_from([make_item(f"salt-{n}", chunk_id(n), seed=n)[0]])
    dirs = [p for p in tmp_path.rglob("*") if p.is_dir()]
    assert len(dirs) == 8 * 3  # tenant/fingerprint/cc for the 8 that fit, nothing else
    assert len(tier.tenants()) == 8
    tier.remove_groups([make_item(f"salt-{n}", chunk_id(n))[0].key.group for n in range(32, 40)])
    assert [p for p in tmp_path.iterdir() if not _ours(p.name) or p.name == MARKER] == [tmp_path / MARKER]


def test_walk_fallback_refuses_symlinks_like_openat2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fs(), "_use_openat2", False)
    test_tenant_folder_replaced_by_a_symlink_is_never_followed(tmp_path)


def test_processes_starting_on_one_new_folder_at_once_all_adopt_it(tmp_path: Path) -> None:
    root = tmp_path / "new"
    errors: list[Exception] = []
    barrier = threading.Barrier(8)

    def start() -> None:
        barrier.wait()
        try:
            for _ in range(20):
                _disk(root).close()
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(p.name for p in root.iterdir() if not _ours(p.name) or p.name == MARKER) == [MARKER]
