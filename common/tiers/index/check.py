"""The disk index's start-up rules, checked without touching the store (``kvpack config``).

`catalog.open_catalog` refuses a store folder whose index files kvpack must not
use; `check_index_files` applies the same rules to an existing folder and says
the same one line (a `ConfigError` naming ``disk.path``), reading only:

- each index file (``.kvpack-store.index`` and its ``-wal``, ``-shm``, ``.lock``)
  that exists must be a regular file (a planted link, folder or FIFO is refused),
  readable and writable by this process; a missing one must be creatable (the
  folder writable);
- the index must be SQLite whose schema start-up can adopt: it is read with
  SQLite's ``immutable`` read-only mode (no lock, no journal, nothing created),
  its schema and ``meta`` rows (no data) are copied into a scratch folder outside
  the store and start-up's own `Catalog` opens that copy;
- the writer lock (``.lock``) must not stay held by another process longer than
  start-up waits for it (`busy_timeout_s`): a shared ``flock`` on a read-only
  descriptor, held while the index is read (so no writer is half way through)
  and released at once, changes nothing on disk.

Invariant: nothing under the folder is created, written, renamed or removed.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from ...errors import ConfigError
from .catalog import INDEX_BUSY_TIMEOUT_S, INDEX_FILES, INDEX_NAME, Catalog, present_index_files

SQLITE_MAGIC = b"SQLite format 3\x00"
"""The first bytes of every SQLite database file (an empty file is a new database)."""


def check_index_files(root: str, busy_timeout_s: float = INDEX_BUSY_TIMEOUT_S, field: str = "disk.path") -> None:
    """Raise the ConfigError start-up (`catalog.open_catalog`) would raise for the index files
    of the existing store folder `root`, changing nothing. `busy_timeout_s` (seconds) is how
    long start-up waits for the writer lock (`DiskTier`'s default)."""
    present = present_index_files(root, lambda name: os.lstat(os.path.join(root, name)), field)
    for name in present:
        if not os.access(os.path.join(root, name), os.R_OK | os.W_OK):
            _refuse(root, f"{root}/{name} is not readable and writable by this process", field)
    if len(present) < len(INDEX_FILES) and not os.access(root, os.W_OK | os.X_OK):
        _refuse(root, f"cannot create the index's files: {root} is not writable by this process", field)
    if INDEX_NAME + ".lock" not in present:
        if INDEX_NAME in present:
            _check_database(root, field)
        return
    fd = _shared_lock(root, busy_timeout_s, field)
    try:  # read under the lock every writer takes, so no write is half done while it is read
        if INDEX_NAME in present:
            _check_database(root, field)
    finally:
        os.close(fd)  # releases the lock


def _refuse(root: str, why: str, field: str) -> NoReturn:
    """The one line `catalog.open_catalog` says for an index it cannot open."""
    raise ConfigError(
        field,
        f"{root}/{INDEX_NAME} is not a readable kvpack index ({why}); delete it (and its -wal, -shm) "
        "to have it rebuilt from the object files",
    )


def _check_database(root: str, field: str) -> None:
    """The index is SQLite and start-up's `Catalog` adopts its schema (opened on a scratch copy)."""
    path = os.path.join(root, INDEX_NAME)
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as exc:
        _refuse(root, str(exc), field)
    if not head:
        return  # an empty file: SQLite makes it a new database
    if head != SQLITE_MAGIC:
        _refuse(root, "file is not a database", field)
    uri = Path(path).as_uri() + "?mode=ro&immutable=1"
    try:
        src = sqlite3.connect(uri, uri=True)
        try:
            schema = src.execute("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL").fetchall()
            tables = {name for kind, name, _ in schema if kind == "table"}
            meta = src.execute("SELECT * FROM meta").fetchall() if "meta" in tables else []
        finally:
            src.close()
        with tempfile.TemporaryDirectory(prefix="kvpack-check-") as scratch:
            copy_path = os.path.join(scratch, INDEX_NAME)
            copy = sqlite3.connect(copy_path, isolation_level=None)
            try:
                for _, name, sql in schema:
                    if not name.startswith("sqlite_"):
                        copy.execute(sql)
                if meta:
                    marks = ", ".join("?" * len(meta[0]))
                    copy.executemany(f"INSERT INTO meta VALUES({marks})", meta)  # noqa: S608 - no client text
            finally:
                copy.close()
            Catalog(copy_path, 1.0).close()  # start-up's own set-up, on the copy
    except (OSError, sqlite3.Error) as exc:
        _refuse(root, str(exc), field)


def _shared_lock(root: str, busy_timeout_s: float, field: str) -> int:
    """A read-only descriptor of the writer lock file holding a shared flock, taken within
    `busy_timeout_s` as start-up takes its exclusive one (refused after that, as start-up is)."""
    try:
        fd = os.open(os.path.join(root, INDEX_NAME + ".lock"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        _refuse(root, str(exc), field)
    deadline = time.monotonic() + busy_timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                _refuse(root, "the disk index is held by another process", field)
            time.sleep(0.01)
