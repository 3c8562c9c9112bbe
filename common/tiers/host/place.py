"""Where a host store lives, and whether this host's shared memory can hold it.

A host store is the folder ``<shm>/kvpack-<uid>-<name>`` (`host_root`): per user
(`fs.open_store_root` creates it 0700; a symlink, or a folder or file there that is not
this user's alone, is refused on its descriptor: `kvpack.tiers.disk.private`)
and per store (`store_name`: `memory.host_name`, else the disk store's identity), so
two unrelated stores never mix. `shm_problem`
says, in one line, why the folder cannot hold `capacity` bytes: no such folder,
not tmpfs (a disk would be the disk tier, with a page-cache copy), not writable,
smaller than the capacity plus the index's allowance, or, for a store not made yet
(its arena is allocated whole when it is), without that much free now.
"""

from __future__ import annotations

import hashlib
import os

from ...config.schema import KVPackConfig
from ..disk.fs import SHM
from .pages import ARENA, Geometry

INDEX_ALLOWANCE = 64 << 20
"""Room the shared memory needs beyond `capacity`: the SQLite index, its WAL and lock files (bytes)."""
_TMPFS = "tmpfs"


def store_name(config: KVPackConfig) -> str:
    """The host store `config` names: ``memory.host_name``; else one per disk store
    (``disk-`` and a hash of its resolved path), or ``default`` with the disk tier off."""
    if config.memory.host_name:
        return config.memory.host_name
    if not config.disk.enabled:
        return "default"
    return disk_store_name(os.path.realpath(os.path.expanduser(config.disk.path)))


def disk_store_name(real: str) -> str:
    """The host store name of the disk store at resolved path `real`: ``disk-`` and a hash of it."""
    return "disk-" + hashlib.blake2b(os.fsencode(real), digest_size=8).hexdigest()


def host_root(name: str, shm: str = SHM, uid: int | None = None) -> str:
    """The folder of host store `name` for user `uid` (default: this process's)."""
    return f"{shm}/kvpack-{os.getuid() if uid is None else uid}-{name}"


def _fs_type(path: str) -> str | None:
    """The file-system type of the mount holding `path` (the longest mount point above it)."""
    best, kind = "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                point = fields[4].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, right.split()[0]
    except OSError:
        return None
    return kind


def shm_problem(capacity: int, shm: str = SHM, root: str | None = None) -> str | None:
    """Why `shm` cannot hold a host store of `capacity` bytes (one line), or None when it can.

    A store is allocated whole when it is made (`pages.create_arena`), so a new one needs that much
    free space now; the store at `root`, if it already has its arena, needs none."""
    real = os.path.realpath(shm)
    if not os.path.isdir(real):
        return f"{shm} does not exist (no shared memory on this host)"
    kind = _fs_type(real)
    if kind is not None and kind != _TMPFS:
        return f"{shm} is {kind}, not tmpfs"
    if not os.access(real, os.W_OK | os.X_OK):
        return f"{shm} is not writable by uid {os.getuid()}"
    st = os.statvfs(real)
    size = st.f_blocks * st.f_frsize
    need = Geometry.for_capacity(capacity).file_bytes + INDEX_ALLOWANCE
    if size < need:
        return (
            f"{shm} holds {size >> 20} MiB, less than memory.capacity ({capacity >> 20} MiB) plus "
            f"{INDEX_ALLOWANCE >> 20} MiB for the index (docker: --shm-size)"
        )
    free = st.f_bavail * st.f_frsize
    made = root is not None and os.path.isfile(os.path.join(root, ARENA))
    if not made and free < need:
        return (
            f"{shm} has {free >> 20} MiB free, less than memory.capacity ({capacity >> 20} MiB) plus "
            f"{INDEX_ALLOWANCE >> 20} MiB for the index (other files use the rest)"
        )
    return None
