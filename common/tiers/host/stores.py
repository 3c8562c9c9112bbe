"""The host stores of this user, and dropping one that no process uses (``kvpack host``).

A host store outlives its processes (`place`: a tmpfs folder, until reboot), as the
disk tier's folder does: a server restarted, or a second one started later, finds
the prefixes the first computed. Its memory comes back when an operator drops it
(`drop`), or at reboot. The last process's exit leaves it in place on purpose: it
cannot know whether another server starts a second later. A store holds its whole
arena (the `memory.capacity` it was made with, `pages`) plus its index from the
moment it is made until it is dropped.

`drop` refuses a store with a live user (an owner file locked, `owners.live_owners`).
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
from .owners import live_users
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


def host_stores(shm: str = SHM, uid: int | None = None) -> list[HostStore]:
    """This user's host stores in `shm` (folders ``kvpack-<uid>-<name>``), by name."""
    prefix = os.path.basename(host_root("", shm, uid))
    try:
        names = sorted(os.listdir(shm))
    except OSError:
        return []
    out = []
    for entry in names:
        path = os.path.join(shm, entry)
        if not entry.startswith(prefix) or ".dropped-" in entry or not os.path.isdir(path) or os.path.islink(path):
            continue
        out.append(HostStore(entry[len(prefix) :], path, live_users(path), _held(path)))
    return out


def drop(name: str, shm: str = SHM) -> str | None:
    """Remove host store `name` of this user; None when done (or it did not exist), else
    why not (one line: a process still uses it)."""
    path = host_root(name, shm)
    if not os.path.isdir(path) or os.path.islink(path):
        return None
    users = live_users(path)
    if users:
        return f"host store {name!r} has {users} live user(s); stop them first"
    aside = f"{path}.dropped-{secrets.token_hex(4)}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    shutil.rmtree(aside, ignore_errors=True)
    return None
