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
from .base import GetResult, PutItem, Tier, TierStatus, TierUsage, check_fits

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
    ) -> None:
        self.root = Path(root).expanduser()
        self._fsync = fsync
        self._lock = threading.Lock()
        self._capacity = CapacityManager(capacity, policy, quotas)
        self._members: dict[GroupKey, set[StoreKey]] = {}
        self.on_evict: Callable[[GroupKey, int], None] | None = None
        self.startup_rejected = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild_index()

    # -- paths and index ---------------------------------------------------------

    def path_of(self, key: StoreKey) -> Path:
        return self.root / key.tenant / key.fingerprint / key.chunk[:2] / f"{key.chunk}.{key.member}{SUFFIX}"

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
            _unlink_quietly(self.path_of(k))
        return len(keys)

    # -- reads -------------------------------------------------------------------

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        with self._lock:
            known = [k.group in self._members and k in self._members[k.group] for k in keys]
        # Files written by another process sharing this directory.
        return [ok or self.path_of(k).is_file() for k, ok in zip(keys, known)]

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
        results = [self._get_one(k, d, e, verify_checksum) for k, d, e in zip(keys, dsts, expected)]
        with self._lock:
            for key, res in zip(keys, results):
                if res.ok:
                    self._capacity.touch(key.group)
        return results

    def _get_one(self, key: StoreKey, dst: Payload, exp: Expectation, verify: bool) -> GetResult:
        path = self.path_of(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return GetResult(TierStatus.MISS)
        except OSError as exc:
            return GetResult(TierStatus.ERROR, detail=f"{path}: {exc}")
        try:
            result = self._read_verified(fd, dst, exp)
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
            bad = check_payload(header, dst)
            if bad is not None:
                return GetResult(TierStatus.REJECTED, header, bad)
        with self._lock:
            if not self._capacity.has_member(key.group, key.member):
                self._admit_locked(key, header.payload_len)  # written by another process
        return result

    @staticmethod
    def _read_verified(fd: int, dst: Payload, exp: Expectation) -> GetResult:
        """Header and payload of one open file; raises ObjectRejected on a bad header.

        Objects without token ids (every full chunk) have a header length known
        from the key, so header and payload arrive in one `preadv`."""
        size = os.fstat(fd).st_size
        parts = payload_parts(dst)
        if size == PAGE + payload_nbytes(dst):
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
        misfit = check_fits(dst, header)
        if misfit is not None:
            return misfit
        if size != offset + header.payload_len:
            return GetResult(TierStatus.REJECTED, header, RejectReason.TRUNCATED, f"file of {size} bytes")
        if payload_got < 0:
            payload_got = _preadinto_full(fd, parts, offset)
        if payload_got != header.payload_len:
            return GetResult(TierStatus.REJECTED, header, RejectReason.TRUNCATED, f"{payload_got} of {header.payload_len} bytes")
        return GetResult(TierStatus.OK, header)

    # -- writes ------------------------------------------------------------------

    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        return [self._put_one(item) for item in items]

    def _put_one(self, item: PutItem) -> TierStatus:
        key, payload = item.key, item.payload
        header = item.header
        nbytes = payload_nbytes(payload)
        if nbytes != header.payload_len:
            return TierStatus.ERROR
        if header.checksum is None:
            header = _with_checksum(header, payload)
        with self._lock:
            plan = self._capacity.reserve(key.group, key.tenant, key.member, nbytes)
            if plan.admission is Admission.NO_SPACE:
                return TierStatus.NO_SPACE
            for victim in plan.victims:
                self._drop_group_locked(victim, evicted=True)  # type: ignore[arg-type]
            self._capacity.commit(key.group, key.tenant, key.member, nbytes)
            self._members.setdefault(key.group, set()).add(key)
        status = self._write_file(self.path_of(key), header.encode(), payload)
        if status is not TierStatus.OK:
            with self._lock:
                members = self._members.get(key.group)
                if members is not None and key in members:
                    self._drop_group_locked(key.group)
        return status

    def _write_file(self, path: Path, header: bytes, payload: Payload) -> TierStatus:
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
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


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass

