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

Only this user's own owner files count (`kvpack.tiers.private`: a file or folder not
this user's alone, or a symlink, is neither a live nor a dead owner), and only in a store
folder of this user's (`live_users`), so a lock another user holds never makes a store look used.

A registration is not inherited: a ``flock`` belongs to an open file description, which a
child forked without exec shares, so the child would keep a dead parent counted live.
In a forked child every inherited registration is dropped (its fd closed; the file stays
the parent's) and the tier registers the child anew (`Owner.in_child`).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..private import open_file, open_folder

OWNERS = ".kvpack-store.owners"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def _subdir(root_fd: int, name: str) -> int:
    return open_folder(root_fd, name, name)


class Owner:
    """This process's registration in a host store (see the module docstring). Close it once."""

    def __init__(self, root_fd: int, on_fork: Callable[[], None] | None = None) -> None:
        """Register in the store folder `root_fd`; `on_fork` is called in a forked child after the
        inherited registration was dropped (the tier registers the child there)."""
        self.token = f"{os.getpid()}-{secrets.token_hex(6)}"
        self._owners_fd = _subdir(root_fd, OWNERS)
        tmp = f".{self.token}.new"
        self._fd = os.open(tmp, _FILE | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=self._owners_fd)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.rename(tmp, self.token, src_dir_fd=self._owners_fd, dst_dir_fd=self._owners_fd)
        self._on_fork = on_fork
        _LIVE.add(self)

    def in_child(self) -> None:
        """In a forked child: drop the inherited registration (close its fds, never unlock or
        unlink: the lock and the file are the parent's), then `on_fork`."""
        fds, self._fd, self._owners_fd = (self._fd, self._owners_fd), -1, -1
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if self._on_fork is not None:
            self._on_fork()

    def close(self) -> None:
        """Leave the store: this owner's file goes (nothing of it is pending then)."""
        _LIVE.discard(self)
        if self._fd < 0:
            return  # inherited by a fork: the parent's
        try:
            os.unlink(self.token, dir_fd=self._owners_fd)
        except OSError:
            pass
        for fd in (self._fd, self._owners_fd):
            os.close(fd)
        self._fd = self._owners_fd = -1


_LIVE: weakref.WeakSet[Owner] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for owner in list(_LIVE):
        _LIVE.discard(owner)
        try:
            owner.in_child()
        except Exception:  # noqa: BLE001 - a child that cannot register again uses no store
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)


def _own_file(dir_fd: int, name: str) -> int | None:
    """An fd of this user's owner file `name` (non-blocking), None when absent or not this user's alone."""
    try:
        return open_file(dir_fd, name, os.O_RDWR | os.O_NONBLOCK, name, create=False)
    except OSError:
        return None


def _lock_now(dir_fd: int, name: str, mode: int) -> int | None:
    """An fd of owner file `name` locked (`mode`) by us now, or None when its lock is held
    elsewhere (its owner lives), or it is gone."""
    fd = _own_file(dir_fd, name)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None


def live_users(root: str) -> int:
    """How many processes have the store at path `root` open now; 0 when it cannot be opened
    (absent, a link, not a folder) or is not this user's alone (`private.open_folder`)."""
    try:
        parent = os.open(os.path.dirname(root) or ".", _DIR)
    except OSError:
        return 0
    try:
        fd = open_folder(parent, os.path.basename(root), root, create=False)
    except OSError:
        return 0
    finally:
        os.close(parent)
    try:
        return live_owners(fd)
    finally:
        os.close(fd)


def live_owners(root_fd: int) -> int:
    """How many processes have the store open now (this user's owner files, locked)."""
    try:
        dfd = open_folder(root_fd, OWNERS, OWNERS, create=False)
    except OSError:
        return 0
    try:
        live = 0
        for name in os.listdir(dfd):
            if name.startswith("."):
                continue
            fd = _own_file(dfd, name)
            if fd is None:
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
        dfd = open_folder(root_fd, OWNERS, OWNERS, create=False)
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
