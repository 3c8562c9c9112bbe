"""The host stores of this user, and dropping one that no process uses (``kvpack host``).

A host store outlives its processes (`place`: a tmpfs folder, until reboot), as the
disk tier's folder does: a server restarted, or a second one started later, finds
the prefixes the first computed. Its memory comes back when an operator drops it
(`drop`), or at reboot. A store the operator asked for (``memory.mode: host``) outlives its
last process on purpose: it cannot know whether another server starts a second later. A
store ``memory.mode: auto`` chose gives its memory back when its last user closes it
(`give_back`, race-free against a process opening it at that moment); a last user killed
before it closed leaves it, until the next user of that name closes or `drop`. A store holds its whole
arena (the `memory.capacity` it was made with, `pages`) plus its index from the
moment it is made until it is dropped.

Only folders of this user's alone are stores (`kvpack.tiers.private`): another user's
folder, or a symlink, at a store's name is neither listed, counted nor dropped (`not_stores`
says so in one line each). `drop` refuses a store with a live user (an owner file locked,
`owners.live_owners`).
It renames the folder aside before deleting it, so a process that starts meanwhile
creates a new, empty store at the name; one that opened the old folder in the same
instant keeps using the old, unlinked one (its mapping and index stay valid) until it
exits, unseen by the others.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import sqlite3
import stat
import time
from dataclasses import dataclass

from ..disk.fs import SHM
from ..index.catalog import INDEX_NAME
from ..private import NotPrivate, open_folder, path_problem
from .owners import live_owners, live_users
from .place import host_root

GIVE_BACK_WAIT_S = 2.0
"""Longest a closing process waits for the store folder's lock to give an auto store back."""


@dataclass(frozen=True)
class HostStore:
    """One host store folder: its `name`, folder `path`, live users now, bytes tmpfs holds for it."""

    name: str
    path: str
    users: int
    held_bytes: int


def _held(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(folder, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _listed(shm: str, uid: int | None) -> list[tuple[str, str]]:
    """(name, path) of each entry ``kvpack-<uid>-<name>`` in `shm` (no dropped ones), by name."""
    prefix = os.path.basename(host_root("", shm, uid))
    try:
        names = sorted(os.listdir(shm))
    except OSError:
        return []
    return [(e[len(prefix) :], os.path.join(shm, e)) for e in names if e.startswith(prefix) and ".dropped-" not in e]


def host_stores(shm: str = SHM, uid: int | None = None) -> list[HostStore]:
    """This user's host stores in `shm` (folders ``kvpack-<uid>-<name>`` of this user's alone), by name."""
    return [
        HostStore(name, path, live_users(path), _held(path))
        for name, path in _listed(shm, uid)
        if path_problem(path) is None and os.path.isdir(path)
    ]


def not_stores(shm: str = SHM, uid: int | None = None) -> list[str]:
    """One line per entry at a store's name in `shm` that is not this user's alone (`private`:
    a symlink, another uid's, open to others): kvpack neither lists, uses nor drops it."""
    out = []
    for _, path in _listed(shm, uid):
        problem = path_problem(path)
        if problem is not None:
            out.append(f"{problem}: not a host store of this user (never used; not listed, not dropped)")
    return out


def drop(name: str, shm: str = SHM) -> str | None:
    """Remove host store `name` of this user; None when done (or it did not exist), else
    why not (one line: a process still uses it, or the folder there is not this user's alone).

    The folder checked (opened once, `private.open_folder`) is the one removed: it is renamed
    aside, and deleted only if what was renamed is the folder whose users were counted."""
    path = host_root(name, shm)
    try:
        parent = os.open(shm, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return f"{shm}: {exc.strerror}"
    try:
        try:
            fd = open_folder(parent, os.path.basename(path), path, create=False)
        except FileNotFoundError:
            return None
        except NotPrivate as exc:
            return f"{exc.problem}: not a host store of this user (not dropped)"
        except OSError as exc:
            return f"{path}: {exc.strerror}"
        try:
            return _drop_checked(parent, fd, path, name)
        finally:
            os.close(fd)
    finally:
        os.close(parent)


def _drop_checked(parent: int, fd: int, path: str, name: str) -> str | None:
    """`drop` of the folder `fd` at `path` (in the folder `parent`), checked as this user's."""
    users = live_owners(fd)
    if users:
        return f"host store {name!r} has {users} live user(s); stop them first"
    here, aside = os.path.basename(path), f"{os.path.basename(path)}.dropped-{secrets.token_hex(4)}"
    try:
        os.rename(here, aside, src_dir_fd=parent, dst_dir_fd=parent)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path}: cannot be renamed aside ({exc.strerror})"
    moved = os.stat(aside, dir_fd=parent, follow_symlinks=False)
    mine = os.fstat(fd)
    if (moved.st_dev, moved.st_ino) != (mine.st_dev, mine.st_ino):  # replaced since it was checked
        try:
            os.rename(aside, here, src_dir_fd=parent, dst_dir_fd=parent)
        except OSError:
            pass
        return f"{path} changed while it was dropped; try again"
    shutil.rmtree(f"{os.path.dirname(path)}/{aside}", ignore_errors=True)
    return None


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def lock_folder(fd: int, mode: int, wait_s: float) -> bool:
    """``flock`` the store folder open at `fd` (`mode`: ``LOCK_SH`` or ``LOCK_EX``) within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)


def is_at(fd: int, path: str) -> bool:
    """Is the folder open at `fd` still the one at `path` (not renamed aside, not replaced)?"""
    try:
        now, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _kept(path: str) -> bool:
    """Did a user of the store at `path` ask for it to outlive its processes (`Catalog.mark_kept`)?
    True when that cannot be read (a store is never dropped on a doubt)."""
    index = os.path.join(path, INDEX_NAME)
    try:
        if not stat.S_ISREG(os.lstat(index).st_mode):
            return True
        db = sqlite3.connect(f"file:{index}?mode=ro", uri=True, timeout=5.0)
        try:
            return db.execute("SELECT 1 FROM meta WHERE k='kept'").fetchone() is not None
        finally:
            db.close()
    except FileNotFoundError:
        return False  # no index yet: nothing was stored, nobody asked
    except (OSError, sqlite3.Error):
        return True


def give_back(name: str, shm: str = SHM, wait_s: float = GIVE_BACK_WAIT_S) -> bool:
    """Drop host store `name` if no process uses it, race-free against one opening it: True when dropped.

    Called by a store's last user as it closes (a store that ``memory.mode: auto`` chose,
    `HostTier`). An opener holds the folder's shared ``flock`` from opening the folder until its
    owner file is in place (`kvpack.tiers.host.tier._open_root`); this takes the exclusive one, so no opener is
    half-way in while it counts the live owners. One that opened the folder before is counted
    (its owner file is locked); one that comes after finds the folder renamed aside when it gets
    its shared lock and opens the path again (a new, empty store). A store any user opened with
    ``memory.mode: host`` is kept (`Catalog.mark_kept`): asked for once, it persists."""
    path = host_root(name, shm)
    try:
        fd = os.open(path, _DIR)
    except OSError:
        return False
    try:
        if not lock_folder(fd, fcntl.LOCK_EX, wait_s) or not is_at(fd, path) or live_owners(fd) or _kept(path):
            return False
        aside = f"{path}.dropped-{secrets.token_hex(4)}"
        try:
            os.rename(path, aside)
        except OSError:
            return False
    finally:
        os.close(fd)  # the lock goes with it
    shutil.rmtree(aside, ignore_errors=True)
    return True
