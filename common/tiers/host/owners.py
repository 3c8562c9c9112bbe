"""Which processes use a host store, and which of them died (the host memory tier's liveness).

Each process that opens the store registers an owner: a file
``.kvpack-store.owners/<pid>-<random>`` on which it holds an exclusive ``flock``
for as long as it has the store open. The kernel drops the
lock when the process dies, however it dies (SIGKILL included), so an owner
file that can be locked is a dead process's: `dead_owners` finds them, and the
tier reclaims what they held (`HostTier.reclaim_dead`). A pid reused by another
process changes nothing (the random part differs; the lock decides).

An owner file is created under a temporary name, locked, then renamed into
place, so no other process ever sees it unlocked while its owner lives. Names
starting with the marker's name plus a dot belong to the store (`fs`), so the
folder never looks like a tenant's. (Stores made before the arena also had a
``.kvpack-store.tmp`` folder of per-owner temporary files; nothing reads it now.)
"""

from __future__ import annotations

import fcntl
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

OWNERS = ".kvpack-store.owners"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def _subdir(root_fd: int, name: str) -> int:
    try:
        os.mkdir(name, 0o700, dir_fd=root_fd)
    except FileExistsError:
        pass
    return os.open(name, _DIR, dir_fd=root_fd)


class Owner:
    """This process's registration in a host store (see the module docstring). Close it once."""

    def __init__(self, root_fd: int) -> None:
        self.token = f"{os.getpid()}-{secrets.token_hex(6)}"
        self._owners_fd = _subdir(root_fd, OWNERS)
        tmp = f".{self.token}.new"
        self._fd = os.open(tmp, _FILE | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=self._owners_fd)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.rename(tmp, self.token, src_dir_fd=self._owners_fd, dst_dir_fd=self._owners_fd)

    def close(self) -> None:
        """Leave the store: this owner's file goes (nothing of it is pending then)."""
        try:
            os.unlink(self.token, dir_fd=self._owners_fd)
        except OSError:
            pass
        for fd in (self._fd, self._owners_fd):
            os.close(fd)


def _lock_now(dir_fd: int, name: str, mode: int) -> int | None:
    """An fd of owner file `name` locked (`mode`) by us now, or None when its lock is held
    elsewhere (its owner lives), or it is gone."""
    try:
        fd = os.open(name, _FILE | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None


def live_users(root: str) -> int:
    """How many processes have the store at path `root` open now; 0 when it cannot be opened
    (absent, a link, not a folder)."""
    try:
        fd = os.open(root, _DIR)
    except OSError:
        return 0
    try:
        return live_owners(fd)
    finally:
        os.close(fd)


def live_owners(root_fd: int) -> int:
    """How many processes have the store open now (their owner file is locked)."""
    try:
        dfd = os.open(OWNERS, _DIR, dir_fd=root_fd)
    except OSError:
        return 0
    try:
        live = 0
        for name in os.listdir(dfd):
            if name.startswith("."):
                continue
            try:
                fd = os.open(name, _FILE | os.O_NONBLOCK, dir_fd=dfd)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                live += 1
            finally:
                os.close(fd)
        return live
    finally:
        os.close(dfd)


@contextmanager
def dead_owners(root_fd: int, known: set[str]) -> Iterator[set[str]]:
    """The owners of the store that died, plus those of `known` (owners named by pending writes)
    with no owner file left; their owner files stay locked by us until the block ends, then go."""
    try:
        dfd = os.open(OWNERS, _DIR, dir_fd=root_fd)
    except OSError:
        yield set(known)
        return
    held: dict[str, int] = {}
    try:
        names = set(os.listdir(dfd))
        for name in names:
            if name.startswith("."):
                continue
            fd = _lock_now(dfd, name, fcntl.LOCK_EX)
            if fd is not None:
                held[name] = fd
        orphans = {t for t in known if t not in names}
        yield set(held) | orphans
        for name in held:
            try:
                os.unlink(name, dir_fd=dfd)
            except OSError:
                pass
    finally:
        for fd in held.values():
            os.close(fd)
        os.close(dfd)
