"""Local-disk tier: one directory, one file per object, atomic writes.

Layout: ``<root>/<tenant>/<fingerprint>/<chunk[:2]>/<chunk>.<member>.kvp``;
every path component comes from a validated `StoreKey`, so no key can escape
the root. A file is the object's header (`kvpack.objects`), zero padding up
to the next 4 KiB boundary, then the payload: page-aligned payloads make the
kernel's copy into the caller's buffer as fast as a plain file read, and a
reader gets header and payload in one `preadv`. Files are written to a
temporary name in the same folder and renamed into place, so a reader never
sees a half-written object.

On start the index is rebuilt from the headers of the files present (entries
survive a restart); files whose header does not decode, and leftover
temporaries, are deleted. Several processes may share one directory (a
prefill and a decode instance): `contains` and `get_into` also find files
that another process wrote after this one started. Capacity is enforced per
process over whole groups (LRU/ARC, tenant shares); with several writers the
bound is approximate.

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
from pathlib import Path

from ..eviction import CapacityManager, EvictionPolicy
from ..eviction.manager import Admission
from ..keys import GroupKey, StoreKey
from ..objects import (
    HEADER_PREFIX_BYTES,
    Expectation,
    ObjectHeader,
    ObjectRejected,
    RejectReason,
    check_header,
    Payload,
    check_payload,
    decode_header,
    header_length,
    payload_checksum,
    payload_nbytes,
    payload_parts,
)
from .base import GetResult, PutItem, Tier, TierStatus, TierUsage
from .parallel import IOThreads

SUFFIX = ".kvp"
PAGE = 4096


def data_offset(header_len: int) -> int:
    """Byte offset of the payload in a file whose header is `header_len` bytes."""
    return -(-header_len // PAGE) * PAGE


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
    ) -> None:
        self.root = Path(root).expanduser()
        self._root_str = str(self.root)
        self._fsync = fsync
        self._lock = threading.Lock()
        self._io = IOThreads(io_threads, min_items_per_thread=4, name="kvpack-disk")
        self._dirs: set[str] = set()
        """Folders known to exist (created by this process or seen); a removed one is recreated on ENOENT."""
        self._capacity = CapacityManager(capacity, policy, quotas)
        self._members: dict[GroupKey, set[StoreKey]] = {}
        self.on_evict: Callable[[GroupKey, int], None] | None = None
        self.startup_rejected = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()

    # -- paths and index ---------------------------------------------------------

    def path_of(self, key: StoreKey) -> Path:
        return Path(self._file_of(key))

    def _dir_of(self, key: StoreKey) -> str:
        return f"{self._root_str}/{key.tenant}/{key.fingerprint}/{key.chunk[:2]}"

    def _file_of(self, key: StoreKey) -> str:
        return f"{self._root_str}/{key.tenant}/{key.fingerprint}/{key.chunk[:2]}/{key.chunk}.{key.member}{SUFFIX}"

    @staticmethod
    def _key_from_header(header: ObjectHeader, fingerprint_dir: str) -> StoreKey:
        return StoreKey(header.tenant, fingerprint_dir, header.chunk, header.member)

    def _rebuild_index(self) -> None:
        found: list[tuple[float, StoreKey, int]] = []
        for path in self.root.glob("*/*/*/*"):
            if not path.is_file():
                continue
            if ".tmp." in path.name:
                _unlink_quietly(path)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                with open(path, "rb") as f:
                    header = _read_header(f)
                key = self._key_from_header(header, path.parent.parent.name)
                if self.path_of(key) != path:
                    raise ObjectRejected(RejectReason.GROUP, "file name does not match its header")
                st = path.stat()
                found.append((st.st_mtime, key, header.payload_len))
            except (ObjectRejected, OSError, ValueError):
                self.startup_rejected += 1
                _unlink_quietly(path)
        found.sort(key=lambda t: t[0])
        with self._lock:
            for _, key, nbytes in found:
                self._admit_locked(key, nbytes)

    def _admit_locked(self, key: StoreKey, nbytes: int) -> bool:
        plan = self._capacity.reserve(key.group, key.tenant, key.member, nbytes)
        if plan.admission is Admission.NO_SPACE:
            return False
        for victim in plan.victims:
            self._drop_group_locked(victim, evicted=True)  # type: ignore[arg-type]
        self._capacity.commit(key.group, key.tenant, key.member, nbytes)
        self._members.setdefault(key.group, set()).add(key)
        return True

    def _drop_group_locked(self, group: GroupKey, evicted: bool = False) -> int:
        members = self._capacity.release(group)
        if evicted and self.on_evict is not None:
            self.on_evict(group, sum(members.values()))
        keys = self._members.pop(group, set())
        for k in keys:
            _unlink_quietly(self._file_of(k))
        return len(keys)

    def _evict_locked(self, groups: Sequence[GroupKey]) -> None:
        for group in groups:
            self._drop_group_locked(group, evicted=True)

    # -- reads -------------------------------------------------------------------

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        with self._lock:
            known = [k.group in self._members and k in self._members[k.group] for k in keys]
        # Files written by another process sharing this directory.
        return [ok or os.path.isfile(self._file_of(k)) for k, ok in zip(keys, known)]

    def peek_headers(self, keys: Sequence[StoreKey]) -> list[ObjectHeader | None]:
        out: list[ObjectHeader | None] = []
        for key in keys:
            try:
                with open(self.path_of(key), "rb") as f:
                    out.append(_read_header(f))
            except (OSError, ObjectRejected):
                out.append(None)
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
        path = self._file_of(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return GetResult(TierStatus.MISS)
        except OSError as exc:
            return GetResult(TierStatus.ERROR, detail=f"{path}: {exc}")
        parts = payload_parts(dst)
        try:
            result = self._read_verified(fd, parts, exp)
        except ObjectRejected as exc:
            return GetResult(TierStatus.REJECTED, None, exc.reason, str(exc))
        except OSError as exc:
            return GetResult(TierStatus.ERROR, detail=f"{path}: {exc}")
        finally:
            os.close(fd)
        if not result.ok:
            return result
        header = result.header
        assert header is not None
        if verify:
            bad = check_payload(header, parts)
            if bad is not None:
                return GetResult(TierStatus.REJECTED, header, bad)
        return result

    @staticmethod
    def _read_verified(fd: int, parts: tuple[memoryview, ...], exp: Expectation) -> GetResult:
        """Header and payload of one open file into the destination `parts`;
        raises ObjectRejected on a bad header.

        Objects without token ids (every full chunk) have a header length known
        from the key, so header and payload arrive in one `preadv`."""
        size = os.fstat(fd).st_size
        want = sum([p.nbytes for p in parts])
        if size == PAGE + want:
            head = bytearray(PAGE)
            got = os.preadv(fd, [head, *parts], 0)
            header = decode_header(head)
            payload_got = got - PAGE
            offset = PAGE
        else:
            prefix = os.pread(fd, HEADER_PREFIX_BYTES, 0)
            total = header_length(prefix)
            header = decode_header(os.pread(fd, total, 0))
            payload_got = -1
            offset = data_offset(total)
        reason = check_header(header, exp)
        if reason is not None:
            return GetResult(TierStatus.REJECTED, header, reason)
        if want != header.payload_len:
            return GetResult(
                TierStatus.REJECTED, header, RejectReason.LENGTH, f"payload {header.payload_len} bytes, destination {want}"
            )
        if size != offset + header.payload_len:
            return GetResult(TierStatus.REJECTED, header, RejectReason.TRUNCATED, f"file of {size} bytes")
        if payload_got < 0:
            payload_got = _preadinto_full(fd, parts, offset)
        if payload_got != header.payload_len:
            return GetResult(TierStatus.REJECTED, header, RejectReason.TRUNCATED, f"{payload_got} of {header.payload_len} bytes")
        return GetResult(TierStatus.OK, header)

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
                admitted = self._capacity.admit(tenant, [(k.group, k.member, sizes[i]) for k, i in zip(keys, idx)], self._evict_locked)
                for i, key, ok in zip(idx, keys, admitted):
                    if not ok or not self._capacity.has_member(key.group, key.member):
                        statuses[i] = TierStatus.NO_SPACE  # no room, or evicted by a later item of the batch
                        continue
                    group_keys = self._members.get(key.group)
                    if group_keys is None:
                        self._members[key.group] = {key}
                    else:
                        group_keys.add(key)
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
                        self._drop_group_locked(key.group)
                elif not indexed:  # evicted while it was written (a later item, a concurrent put)
                    _unlink_quietly(self._file_of(key))
                    statuses[i] = TierStatus.NO_SPACE
        return statuses

    def _write_item(self, item: PutItem) -> TierStatus:
        header = item.header
        if header.checksum is None:
            header = _with_checksum(header, item.payload)
        return self._write_file(item.key, header.encode(), item.payload)

    def _write_file(self, key: StoreKey, header: bytes, payload: Payload) -> TierStatus:
        folder = self._dir_of(key)
        path = self._file_of(key)
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            if folder not in self._dirs:
                os.makedirs(folder, exist_ok=True)
                self._dirs.add(folder)
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:  # the folder was removed behind our back
                os.makedirs(folder, exist_ok=True)
                fd = os.open(tmp, flags, 0o600)
            try:
                _write_all(fd, [header + bytes(data_offset(len(header)) - len(header)), *payload_parts(payload)])
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            return TierStatus.OK
        except OSError as exc:
            _unlink_quietly(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return TierStatus.NO_SPACE
            return TierStatus.ERROR

    def remove_groups(self, groups: Sequence[GroupKey]) -> int:
        with self._lock:
            return sum(self._drop_group_locked(g) for g in groups)

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

    def close(self) -> None:
        self._io.close()


def _with_checksum(header: ObjectHeader, payload: Payload) -> ObjectHeader:
    from dataclasses import replace

    return replace(header, checksum=payload_checksum(payload))


def _read_header(f) -> ObjectHeader:  # type: ignore[no-untyped-def]
    prefix = f.read(HEADER_PREFIX_BYTES)
    total = header_length(prefix)
    rest = f.read(total - len(prefix))
    return decode_header(prefix + rest)


def _preadinto_full(fd: int, parts: tuple[memoryview, ...], offset: int) -> int:
    got = 0
    for part in parts:
        done = 0
        while done < part.nbytes:
            n = os.preadv(fd, [part[done:]], offset + got + done)
            if not n:
                return got + done
            done += n
        got += done
    return got


def _write_all(fd: int, buffers: list[bytes | memoryview]) -> None:
    views = [memoryview(b) for b in buffers]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _unlink_quietly(path: Path | str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

