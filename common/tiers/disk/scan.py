"""The disk tier's folder scan: index (or re-check) the folder's files into the shared catalog.

Run by one process per folder at a time (an ``flock`` on ``.kvpack-store.build``;
the others skip it), on a background thread (the opener waits for it only a
short budget, `DiskTier`'s ``open_scan_s``). For a store written before the
persistent index (`kvpack.tiers.index.catalog`), or whose index file was
deleted, it builds the index while lookups are answered from the folder
itself; for an indexed store it reconciles: files written by a crashed or
older writer are indexed (a crashed writer's row not marked ready is marked
so), indexed files damaged since are un-indexed, rows whose file the scan did
not see are un-indexed (`FolderReconcile.sweep_unseen`: ready before the scan began,
so a file deleted while no kvpack process ran is not found by the next one;
or never marked ready and older than the write grace), and stale temporaries
are swept. The sweep is skipped when a folder could not be listed (an
unlisted file is not a missing one).

Walks ``<root>/<tenant>/<fingerprint>/<cc>/`` from the root's directory fd,
one ``O_NOFOLLOW`` folder at a time (a symlinked folder is skipped and
counted, never followed), and only through names a `StoreKey` could produce.

A file that a ready row of the index already describes is not opened: when
its ``lstat`` is a regular file last modified `SAME_FILE_MARGIN_NS` or more
before the row became ready (``mtime + margin <= since``: file times come from
the kernel's coarse clock, up to a tick behind) whose size is the row's payload plus whole pages of
header, it is the file that was indexed (`_unchanged`). This makes a reopen's
reconcile one ``lstat`` per file instead of an open and two reads. A file
damaged in place since, keeping its size and mtime, stays indexed until a load
reads it: loads verify the header and checksum, so it is a miss then (and
unindexed), never a load of wrong bytes.

Every other object file is read: the header must decode, name exactly the path it is
at, and claim a payload the file really holds (``size == data offset +
payload_len``); anything else is left alone (not indexed, not deleted) and
counted in `DiskCounters.startup_rejected`. Valid objects are indexed without
evicting anything (the folder may be over capacity until the next put evicts
its oldest groups), so opening a shared folder never deletes a valid object.

The only files removed are temporaries of exactly kvpack's random-name
pattern (`fs.is_temp_name`) that are regular files older than
`stale_temp_s`, counted as ``stale_temp``.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Protocol

from ...identity.keys import StoreKey, validate_chunk_hash, validate_member, validate_tenant
from ...identity.objects import ObjectRejected, RejectReason
from ..index.catalog import WRITE_GRACE_S, Catalog
from . import fs
from .files import PAGE, SUFFIX, data_offset, read_header_fd
from .reconcile import FolderReconcile

BUILD_LOCK = ".kvpack-store.build"
BATCH = 2000
"""Objects indexed per transaction (keeps each one short next to the puts of other processes)."""
SAME_FILE_MARGIN_NS = 50_000_000
"""A file modified this close to (or after) its row became ready is read again by the scan (`_unchanged`)."""


class Counters(Protocol):
    startup_rejected: int

    def count_unsafe(self) -> None: ...

    def count_removed(self, reason: str, n: int = 1) -> None: ...


def try_build_lock(root_fd: int) -> int | None:
    """An fd holding the folder's build lock, or None when another process holds it."""
    fd = os.open(BUILD_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=root_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def build_index(
    root_fd: int,
    catalog: Catalog,
    counters: Counters,
    stale_temp_s: float,
    refuse: Callable[[StoreKey, os.stat_result | None], None],
    write_grace_s: float = WRITE_GRACE_S,
    stop: threading.Event | None = None,
) -> int | None:
    """Index every valid object file of the folder into `catalog`, unindex the rows whose
    file it did not see, then mark it complete; returns the objects found. `refuse` is told of
    each file left alone. A row not ready is a write in progress for `write_grace_s` after its
    admission. Never deletes an object. `stop` set (the tier closes): it ends after the leaf
    folder at hand, keeps what it indexed, marks nothing complete (the next start scans again)
    and returns None."""
    now = time.time()
    began_ns = time.time_ns()
    stale_ns = began_ns - int(write_grace_s * 1e9)
    found: list[tuple[StoreKey, int, int]] = []
    rejected: list[StoreKey] = []
    seen: list[StoreKey] = []
    unlisted: list[str] = []
    reconcile = FolderReconcile(catalog)
    reconcile.begin_scan()

    def reject(key: StoreKey, st: os.stat_result | None) -> None:
        rejected.append(key)
        refuse(key, st)

    total = 0
    leaves = _leaf_folders(root_fd, counters, unlisted)
    stopped = False
    for tenant, fp, cc, dfd in leaves:
        if stop is not None and stop.is_set():
            os.close(dfd)
            stopped = True
            break
        try:
            names = os.listdir(dfd)
        except FileNotFoundError:
            names = []
        except OSError:
            names = []
            unlisted.append(f"{tenant}/{fp}/{cc}")
        objects: list[tuple[str, StoreKey]] = []
        for name in names:
            if fs.is_temp_name(name):
                _sweep_temp(dfd, name, now, stale_temp_s, counters)
                continue
            key = _key_of(tenant, fp, cc, name, SUFFIX)
            if key is not None:  # else: not a name kvpack writes, not ours to judge
                objects.append((name, key))
        rows = catalog.ready_rows([key for _, key in objects]) if objects else []
        for (name, key), row in zip(objects, rows):
            seen.append(key)
            if row is not None and _unchanged(dfd, name, row):
                continue  # indexed, ready, and the same file: nothing to add
            entry = _check_file(root_fd, key, f"{tenant}/{fp}/{cc}/{name}", counters, reject)
            if entry is not None:
                found.append(entry)
        os.close(dfd)
        if len(found) >= BATCH or len(seen) >= BATCH or rejected:
            reconcile.add_found(found, stale_ns)
            catalog.forget(rejected, stale_ns)  # indexed before, damaged since: no longer reported
            reconcile.note_seen(seen)
            total += len(found)
            found, rejected, seen = [], [], []
    leaves.close()  # closes the folders a stopped walk still holds open
    reconcile.add_found(found, stale_ns)
    catalog.forget(rejected, stale_ns)
    reconcile.note_seen(seen)
    if stopped:
        return None
    if not unlisted:
        reconcile.sweep_unseen(began_ns, stale_ns)
    catalog.mark_complete()
    _release_heap()
    return total + len(found)


def _release_heap() -> None:
    """Hand the scan's freed heap back to the system (glibc keeps a thread's arena otherwise:
    tens of MB on a large folder). Best effort: a no-op where libc has no ``malloc_trim``."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _unchanged(dfd: int, name: str, row: tuple[int, int]) -> bool:
    """Is `name` a regular file of the size a header plus the row's payload makes, last
    written `SAME_FILE_MARGIN_NS` before the row (bytes, ready ns) became ready?"""
    st = fs.lstat_regular(dfd, name)
    if st is None:
        return False
    header = st.st_size - row[0]
    return st.st_mtime_ns + SAME_FILE_MARGIN_NS <= row[1] and header > 0 and header % PAGE == 0


def _check_file(
    root_fd: int,
    key: StoreKey,
    rel: str,
    counters: Counters,
    refuse: Callable[[StoreKey, os.stat_result | None], None],
) -> tuple[StoreKey, int, int] | None:
    try:
        fd = fs.open_regular(root_fd, rel)
    except fs.UnsafeEntry:
        counters.count_unsafe()
        return None
    except OSError:
        return None
    st: os.stat_result | None = None
    try:
        st = os.fstat(fd)
        header = read_header_fd(fd)
        if (header.tenant, header.chunk, header.member) != (key.tenant, key.chunk, key.member):
            raise ObjectRejected(RejectReason.GROUP, "header names another object")
        if st.st_size != data_offset(header.encoded_len) + header.payload_len:
            raise ObjectRejected(RejectReason.TRUNCATED, "payload length does not match the file size")
    except (ObjectRejected, OSError, ValueError):
        counters.startup_rejected += 1
        refuse(key, st)
        return None
    finally:
        os.close(fd)
    return key, header.payload_len, st.st_mtime_ns


def _key_of(tenant: str, fp: str, cc: str, name: str, suffix: str) -> StoreKey | None:
    """The key whose file name `name` is in leaf ``tenant/fp/cc``, or None for any other name."""
    if not name.endswith(suffix):
        return None
    stem = name[: -len(suffix)]
    chunk, _, member = stem.partition(".")
    try:
        validate_chunk_hash(chunk)
        validate_member(member)
    except ValueError:
        return None
    if chunk[:2] != cc:
        return None
    return StoreKey(tenant, fp, chunk, member)


def _sweep_temp(dfd: int, name: str, now: float, stale_s: float, counters: Counters) -> None:
    st = fs.lstat_regular(dfd, name)
    if st is None or now - st.st_mtime < stale_s:
        return  # a live writer's temporary (or not a regular file): leave it
    try:
        os.unlink(name, dir_fd=dfd)
        counters.count_removed("stale_temp")
    except OSError:
        pass


def _subdirs(
    dfd: int, counters: Counters, valid: Callable[[str], object], unlisted: list[str]
) -> Iterator[tuple[str, int]]:
    """(name, fd) of each sub-folder of `dfd` whose name passes `valid`; symlinks refused, counted.
    A folder that cannot be listed or opened is appended to `unlisted`."""
    try:
        entries = list(os.scandir(dfd))
    except OSError:
        unlisted.append(str(dfd))
        return
    for entry in entries:
        name = entry.name
        try:
            valid(name)
        except ValueError:
            continue
        try:
            mode = entry.stat(follow_symlinks=False).st_mode
        except FileNotFoundError:
            continue  # removed meanwhile (emptied by an eviction): nothing of it is indexed
        except OSError:
            unlisted.append(name)
            continue
        if stat.S_ISLNK(mode):
            counters.count_unsafe()
            continue
        if not stat.S_ISDIR(mode):
            continue
        try:
            fd = fs.open_dir(dfd, name)
        except fs.UnsafeEntry:
            counters.count_unsafe()
            continue
        except FileNotFoundError:
            continue
        except OSError:
            unlisted.append(name)
            continue
        yield name, fd


def _cc(name: str) -> str:
    if len(name) != 2:
        raise ValueError(name)
    return validate_chunk_hash(name)


def _leaf_folders(
    root_fd: int, counters: Counters, unlisted: list[str]
) -> Generator[tuple[str, str, str, int], None, None]:
    """(tenant, fingerprint, cc, fd) of every leaf folder; the caller closes each fd; folders
    that could not be listed or opened are appended to `unlisted`."""
    for tenant, tfd in _subdirs(root_fd, counters, validate_tenant, unlisted):
        try:
            for fp, ffd in _subdirs(tfd, counters, validate_chunk_hash, unlisted):
                try:
                    for cc, cfd in _subdirs(ffd, counters, _cc, unlisted):
                        yield tenant, fp, cc, cfd
                finally:
                    os.close(ffd)
        finally:
            os.close(tfd)
