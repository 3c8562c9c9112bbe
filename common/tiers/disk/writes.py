"""Object-file writes of the disk tier, a batch at a time: native when the extension is loaded, else Python.

A `WriteJob` is one object file: its leaf folder (relative to the store root),
its final name, a fresh temporary name (`fs.temp_names`) and its bytes (header,
zero padding to `files.PAGE`, payload: `object_buffers`). `write_batch` writes
a batch's jobs and returns one `WriteResult` per job; the caller (the tier)
turns each errno into what to do with `outcome_of`, the one errno mapping.

Both writers follow `kvpack.tiers.disk.fs`'s rules: the leaf is opened beneath
the root without following any symlink (``openat2`` RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS, or fs's walk where the kernel has no openat2), the
temporary is created ``O_CREAT | O_EXCL | O_NOFOLLOW`` (0600), written whole,
flushed if asked, closed and renamed over the final name; after a failure the
temporary (created by this write: provably ours) is unlinked.

- The native writer (`ObjectWriter`: ``write_objects`` of the extension,
  `kvpack.ops.object_writer`) takes every buffer with the GIL held and then
  writes the whole batch with the GIL released once. In a process whose other
  threads run Python (an engine's scheduler), each GIL re-acquisition waits up
  to the interpreter's switch interval (5 ms): the Python writer gives it up
  about six times per file, the native one once per batch.
- An object whose openat2 the kernel lacks or refuses (ENOSYS, EPERM: seccomp)
  is written again by the Python writer (fs's walk), as are the rest of its batch.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from ...identity.objects import Payload, payload_parts
from ...ops.natives import Buffer, NativeJob, ObjectWriter, WriteResult
from ..base import TierStatus
from . import fs
from .files import data_offset, write_all

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class WriteJob:
    """One object file to write: `leaf` (relative folder), `final` and `temp` names, its `buffers`."""

    leaf: str
    final: str
    temp: str
    buffers: list[Buffer]

    def native(self) -> NativeJob:
        return (os.fsencode(self.leaf), os.fsencode(self.temp), os.fsencode(self.final), self.buffers)


def object_buffers(header: bytes, payload: Payload) -> list[Buffer]:
    """An object file's bytes: the encoded `header`, zeros up to the next `files.PAGE`, the payload."""
    return [header + bytes(data_offset(len(header)) - len(header)), *payload_parts(payload)]


def write_job(leaf: str, final: str, temp: str, header: bytes, payload: Payload) -> WriteJob:
    """The job of writing `payload` under `header` as `leaf`/`final` through the fresh temporary
    name `temp` (a batch takes its names from one `fs.temp_names`)."""
    return WriteJob(leaf, final, temp, object_buffers(header, payload))


class WriteOutcome(Enum):
    """What an object write's errno means for the tier (`outcome_of`)."""

    OK = "ok"
    MISSING_FOLDER = "missing_folder"
    """ENOENT: the leaf (or a folder above it) is not there, or went meanwhile: make it and try again."""
    UNSAFE = "unsafe"
    """A symlink (or an escape from the root) on the way: refused, counted, ERROR."""
    NO_SPACE = "no_space"
    ERROR = "error"

    @property
    def status(self) -> TierStatus:
        return _STATUS[self]


_STATUS = {
    WriteOutcome.OK: TierStatus.OK,
    WriteOutcome.MISSING_FOLDER: TierStatus.ERROR,
    WriteOutcome.UNSAFE: TierStatus.ERROR,
    WriteOutcome.NO_SPACE: TierStatus.NO_SPACE,
    WriteOutcome.ERROR: TierStatus.ERROR,
}


def outcome_of(err: int) -> WriteOutcome:
    """The one mapping of an object write's errno (0: written) to its outcome."""
    if err == 0:
        return WriteOutcome.OK
    if err == errno.ENOENT:
        return WriteOutcome.MISSING_FOLDER
    if err in (errno.ELOOP, errno.EXDEV):
        return WriteOutcome.UNSAFE
    if err in (errno.ENOSPC, errno.EDQUOT):
        return WriteOutcome.NO_SPACE
    return WriteOutcome.ERROR


def write_batch(
    root_fd: int, temp_dir_fd: int, jobs: Sequence[WriteJob], fsync: bool, native: ObjectWriter | None
) -> list[WriteResult]:
    """Write every job (see the module docstring); `temp_dir_fd` < 0: each temporary in its leaf.

    Never raises for a file-system failure: that object's errno is its result."""
    if native is None or not fs.openat2_in_use() or not jobs:
        return [_write_python(root_fd, temp_dir_fd, job, fsync) for job in jobs]
    # leaves made natively: from Python each new folder is three system calls, each a GIL hand-off
    results = list(native(root_fd, temp_dir_fd, [job.native() for job in jobs], fsync, True))
    for i, (err, removed) in enumerate(results):
        if err in fs.OPENAT2_MISSING:  # openat2 not tried: fs's walk instead
            again, removed_again = _write_python(root_fd, temp_dir_fd, jobs[i], fsync)
            results[i] = (again, removed + removed_again)
    return results


def _write_python(root_fd: int, temp_dir_fd: int, job: WriteJob, fsync: bool) -> WriteResult:
    """One job written from Python (each system call gives the GIL up and takes it back)."""
    try:
        dfd = fs.open_dir(root_fd, job.leaf)
    except fs.UnsafeEntry:
        return errno.ELOOP, 0
    except OSError as exc:
        return exc.errno or errno.EIO, 0
    tdir = dfd if temp_dir_fd < 0 else temp_dir_fd
    try:
        fd = os.open(job.temp, _CREATE, 0o600, dir_fd=tdir)
    except OSError as exc:
        os.close(dfd)
        return exc.errno or errno.EIO, 0
    try:
        try:
            write_all(fd, job.buffers)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(job.temp, job.final, src_dir_fd=tdir, dst_dir_fd=dfd)
        return 0, 0
    except OSError as exc:
        return exc.errno or errno.EIO, _unlink_own(tdir, job.temp)
    except BaseException:
        _unlink_own(tdir, job.temp)
        raise
    finally:
        os.close(dfd)


def _unlink_own(dir_fd: int, temp: str) -> int:
    """Remove this write's temporary (created O_EXCL by it); 1 when removed."""
    try:
        os.unlink(temp, dir_fd=dir_fd)
        return 1
    except OSError:
        return 0
