"""File-system primitives of the disk tier: never follow, never open, never
delete anything kvpack did not put in its own store folder.

- The store root is checked once (`open_store_root`): not ``/`` or a top-level
  system folder, nothing under ``/proc``, ``/sys`` or ``/dev``, no NUL byte,
  no overlong name, a directory (not a file, not under one). A new or empty
  folder is marked with `MARKER` (format `STORE_FORMAT`); a non-empty folder
  without the marker, or with another format, is refused. Errors are
  `ConfigError`s naming ``disk.path``. `check_store_root` applies the same
  rules and changes nothing (no folder, no marker): the start-up check.
- A folder in a folder others may write into (``/tmp``; the host store's, right
  in `SHM`) is private (`kvpack.tiers.disk.private`): its own name is never
  resolved (a symlink there is refused), it is created 0700 or must be this
  user's alone (checked on its descriptor), and so must its marker.
- Everything inside is reached from the root's directory fd: `open_beneath`
  uses ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` where the kernel has
  it, else a walk of ``openat(O_NOFOLLOW)`` one component at a time, so a
  folder or file replaced by a symlink is refused (`UnsafeEntry`), never
  followed. `open_regular` adds ``O_NONBLOCK`` and an ``fstat``: a FIFO or a
  device at an object path is refused without blocking.
- Folders that hold folders (a tenant's, a fingerprint's) get ext4's
  ``FS_TOPDIR_FL`` when kvpack creates them (`spread_subfolders`, best effort):
  the inode allocator then places their subfolders in distinct, emptier block
  groups instead of next to the parent's. Without it every object file lands
  in the store root's group; on a file system without a journal each file
  creation there scans past that group's recently deleted inodes (kernel CPU
  per ``open(O_CREAT)`` that grows with the group's churn; spread, each new
  folder starts in an emptier group). Layout and crash safety do not change.
- Temporary files have a random name (`temp_name`) and are created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW``; `is_temp_name` matches only that pattern,
  so a sweep can never take another program's ``*.tmp.*`` file.
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import os
import re
import secrets
import stat
import struct
from collections.abc import Sequence
from typing import Any

from ...config.store_path import check_store_path_text
from ...errors import ConfigError
from . import private as private_mod

MARKER = ".kvpack-store"
STORE_FORMAT = 1
"""Version of the folder layout (``tenant/fingerprint/cc/chunk.member.kvp``)."""
MARKER_TEXT = f"kvpack store\nformat {STORE_FORMAT}\n"
FORBIDDEN_UNDER = ("/proc", "/sys", "/dev")
"""Pseudo file systems: nothing there is a store folder (but a folder right in `SHM` when asked)."""
SHM = "/dev/shm"
"""The host's shared memory (tmpfs): the host memory tier's stores are folders right in it."""
_TEMP_RE = re.compile(r"\.[A-Za-z0-9_-]{1,128}\.[a-z0-9_@]{1,48}\.kvp\.[0-9a-f]{16}\.tmp")

_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every Linux architecture (unified syscall table)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_TOPDIR_FL = 0x00020000


class UnsafeEntry(OSError):
    """A symlink, or something that is not a regular file/folder, where kvpack expects its own entry."""


# -- the root ------------------------------------------------------------------


def _check_resolved(real: str, shm: bool = False) -> None:
    if real == "/" or real.count("/") == 1:
        raise ValueError(f"resolves to {real!r}: a top-level system folder is never a store folder")
    if shm and real.startswith(SHM + "/") and real.count("/") == SHM.count("/") + 1:
        return  # a folder right in the host's shared memory (the host memory tier's root)
    for top in FORBIDDEN_UNDER:
        if real == top or real.startswith(top + "/"):
            raise ValueError(f"resolves to {real!r}, under {top}")


def _resolve_root(path: str, field: str, shm: bool = False) -> tuple[str, bool]:
    """The store folder `path` resolves to, if it is one kvpack may use as a folder (ConfigError naming
    `field`), and whether it must be private (`private`: in a folder others may write into, or `shm`).

    A private folder's own name is never resolved: a symlink there is refused, not followed."""
    try:
        check_store_path_text(path)
        expanded = os.path.abspath(os.path.expanduser(path))
        parent = os.path.realpath(os.path.dirname(expanded))
        try:
            private = shm or private_mod.shared_parent(os.stat(parent))
        except OSError:
            private = False
        real = os.path.join(parent, os.path.basename(expanded)) if private else os.path.realpath(expanded)
        check_store_path_text(real)
        _check_resolved(real, shm)
    except ValueError as exc:
        raise ConfigError(field, f"{path[:200]!r} {exc}") from None
    if private:
        problem = private_mod.path_problem(real)
        if problem is not None:
            raise ConfigError(field, f"{problem}; {private_mod.REFUSED}")
    elif os.path.lexists(real) and not os.path.isdir(real):
        raise ConfigError(field, f"{real!r} exists and is not a folder")
    return real, private


def check_store_root(path: str, field: str = "disk.path", shm: bool = False) -> str:
    """Every rule `open_store_root` applies to a store folder, changing nothing; returns the resolved path.

    Reads only: resolves the path; for an existing folder, lists it and reads its
    marker (`_marker_state`); for a missing one, finds the nearest existing folder
    above it, which `open_store_root` would create it in (it must be a folder
    this process may write into). Raises ConfigError naming `field`. `shm`: a folder
    directly in `SHM` is allowed (the host memory tier's)."""
    real, private = _resolve_root(path, field, shm)
    try:
        if not os.path.isdir(real):
            parent = os.path.dirname(real)
            while not os.path.lexists(parent):
                parent = os.path.dirname(parent)
            if not os.path.isdir(parent):
                raise ConfigError(field, f"cannot create {real!r}: {parent!r} is not a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(field, f"cannot create {real!r}: {parent!r} is not writable by this process")
            return real
        fd = os.open(real, _DIR_FLAGS)
        try:
            _marker_state(fd, real, field, private)
        finally:
            os.close(fd)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        raise ConfigError(field, f"cannot use {path[:200]!r} as the store folder: {exc}") from None
    return real


def open_store_root(path: str, field: str = "disk.path", shm: bool = False) -> tuple[str, int]:
    """Check, create or adopt the store folder; returns (resolved path, directory fd).

    Raises ConfigError naming `field` for any folder kvpack must not use (the rules
    `check_store_root` checks without creating anything). A private folder (`_resolve_root`)
    is created 0700 and checked through its descriptor (`private.open_folder`)."""
    real, private = _resolve_root(path, field, shm)
    try:
        if private:
            parent_fd = os.open(os.path.dirname(real), _DIR_FLAGS)
            try:
                fd = private_mod.open_folder(parent_fd, os.path.basename(real), real)
            finally:
                os.close(parent_fd)
        else:
            os.makedirs(real, mode=0o700, exist_ok=True)
            fd = os.open(real, _DIR_FLAGS)
    except private_mod.NotPrivate as exc:
        raise ConfigError(field, f"{exc.problem}; {private_mod.REFUSED}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(field, f"cannot use {path[:200]!r} as the store folder: {exc}") from None
    try:
        if not _marker_state(fd, real, field, private):
            _write_marker(fd, private)
    except BaseException:
        os.close(fd)
        raise
    return real, fd


def _marker_state(fd: int, real: str, field: str, private: bool = False) -> bool:
    """Whether the folder `fd` holds this format's marker (True) or is empty (False: kvpack
    may mark it); ConfigError naming `field` for anything else (in a `private` folder, a marker
    that is not this user's alone too). Reads only.

    A marker another process is writing (its temporary, or the marker appearing
    meanwhile) is not "other content"."""
    for _attempt in range(3):
        try:
            mfd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            break
        except FileNotFoundError:
            entries = [e for e in os.listdir(fd) if not e.startswith(MARKER + ".")]
            if MARKER in entries:
                continue  # written by another process meanwhile: read it
            if entries:
                shown = ", ".join(sorted(entries)[:3])
                raise ConfigError(
                    field,
                    f"{real!r} is not empty ({len(entries)} entries: {shown}...) and has no {MARKER} marker: "
                    "kvpack only uses a new or empty folder, or one it marked itself (a kvpack store written "
                    "before store markers is a cache: delete it, or point disk.path at a new folder)",
                ) from None
            return False
        except OSError as exc:
            raise ConfigError(field, f"{real}/{MARKER} is not a kvpack marker file: {exc}") from None
    else:  # pragma: no cover - the marker came and went three times
        raise ConfigError(field, f"{real}/{MARKER} keeps changing")
    try:
        st = os.fstat(mfd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(field, f"{real}/{MARKER} is not a regular file")
        problem = private_mod.fd_problem(st, f"{real}/{MARKER}", folder=False) if private else None
        if problem is not None:
            raise ConfigError(field, f"{problem}; {private_mod.REFUSED}")
        text = os.read(mfd, 4096).decode(errors="replace")
    finally:
        os.close(mfd)
    if text != MARKER_TEXT:
        raise ConfigError(
            field,
            f"{real} holds a kvpack store of another format ({text.strip()!r}; this kvpack writes format "
            f"{STORE_FORMAT})",
        )
    return True


def _write_marker(fd: int, private: bool = False) -> None:
    tmp = f"{MARKER}.{secrets.token_hex(8)}.tmp"
    mode = private_mod.FILE_MODE if private else 0o644
    mfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    try:
        os.write(mfd, MARKER_TEXT.encode())
    finally:
        os.close(mfd)
    os.rename(tmp, MARKER, src_dir_fd=fd, dst_dir_fd=fd)


def is_private(real: str) -> bool:
    """Does the store folder `real` (resolved) lie in a folder other users may write into
    (`private.shared_parent`: its files are then checked as this user's alone)?"""
    try:
        return private_mod.shared_parent(os.stat(os.path.dirname(real)))
    except OSError:
        return False


def root_removed(fd: int) -> bool:
    """True when the folder `fd` refers to was deleted (its link count is 0)."""
    try:
        return os.fstat(fd).st_nlink == 0
    except OSError:
        return True


# -- opening beneath the root ----------------------------------------------------


def _load_openat2() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
    except (OSError, AttributeError):  # pragma: no cover - not glibc/musl
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_openat2()
_use_openat2 = _syscall is not None
OPENAT2_MISSING = frozenset({errno.ENOSYS, errno.EPERM})
"""openat2's errnos for "not here" (an old kernel) or "not allowed" (seccomp): walk instead."""


def openat2_in_use() -> bool:
    """Does `open_beneath` use openat2 (False: the kernel lacked or refused it, or no libc syscall)?"""
    return _use_openat2


def _openat2(dir_fd: int, rel: str, flags: int, mode: int) -> int:
    mode = mode if flags & os.O_CREAT else 0  # openat2 refuses a mode without O_CREAT (EINVAL)
    how = struct.pack("QQQ", flags, mode, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    fd = _syscall(_SYS_OPENAT2, ctypes.c_int(dir_fd), os.fsencode(rel), how, ctypes.c_size_t(len(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), rel)
    return int(fd)


def open_beneath(root_fd: int, rel: str, flags: int, mode: int = 0o600) -> int:
    """``openat(root_fd, rel)`` without following any symlink on the way (UnsafeEntry) and
    without leaving the root; `rel` is a relative path of validated names."""
    global _use_openat2
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    if _use_openat2:
        try:
            return _openat2(root_fd, rel, flags, mode)
        except OSError as exc:
            if exc.errno in OPENAT2_MISSING:  # an old kernel, or seccomp: walk instead
                _use_openat2 = False
            elif exc.errno in (errno.ELOOP, errno.EXDEV):
                raise UnsafeEntry(errno.ELOOP, "symlink refused", rel) from None
            else:
                raise
    return _open_walk(root_fd, rel, flags, mode)


def _open_walk(root_fd: int, rel: str, flags: int, mode: int) -> int:
    """The portable `open_beneath`: one ``O_NOFOLLOW`` openat per component."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafeEntry(errno.EINVAL, "not a plain relative path", rel)
    dfd = root_fd
    try:
        for part in parts[:-1]:
            nfd = _open_subdir(dfd, part, rel)
            if dfd != root_fd:
                os.close(dfd)
            dfd = nfd
        try:
            return os.open(parts[-1], flags, mode, dir_fd=dfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeEntry(errno.ELOOP, "symlink refused", rel) from None
            raise
    finally:
        if dfd != root_fd:
            os.close(dfd)


def open_dir(root_fd: int, rel: str) -> int:
    """A directory fd of `rel` beneath the root (UnsafeEntry for a symlink, the last component's too:
    ``O_DIRECTORY | O_NOFOLLOW`` on a symlink is ENOTDIR, told apart from a file by `is_link_beneath`)."""
    try:
        return open_beneath(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
    except NotADirectoryError:
        if is_link_beneath(root_fd, rel):
            raise UnsafeEntry(errno.ELOOP, "symlink refused", rel) from None
        raise


def is_link_beneath(root_fd: int, rel: str) -> bool:
    """Is `rel` beneath the root a symlink itself (an ``O_PATH | O_NOFOLLOW`` open, nothing followed)?"""
    try:
        fd = open_beneath(root_fd, rel, os.O_PATH)
    except OSError:
        return False
    try:
        return stat.S_ISLNK(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def open_regular(root_fd: int, rel: str) -> int:
    """A read-only fd of the regular file `rel`; UnsafeEntry for anything else.

    ``O_NONBLOCK`` makes opening a FIFO return at once; the ``fstat`` then refuses it."""
    fd = open_beneath(root_fd, rel, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeEntry(errno.EINVAL, "not a regular file", rel)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dirs(root_fd: int, rel: str) -> None:
    """Create the folders of `rel` beneath the root (0o700), refusing symlinks on the way.

    Every folder created here but the last gets `spread_subfolders` before anything is made in it."""
    dfd = root_fd
    parts = rel.split("/")
    try:
        for depth, part in enumerate(parts):
            try:
                os.mkdir(part, 0o700, dir_fd=dfd)
                created = True
            except FileExistsError:
                created = False
            nfd = _open_subdir(dfd, part, rel)
            if created and depth < len(parts) - 1:
                spread_subfolders(nfd)
            if dfd != root_fd:
                os.close(dfd)
            dfd = nfd
    finally:
        if dfd != root_fd:
            os.close(dfd)


def spread_subfolders(dir_fd: int) -> bool:
    """Set ``FS_TOPDIR_FL`` on the folder `dir_fd` (ext4: place its subfolders in spread-out block groups).

    Best effort: False where the file system has no such flag (xfs, tmpfs...) or refuses it."""
    flags = array.array("i", [0])
    try:
        fcntl.ioctl(dir_fd, _FS_IOC_GETFLAGS, flags, True)
        if flags[0] & _FS_TOPDIR_FL:
            return True
        flags[0] |= _FS_TOPDIR_FL
        fcntl.ioctl(dir_fd, _FS_IOC_SETFLAGS, flags, True)
    except OSError:
        return False
    return True


def _open_subdir(dfd: int, part: str, rel: str) -> int:
    """``openat(dfd, part, O_DIRECTORY | O_NOFOLLOW)``; a symlink (ELOOP, or ENOTDIR on
    Linux, which checks O_DIRECTORY first) raises UnsafeEntry."""
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _is_link(dfd, part)):
            raise UnsafeEntry(errno.ELOOP, "symlink refused", rel) from None
        raise


def _is_link(dfd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def temp_names(finals: Sequence[str]) -> list[str]:
    """A fresh, unguessable temporary name for each file of `finals` (same folder), from one read of
    the system's randomness: each read gives the GIL up (in a busy engine process a re-take can wait
    5 ms), so a batch reads once."""
    noise = os.urandom(8 * len(finals)).hex()
    return [f".{final}.{noise[16 * i : 16 * i + 16]}.tmp" for i, final in enumerate(finals)]


def temp_name(final: str) -> str:
    """`temp_names` of one file."""
    return temp_names([final])[0]


def is_temp_name(name: str) -> bool:
    """Does `name` have exactly kvpack's temporary-file pattern (`temp_name`)?"""
    return _TEMP_RE.fullmatch(name) is not None


def lstat_regular(dir_fd: int, name: str) -> os.stat_result | None:
    """The stat of `name` in `dir_fd` when it is a regular file (never following a link), else None."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None
