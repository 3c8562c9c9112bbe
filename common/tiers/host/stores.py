"""The host stores of this user, and dropping one that no process uses (``kvpack host``).

A host store outlives its processes (`place`: a tmpfs folder, until reboot), as the
disk tier's folder does: a server restarted, or a second one started later, finds
the prefixes the first computed. Its memory comes back when an operator drops it
(`drop`), or at reboot. The last process's exit leaves it in place on purpose: it
cannot know whether another server starts a second later. A store holds its whole
arena (the `memory.capacity` it was made with, `pages`) plus its index from the
moment it is made until it is dropped.

Only folders of this user's alone are stores (`kvpack.tiers.disk.private`): another user's
folder, or a symlink, at a store's name is neither listed, counted nor dropped (`not_stores`
says so in one line each). `drop` refuses a store with a live user (an owner file locked,
`owners.live_owners`).
It renames the folder aside before deleting it, so a process that starts meanwhile
creates a new, empty store at the name; one that opened the old folder in the same
instant keeps using the old, unlinked one (its mapping and index stay valid) until it
exits, unseen by the others.
"""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import dataclass

from ..disk.fs import SHM
from ..disk.private import NotPrivate, open_folder, path_problem
from .owners import live_owners, live_users
from .place import host_root


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
