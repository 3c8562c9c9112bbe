"""Local-disk tier: one marked directory, one file per object, atomic writes.

Layout: ``<root>/<tenant>/<fingerprint>/<chunk[:2]>/<chunk>.<member>.kvp``;
every path component comes from a validated `StoreKey`, so no key can escape
the root. A file is the object's header (`kvpack.objects`), zero padding up
to the next 4 KiB boundary, then the payload: page-aligned payloads make the
kernel's copy into the caller's buffer as fast as a plain file read, and a
reader gets header and payload in one `preadv`. Files are written to a
random temporary name in the same folder (``O_EXCL``) and renamed into place,
so a reader never sees a half-written object.

kvpack never touches what is not its own (`kvpack.tiers.disk_fs`):
- the root is a new or empty folder that kvpack marks (``.kvpack-store``, with
  the format version), or one it marked before; anything else is refused at
  start-up with a ConfigError naming ``disk.path``;
- every open inside starts from the root's directory fd and refuses symlinks
  and non-regular files (counted in `DiskCounters.refused_unsafe`; a load of
  such an entry is a REJECTED(UNSAFE_FILE) miss, never a block on a FIFO);
- a file is deleted only when kvpack can prove it wrote it: an indexed object
  (its header decoded, named its path and matched the file's size) when its
  group is evicted or removed, its own temporary file after a failed write,
  or, at start-up, a temporary file of exactly kvpack's random-name pattern
  older than `stale_temp_s` (a live writer's temporaries survive). Every
  removal is counted with its reason (`DiskCounters.removed`). Folders are
  removed only when empty (`rmdir`), when the last object indexed in them goes.

On start the index is rebuilt from the headers of the files present (entries
survive a restart), newest groups first, as long as they fit this process's
capacity without evicting anything: a second process with a smaller capacity
indexes fewer groups but deletes none. Files whose header does not decode,
names another path, or whose size differs from what the header claims are
left alone, not indexed and counted (`startup_rejected`). Several processes
may share one directory (a prefill and a decode instance): `contains` and
`get_into` also find files that another process wrote after this one
started. Capacity is enforced per process over whole groups (LRU/ARC, tenant
shares); with several writers the bound is approximate.

Batches: capacity for a whole put batch is planned under the lock in one
pass (`CapacityManager.admit`), then the files are checksummed and written,
and a get batch's files are read and verified, on `io_threads` threads
(`kvpack.tiers.parallel`: file I/O releases the GIL). A file whose group was
evicted while it was being written is removed again, so the index and the
directory agree.

Failures never raise: a vanished or unwritable directory is ERROR, a full
disk NO_SPACE, a bad object REJECTED with its reason.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..eviction import CapacityManager, EvictionPolicy
from ..eviction.manager import Admission
from ..keys import GroupKey, StoreKey
from ..objects import (
    Expectation,
    ObjectHeader,
    ObjectRejected,
    Payload,
    RejectReason,
    check_payload,
    payload_checksum,
    payload_nbytes,
    payload_parts,
)
from . import disk_fs
from .base import GetResult, PutItem, Tier, TierStatus, TierUsage
from .disk_files import SUFFIX, data_offset, read_header_fd, read_verified, write_all
from .disk_fs import UnsafeEntry
from .parallel import IOThreads

STALE_TEMP_S = 900.0
"""A temporary file untouched this long is a crashed writer's, swept at start-up."""


@dataclass
class DiskCounters:
    """What the tier refused and removed (plain ints: read them, never reset)."""

    refused_unsafe: int = 0
    """Opens refused: a symlink or a non-regular file where an object or folder belongs."""
    startup_rejected: int = 0
    """Files left alone at start-up: header unreadable, naming another path, or a size it does not have."""
    startup_unindexed: int = 0
    """Valid groups left unindexed at start-up (they did not fit this process's capacity)."""
    removed: dict[str, int] = field(default_factory=dict)
    """Files removed, by reason: evicted, removed (`remove_groups`: damaged or dropped by the
    store), failed_write (the rest of a group one of whose members could not be written),
    own_temp (this writer's temporary after a failed write), evicted_while_written, stale_temp."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count_removed(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.removed[reason] = self.removed.get(reason, 0) + n

    def count_unsafe(self) -> None:
        with self._lock:
            self.refused_unsafe += 1


class DiskTier(Tier):
    name = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity: int,
        policy: EvictionPolicy,
        quotas: dict[str, int] | None = None,
        fsync: bool = False,
        io_threads: int = 1,
        *,
        stale_temp_s: float = STALE_TEMP_S,
    ) -> None:
        """Raises ConfigError naming ``disk.path`` for a folder kvpack must not use (`disk_fs.open_store_root`)."""
        self._root_str, self._root_fd = disk_fs.open_store_root(os.fspath(root))
        self.root = Path(self._root_str)
        self._old_root_fds: list[int] = []
        self._fsync = fsync
        self._stale_temp_s = stale_temp_s
        self._lock = threading.Lock()
        self._root_lock = threading.Lock()
        self._io = IOThreads(io_threads, min_items_per_thread=4, name="kvpack-disk")
        self._capacity = CapacityManager(capacity, policy, quotas)
        self._members: dict[GroupKey, set[StoreKey]] = {}
        self._leaf_objects: dict[str, int] = {}
        """Indexed objects per leaf folder (``tenant/fp/cc``); at 0 the empty folders are removed."""
        self._refused: dict[StoreKey, tuple[int, int]] = {}
        """Keys whose file was refused, by the file's (inode, mtime_ns).

        `contains` skips them until the file changes.
        """
        self.counters = DiskCounters()
        self.on_evict: Callable[[GroupKey, int], None] | None = None
        from .disk_index import rebuild_index

        rebuild_index(self)

    @property
    def startup_rejected(self) -> int:
        return self.counters.startup_rejected

    # -- paths -------------------------------------------------------------------

    def path_of(self, key: StoreKey) -> Path:
        return Path(f"{self._root_str}/{_rel_file(key)}")

    def _reopen_root(self, seen_fd: int) -> None:
        """The root folder was deleted under us: recreate and re-mark it (a new, empty folder).

        The old fd stays open until `close` (another thread may still hold its number)."""
        with self._root_lock:
            if self._root_fd != seen_fd:
                return
            _, fd = disk_fs.open_store_root(self._root_str)
            self._old_root_fds.append(self._root_fd)
            self._root_fd = fd

    # -- index -------------------------------------------------------------------

    def _index_locked(self, key: StoreKey) -> None:
        """Record `key` as indexed (its capacity is already committed)."""
        keys = self._members.get(key.group)
        if keys is None:
            self._members[key.group] = {key}
        elif key in keys:
            return
        else:
            keys.add(key)
        leaf = _rel_leaf(key)
        self._leaf_objects[leaf] = self._leaf_objects.get(leaf, 0) + 1
        self._refused.pop(key, None)

    def _admit_locked(self, key: StoreKey, nbytes: int) -> bool:
        plan = self._capacity.reserve(key.group, key.tenant, key.member, nbytes)
        if plan.admission is not Admission.ADMITTED:
            return False
        for victim in plan.victims:
            self._drop_group_locked(victim, "evicted")  # type: ignore[arg-type]
        self._capacity.commit(key.group, key.tenant, key.member, nbytes)
        self._index_locked(key)
        return True

    def _drop_group_locked(self, group: GroupKey, reason: str) -> int:
        """Forget `group` and delete its indexed files (proven kvpack's), counted under `reason`."""
        members = self._capacity.release(group)
        if reason == "evicted" and self.on_evict is not None:
            self.on_evict(group, sum(members.values()))
        keys = self._members.pop(group, set())
        for k in keys:
            if self._unlink_key(k):
                self.counters.count_removed(reason)
            self._leaf_gone_locked(k)
        return len(keys)

    def _leaf_gone_locked(self, key: StoreKey) -> None:
        leaf = _rel_leaf(key)
        left = self._leaf_objects.get(leaf, 0) - 1
        if left > 0:
            self._leaf_objects[leaf] = left
            return
        self._leaf_objects.pop(leaf, None)
        _remove_empty_folders(self._root_fd, key)

    def _evict_locked(self, groups: Sequence[GroupKey]) -> None:
        for group in groups:
            self._drop_group_locked(group, "evicted")

    def _unlink_key(self, key: StoreKey) -> bool:
        try:
            dfd = disk_fs.open_dir(self._root_fd, _rel_leaf(key))
        except OSError:
            return False
        try:
            os.unlink(_file_name(key), dir_fd=dfd)
            return True
        except OSError:
            return False
        finally:
            os.close(dfd)

    def _refuse(self, key: StoreKey, fd: int | None = None) -> None:
        """Remember that `key`'s file (as it is now) was refused, so `contains` stops reporting it."""
        try:
            st = os.fstat(fd) if fd is not None else None
        except OSError:
            st = None
        with self._lock:
            if len(self._refused) > 65536:
                self._refused.clear()  # bounded: forgetting only makes contains() report a few more candidates
            self._refused[key] = (st.st_ino, st.st_mtime_ns) if st is not None else (-1, -1)

    # -- reads -------------------------------------------------------------------

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        with self._lock:
            members, refused = self._members, self._refused
            known: list[bool] = []
            marks: list[tuple[int, int] | None] = []
            for k in keys:
                group_keys = members.get(k.group)
                ok = group_keys is not None and k in group_keys
                known.append(ok)
                marks.append(refused.get(k) if refused and not ok else None)
        # Files written by another process sharing this directory.
        return [ok or self._present(k, mark) for k, ok, mark in zip(keys, known, marks)]

    def _present(self, key: StoreKey, refused: tuple[int, int] | None) -> bool:
        try:
            fd = disk_fs.open_regular(self._root_fd, _rel_file(key))
        except UnsafeEntry:
            self.counters.count_unsafe()
            return False
        except OSError:
            return False
        try:
            if refused is None:
                return True
            st = os.fstat(fd)
            return (st.st_ino, st.st_mtime_ns) != refused
        finally:
            os.close(fd)

    def peek_headers(self, keys: Sequence[StoreKey]) -> list[ObjectHeader | None]:
        """Headers of the files at the keys' paths; None for a missing, refused or
        unreadable file, or one whose header names another key."""
        out: list[ObjectHeader | None] = []
        for key in keys:
            try:
                fd = disk_fs.open_regular(self._root_fd, _rel_file(key))
            except UnsafeEntry:
                self.counters.count_unsafe()
                out.append(None)
                continue
            except OSError:
                out.append(None)
                continue
            try:
                header = read_header_fd(fd)
                ok = header.tenant == key.tenant and header.chunk == key.chunk and header.member == key.member
                out.append(header if ok else None)
            except (OSError, ObjectRejected):
                out.append(None)
            finally:
                os.close(fd)
        return out

    def get_into(
        self,
        keys: Sequence[StoreKey],
        dsts: Sequence[Payload],
        expected: Sequence[Expectation],
        verify_checksum: bool,
    ) -> list[GetResult]:
        """Read and check each file, spread over `io_threads`; then one locked
        pass that touches the hits and indexes files another process wrote."""

        def part(lo: int, hi: int) -> list[GetResult]:
            return [self._get_one(keys[i], dsts[i], expected[i], verify_checksum) for i in range(lo, hi)]

        results = self._io.split(len(keys), part)
        with self._lock:
            capacity = self._capacity
            for key, res in zip(keys, results):
                if not res.ok:
                    continue
                group = key.group
                if capacity.has_member(group, key.member):
                    capacity.touch(group)
                else:
                    assert res.header is not None
                    self._admit_locked(key, res.header.payload_len)  # written by another process
        return results

    def _get_one(self, key: StoreKey, dst: Payload, exp: Expectation, verify: bool) -> GetResult:
        rel = _rel_file(key)
        try:
            fd = disk_fs.open_regular(self._root_fd, rel)
        except FileNotFoundError:
            return _MISS
        except UnsafeEntry as exc:
            self.counters.count_unsafe()
            return GetResult(TierStatus.REJECTED, None, RejectReason.UNSAFE_FILE, f"{rel}: {exc.strerror}")
        except OSError as exc:
            return GetResult(TierStatus.ERROR, detail=f"{rel}: {exc}")
        parts = payload_parts(dst)
        try:
            result = read_verified(fd, parts, exp)
            if result.ok and verify:
                assert result.header is not None
                bad = check_payload(result.header, parts)
                if bad is not None:
                    result = GetResult(TierStatus.REJECTED, result.header, bad)
            if result.reason in _DAMAGED:
                self._refuse(key, fd)
            return result
        except ObjectRejected as exc:
            self._refuse(key, fd)
            return GetResult(TierStatus.REJECTED, None, exc.reason, str(exc))
        except OSError as exc:
            return GetResult(TierStatus.ERROR, detail=f"{rel}: {exc}")
        finally:
            os.close(fd)

    # -- writes ------------------------------------------------------------------

    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        """Admit the batch under one lock, write its files on `io_threads`, then
        un-index the files that failed and remove those evicted meanwhile."""
        n = len(items)
        statuses = [TierStatus.OK] * n
        sizes = [payload_nbytes(item.payload) for item in items]
        by_tenant: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            if sizes[i] != item.header.payload_len:
                statuses[i] = TierStatus.ERROR
            else:
                by_tenant.setdefault(item.key.tenant, []).append(i)
        with self._lock:
            for tenant, idx in by_tenant.items():
                keys = [items[i].key for i in idx]
                admitted = self._capacity.admit(
                    tenant, [(k.group, k.member, sizes[i]) for k, i in zip(keys, idx)], self._evict_locked
                )
                for i, key, ok in zip(idx, keys, admitted):
                    if not ok or not self._capacity.has_member(key.group, key.member):
                        statuses[i] = TierStatus.NO_SPACE  # no room, or evicted by a later item of the batch
                        continue
                    self._index_locked(key)
        todo = [i for i in range(n) if statuses[i] is TierStatus.OK]

        def part(lo: int, hi: int) -> list[TierStatus]:
            return [self._write_item(items[i]) for i in todo[lo:hi]]

        for i, status in zip(todo, self._io.split(len(todo), part)):
            statuses[i] = status
        with self._lock:
            for i in todo:
                key = items[i].key
                group_keys = self._members.get(key.group)
                indexed = group_keys is not None and key in group_keys
                if statuses[i] is not TierStatus.OK:
                    if indexed:
                        self._drop_group_locked(key.group, "failed_write")
                elif not indexed:  # evicted while it was written (a later item, a concurrent put)
                    if self._unlink_key(key):
                        self.counters.count_removed("evicted_while_written")
                    if _rel_leaf(key) not in self._leaf_objects:
                        _remove_empty_folders(self._root_fd, key)
                    statuses[i] = TierStatus.NO_SPACE
        return statuses

    def _write_item(self, item: PutItem) -> TierStatus:
        header = item.header
        if header.checksum is None:
            header = replace(header, checksum=payload_checksum(item.payload))
        return self._write_file(item.key, header.encode(), item.payload)

    def _write_file(self, key: StoreKey, header: bytes, payload: Payload) -> TierStatus:
        """Write to a fresh ``O_EXCL`` temporary in the key's folder, then rename over the object.

        A folder removed meanwhile (an emptied leaf, another process, the whole
        root) is recreated and the write retried, a bounded number of times."""
        leaf, name = _rel_leaf(key), _file_name(key)
        buffers = [header + bytes(data_offset(len(header)) - len(header)), *payload_parts(payload)]
        for _attempt in range(3):
            root_fd = self._root_fd
            try:
                dfd = disk_fs.open_dir(root_fd, leaf)
            except FileNotFoundError:
                if not self._make_leaf(root_fd, leaf):
                    return TierStatus.ERROR
                continue
            except UnsafeEntry:
                self.counters.count_unsafe()
                return TierStatus.ERROR
            except OSError as exc:
                return _write_status(exc)
            try:
                return self._write_in(dfd, name, buffers)
            except FileNotFoundError:  # the folder went between open and create: retry
                continue
            except OSError as exc:
                return _write_status(exc)
            finally:
                os.close(dfd)
        return TierStatus.ERROR

    def _make_leaf(self, root_fd: int, leaf: str) -> bool:
        try:
            disk_fs.make_dirs(root_fd, leaf)
            return True
        except UnsafeEntry:
            self.counters.count_unsafe()
            return False
        except FileNotFoundError:
            if not disk_fs.root_removed(root_fd):
                return False
            try:
                self._reopen_root(root_fd)
                return True
            except Exception:  # noqa: BLE001 - a root that cannot be recreated is an ERROR, not a crash
                return False
        except OSError:
            return False

    def _write_in(self, dfd: int, name: str, buffers: list[bytes | memoryview]) -> TierStatus:
        fd, tmp = disk_fs.create_temp(dfd, name)
        try:
            try:
                write_all(fd, buffers)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            return TierStatus.OK
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)  # created with O_EXCL just now: provably ours
                self.counters.count_removed("own_temp")
            except OSError:
                pass
            raise

    def remove_groups(self, groups: Sequence[GroupKey]) -> int:
        with self._lock:
            return sum(self._drop_group_locked(g, "removed") for g in groups)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(
                used_bytes=self._capacity.used,
                capacity_bytes=self._capacity.capacity,
                objects=sum(len(m) for m in self._members.values()),
                groups=len(self._members),
            )

    def tenant_used(self, tenant: str) -> int:
        with self._lock:
            return self._capacity.tenant_used(tenant)

    def tenants(self) -> list[str]:
        """Tenants with anything indexed (their tables exist only while they store something)."""
        with self._lock:
            return sorted({g.tenant for g in self._members})

    def close(self) -> None:
        self._io.close()
        for fd in self._old_root_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._old_root_fds.clear()


_MISS = GetResult(TierStatus.MISS)
_DAMAGED = frozenset({RejectReason.TRUNCATED, RejectReason.CHECKSUM, RejectReason.GROUP})
"""Refusals of a file that decoded but is not a whole, intact object of its path: `contains` skips it."""


def _rel_leaf(key: StoreKey) -> str:
    return f"{key.tenant}/{key.fingerprint}/{key.chunk[:2]}"


def _file_name(key: StoreKey) -> str:
    return f"{key.chunk}.{key.member}{SUFFIX}"


def _rel_file(key: StoreKey) -> str:
    return f"{key.tenant}/{key.fingerprint}/{key.chunk[:2]}/{key.chunk}.{key.member}{SUFFIX}"


def _write_status(exc: OSError) -> TierStatus:
    return TierStatus.NO_SPACE if exc.errno in (errno.ENOSPC, errno.EDQUOT) else TierStatus.ERROR


def _remove_empty_folders(root_fd: int, key: StoreKey) -> None:
    """``rmdir`` the key's leaf, fingerprint and tenant folders, innermost first, while empty.

    `rmdir` never removes a folder with anything in it, so nothing but empty folders can go."""
    chain = ((f"{key.tenant}/{key.fingerprint}", key.chunk[:2]), (key.tenant, key.fingerprint))
    for parent, child in chain:
        try:
            pfd = disk_fs.open_dir(root_fd, parent)
        except OSError:
            return
        try:
            os.rmdir(child, dir_fd=pfd)
        except OSError:
            return
        finally:
            os.close(pfd)
    try:
        os.rmdir(key.tenant, dir_fd=root_fd)
    except OSError:
        pass
