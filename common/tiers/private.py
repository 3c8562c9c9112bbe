"""Folders and files that only this user may reach: a store kvpack keeps where others can write.

A host store (``/dev/shm/kvpack-<uid>-<name>``, `kvpack.tiers.host.place`) always lies in a
folder every local user may write into, and so does a disk store whose parent folder is
world-writable (``/tmp``, `shared_parent`). Another local user could create the store's name
first (a folder of theirs, or a symlink to one), then read and rewrite what kvpack keeps there.
Such a store is therefore private:

- its folder is created 0700 without adopting an existing one blindly: whatever is at the name
  is opened with ``O_DIRECTORY | O_NOFOLLOW`` (a symlink is refused, never followed) and
  checked with ``fstat`` on that descriptor (`fd_problem`): owned by the effective uid, no group
  or other permission bits, a folder;
- every file kvpack opens in it (`open_file`) is created with ``O_CREAT | O_EXCL | O_NOFOLLOW``
  (mode 0600) where it is new, else opened with ``O_NOFOLLOW``, and checked the same way through
  ``fstat`` of the descriptor it opened: what is checked is what is used, never a path checked
  then opened again.

Inside a private folder nobody but this user (and root) can create, rename or remove an entry,
and in a sticky parent (``/tmp``, ``/dev/shm``) nobody else can rename or remove the folder
itself, so a path through it names what was checked (what SQLite relies on: it opens its files
by path, `kvpack.tiers.index.catalog`).
"""

from __future__ import annotations

import errno
import os
import stat

FOLDER_MODE = 0o700
FILE_MODE = 0o600
REFUSED = "refused: where others may write, a store is only a folder (0700) and files (0600) of this user's alone"
"""What every one-line refusal of a private store ends with (the rule it broke is before it)."""
_OTHERS = 0o077
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotPrivate(OSError):
    """An entry of a private store that is not this user's alone (its `problem`: one line)."""

    def __init__(self, problem: str) -> None:
        super().__init__(errno.EPERM, problem)
        self.problem = problem

    def __str__(self) -> str:
        return self.problem


def shared_parent(st: os.stat_result) -> bool:
    """Is a folder with this stat one that other users may write into (world-writable, sticky or not)?"""
    return stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_IWOTH)


def fd_problem(st: os.stat_result, shown: str, folder: bool) -> str | None:
    """Why the entry `shown` with stat `st` (taken from its open descriptor) is not this user's
    alone, in one line; None when it is: a folder (`folder`) or a regular file, owned by the
    effective uid, no group or other bits."""
    kind = "folder" if folder else "regular file"
    if not (stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)):
        return f"{shown} is not a {kind}"
    if st.st_uid != os.geteuid():
        return f"{shown} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & _OTHERS:
        return (
            f"{shown} has mode {stat.S_IMODE(st.st_mode):04o}: other users may enter it "
            f"(kvpack uses only a {kind} of mode {FOLDER_MODE if folder else FILE_MODE:04o})"
        )
    return None


def _checked(fd: int, shown: str, folder: bool) -> int:
    problem = fd_problem(os.fstat(fd), shown, folder)
    if problem is not None:
        os.close(fd)
        raise NotPrivate(problem)
    return fd


def open_folder(parent_fd: int, name: str, shown: str, create: bool = True) -> int:
    """A directory fd of the private folder `name` in `parent_fd`, created 0700 when absent
    (`create`); NotPrivate (`shown` names it) for a symlink, a non-folder, or one that is not this
    user's alone. No folder that is there already is adopted without its ``fstat`` check."""
    if create:
        try:
            os.mkdir(name, FOLDER_MODE, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _DIR, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _is_link(parent_fd, name)):
            raise NotPrivate(f"{shown} is a symlink (never followed)") from None
        if exc.errno == errno.ENOTDIR:
            raise NotPrivate(f"{shown} is not a folder") from None
        raise
    return _checked(fd, shown, folder=True)


def open_file(dir_fd: int, name: str, flags: int, shown: str, create: bool = True) -> int:
    """An fd of the private file `name` in the private folder `dir_fd`, opened with `flags` (plus
    ``O_NOFOLLOW | O_CLOEXEC``): created 0600 with ``O_EXCL`` when absent (`create`), else opened;
    NotPrivate for a symlink or anything not this user's alone (checked on the descriptor)."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    fd = -1
    if create:
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, FILE_MODE, dir_fd=dir_fd)
        except FileExistsError:
            fd = -1
    if fd < 0:
        try:
            fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotPrivate(f"{shown} is a symlink (never followed)") from None
            raise
        if not flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
    return _checked(fd, shown, folder=False)


def path_problem(path: str) -> str | None:
    """`fd_problem` of the folder at `path` read without following or opening anything (a
    start-up check that changes nothing; the store's open checks its descriptor again); None
    when it is absent or this user's alone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink (never followed)"
    return fd_problem(st, path, folder=True)


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
