"""The disk tier's start-up scan: rebuild the index from the files present.

Walks ``<root>/<tenant>/<fingerprint>/<cc>/`` from the root's directory fd,
one ``O_NOFOLLOW`` folder at a time (a symlinked folder is skipped and
counted, never followed), and only through names a `StoreKey` could produce.

For each object file: the header must decode, name exactly the path it is
at, and claim a payload the file really holds (``size == data offset +
payload_len``); anything else is left alone (not indexed, not deleted) and
counted in `DiskCounters.startup_rejected`. Valid objects are indexed whole
group by whole group, newest first, while they fit the tier's capacity
without evicting anything (`DiskCounters.startup_unindexed` counts the rest),
so opening a shared folder never deletes a valid object.

The only files removed are temporaries of exactly kvpack's random-name
pattern (`disk_fs.is_temp_name`) that are regular files older than the
tier's `stale_temp_s`, counted as ``stale_temp``.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..eviction.manager import Admission
from ..keys import GroupKey, StoreKey, validate_chunk_hash, validate_member, validate_tenant
from ..objects import ObjectRejected, RejectReason
from . import disk_fs

if TYPE_CHECKING:
    from .disk import DiskTier


@dataclass
class _Group:
    key: GroupKey
    newest: float = 0.0
    members: list[tuple[StoreKey, int]] = field(default_factory=list)


def rebuild_index(tier: DiskTier) -> None:
    """Fill `tier`'s index from its folder (see the module docstring). Never deletes an object."""
    from .disk_files import SUFFIX, data_offset, read_header_fd

    groups: dict[GroupKey, _Group] = {}
    now = time.time()
    root_fd = tier._root_fd  # noqa: SLF001 - the tier's own helper
    counters = tier.counters
    for tenant, fp, cc, dfd in _leaf_folders(root_fd, counters):
        try:
            names = os.listdir(dfd)
        except OSError:
            continue
        for name in names:
            if disk_fs.is_temp_name(name):
                _sweep_temp(dfd, name, now, tier._stale_temp_s, counters)  # noqa: SLF001
                continue
            key = _key_of(tenant, fp, cc, name, SUFFIX)
            if key is None:
                continue  # not a name kvpack writes: not ours to judge
            try:
                fd = disk_fs.open_regular(root_fd, f"{tenant}/{fp}/{cc}/{name}")
            except disk_fs.UnsafeEntry:
                counters.count_unsafe()
                continue
            except OSError:
                continue
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
                tier._refused[key] = (st.st_ino, st.st_mtime_ns) if st is not None else (-1, -1)  # noqa: SLF001
                continue
            finally:
                os.close(fd)
            group = groups.get(key.group)
            if group is None:
                group = groups[key.group] = _Group(key.group)
            group.newest = max(group.newest, st.st_mtime)
            group.members.append((key, header.payload_len))
        os.close(dfd)
    _admit_newest_first(tier, list(groups.values()))


def _admit_newest_first(tier: DiskTier, groups: list[_Group]) -> None:
    """Index whole groups, newest first, while each fits without evicting anything."""
    groups.sort(key=lambda g: g.newest, reverse=True)
    capacity = tier._capacity  # noqa: SLF001
    with tier._lock:  # noqa: SLF001
        for group in groups:
            requests = [(k.group, k.member, n) for k, n in group.members]
            plan = capacity.reserve_many(group.key.tenant, requests)
            if plan.admission is not Admission.ADMITTED or plan.victims:
                tier.counters.startup_unindexed += 1
                continue
            capacity.commit_many(group.key.tenant, requests)
            for k, _ in group.members:
                tier._index_locked(k)  # noqa: SLF001


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


def _sweep_temp(dfd: int, name: str, now: float, stale_s: float, counters) -> None:  # type: ignore[no-untyped-def]
    st = disk_fs.lstat_regular(dfd, name)
    if st is None or now - st.st_mtime < stale_s:
        return  # a live writer's temporary (or not a regular file): leave it
    try:
        os.unlink(name, dir_fd=dfd)
        counters.count_removed("stale_temp")
    except OSError:
        pass


def _subdirs(dfd: int, counters, valid) -> Iterator[tuple[str, int]]:  # type: ignore[no-untyped-def]
    """(name, fd) of each sub-folder of `dfd` whose name passes `valid`; symlinks refused, counted."""
    try:
        entries = list(os.scandir(dfd))
    except OSError:
        return
    for entry in entries:
        name = entry.name
        try:
            valid(name)
        except ValueError:
            continue
        try:
            mode = entry.stat(follow_symlinks=False).st_mode
        except OSError:
            continue
        if stat.S_ISLNK(mode):
            counters.count_unsafe()
            continue
        if not stat.S_ISDIR(mode):
            continue
        try:
            fd = disk_fs.open_dir(dfd, name)
        except OSError:
            counters.count_unsafe()
            continue
        yield name, fd


def _cc(name: str) -> str:
    if len(name) != 2:
        raise ValueError(name)
    return validate_chunk_hash(name)


def _leaf_folders(root_fd: int, counters) -> Iterator[tuple[str, str, str, int]]:  # type: ignore[no-untyped-def]
    """(tenant, fingerprint, cc, fd) of every leaf folder; the caller closes each fd."""
    for tenant, tfd in _subdirs(root_fd, counters, validate_tenant):
        try:
            for fp, ffd in _subdirs(tfd, counters, validate_chunk_hash):
                try:
                    for cc, cfd in _subdirs(ffd, counters, _cc):
                        yield tenant, fp, cc, cfd
                finally:
                    os.close(ffd)
        finally:
            os.close(tfd)
