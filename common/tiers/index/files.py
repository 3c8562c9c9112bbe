"""The disk index's files where others may write, and across a fork (`kvpack.tiers.index.catalog`).

- In a private store folder (`kvpack.tiers.private`) the index's files are opened (created
  0600 where new) and checked through their descriptors before SQLite opens them by path
  (`hold_private`), and the index file is checked to be the same inode after (`same_inode`).
  SQLite offers no way to hand it a descriptor; the path is sound because the folder is this
  user's alone (0700, checked on its descriptor): nobody else can create, rename or replace an
  entry in it, and in a sticky parent nobody else can rename or remove the folder itself.
- A forked child gets an index lock of its own (`FORKED`): see `_Forked`.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Protocol

from .. import private


def hold_private(path: str, dir_fd: int, names: Sequence[str]) -> dict[str, int]:
    """An fd of each of the index's files `names` (`catalog.INDEX_FILES`) in the private folder
    `dir_fd`, created 0600 where absent, each checked through its descriptor (`private.open_file`;
    NotPrivate). SQLite then opens them by the path `path` names them by."""
    held: dict[str, int] = {}
    try:
        for name in names:
            held[name] = private.open_file(dir_fd, name, os.O_RDWR, f"{os.path.dirname(path)}/{name}")
    except BaseException:
        for fd in held.values():
            os.close(fd)
        raise
    return held


def same_inode(dir_fd: int, name: str, fd: int) -> None:
    """NotPrivate unless `name` in `dir_fd` is still the file `fd` holds (what SQLite opened by path)."""
    mine = os.fstat(fd)
    try:
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        raise private.NotPrivate(f"{name}: {exc.strerror}") from None
    if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
        raise private.NotPrivate(f"{name} was replaced while it was opened")


class LockHolder(Protocol):
    """What holds an index lock fd a forked child must not share (`Catalog`)."""

    def reopen_lock(self) -> None: ...


class _Forked:
    """The catalogs of this process, so a forked child drops the index lock it inherited.

    A ``flock`` belongs to an open file description: a child forked without exec shares its
    parent's, so a parent stopped inside a write would keep it held through the child, and the
    child unlocking it would end the parent's transaction's exclusion. In the child each
    catalog's lock fd is replaced (same number) by a fresh open of the lock file of its own."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[LockHolder] = weakref.WeakSet()
        os.register_at_fork(after_in_child=self._in_child)

    def add(self, catalog: LockHolder) -> None:
        self._live.add(catalog)

    def discard(self, catalog: LockHolder) -> None:
        """Forget a closed catalog (its fd number may be reused: never touched in a child)."""
        self._live.discard(catalog)

    def _in_child(self) -> None:
        for catalog in list(self._live):
            catalog.reopen_lock()


FORKED = _Forked()
