"""The folder scan's side of the disk index (`kvpack.tiers.disk.scan`): index the files it
finds, record the ones it sees, and unindex the rows whose file it did not see.

A mixin of `kvpack.tiers.disk.catalog.Catalog`: it uses the catalog's connection, its lock
and its write transaction, and keeps every invariant of that module's docstring (a row and
its group's and tenant's bytes change together, in one transaction).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager

from ...identity.keys import StoreKey
from .rows import group_id, pack_name


class ScanReconcile:
    """The scan's calls on a `Catalog` (see the module docstring)."""

    _lock: threading.Lock
    _db: sqlite3.Connection

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def add_found(self, found: Sequence[tuple[StoreKey, int, int]], stale_before_ns: int | None = None) -> None:
        """Index files found in the folder (key, bytes, mtime ns), ready, without evicting: the background
        build. A key already indexed (written meanwhile by a put) is left as it is, except a row not
        ready admitted before `stale_before_ns` (its writer crashed after the rename): marked ready."""
        with self._lock, self._tx() as db:
            now = time.time_ns()
            for key, n, tick in found:
                g = group_id(key.group)
                cur = db.execute("INSERT OR IGNORE INTO objects VALUES(?, ?, ?, 1, ?)", (g, key.member, n, now))
                if cur.rowcount != 1:
                    if stale_before_ns is not None:
                        db.execute(
                            "UPDATE objects SET ready=1, since=? WHERE g=? AND member=? AND ready=0 AND since<?",
                            (now, g, key.member, stale_before_ns),
                        )
                    continue
                db.execute(
                    "INSERT INTO groups VALUES(?, ?, ?, ?, ?, ?) ON CONFLICT(g) DO UPDATE SET"
                    " nbytes=nbytes+excluded.nbytes, tick=MAX(tick, excluded.tick)",
                    (g, key.tenant, pack_name(key.fingerprint), pack_name(key.chunk), n, tick),
                )
                db.execute(
                    "INSERT INTO tenants VALUES(?, ?) ON CONFLICT(tenant) DO UPDATE SET used=used+excluded.used",
                    (key.tenant, n),
                )

    def begin_scan(self) -> None:
        """Start recording the files a folder scan sees (a temp table of this connection, on disk)."""
        with self._lock:
            self._db.execute("DROP TABLE IF EXISTS temp.scan_seen")
            self._db.execute(
                "CREATE TEMP TABLE scan_seen(g BLOB NOT NULL, member TEXT NOT NULL, PRIMARY KEY(g, member))"
                " WITHOUT ROWID"
            )

    def note_seen(self, keys: Sequence[StoreKey]) -> None:
        """Record object files the scan saw (valid or not); writes only this connection's temp table."""
        with self._lock:
            self._db.executemany(
                "INSERT OR IGNORE INTO temp.scan_seen VALUES(?, ?)", [(group_id(k.group), k.member) for k in keys]
            )

    def sweep_unseen(self, scan_began_ns: int, stale_before_ns: int) -> int:
        """Unindex the rows whose file the scan (`begin_scan`, `note_seen`) did not see: ready rows
        ready before `scan_began_ns` (their file existed before the scan, so it would have been
        seen), and rows not ready admitted before `stale_before_ns` (crashed writes); returns how many.

        Set-based: the candidates are found in 256 slices of the key space, each one read
        statement (no write lock, this connection's lock held per slice only), then re-checked
        and removed, bytes and all, in one write transaction (a row re-admitted or readied
        meanwhile no longer qualifies and stays)."""
        live = "((o.ready=1 AND o.since<?) OR (o.ready=0 AND o.since<?))"
        with self._lock:
            self._db.execute("DROP TABLE IF EXISTS temp.scan_unseen")
            self._db.execute(
                "CREATE TEMP TABLE scan_unseen(g BLOB NOT NULL, member TEXT NOT NULL, PRIMARY KEY(g, member))"
                " WITHOUT ROWID"
            )
        for b in range(256):
            lo, hi = bytes([b]), bytes([b + 1]) if b < 255 else b"\xff" * 17  # every 16-byte id is below
            with self._lock:
                self._db.execute(
                    "INSERT INTO temp.scan_unseen SELECT o.g, o.member FROM main.objects o"
                    f" WHERE o.g>=? AND o.g<? AND {live} AND NOT EXISTS"  # noqa: S608 - fixed text
                    " (SELECT 1 FROM temp.scan_seen s WHERE s.g=o.g AND s.member=o.member)",
                    (lo, hi, scan_began_ns, stale_before_ns),
                )
        with self._lock, self._tx() as db:
            db.execute("DROP TABLE IF EXISTS temp.scan_gone")
            db.execute(
                "CREATE TEMP TABLE scan_gone(g BLOB NOT NULL, member TEXT NOT NULL, nbytes INTEGER NOT NULL,"
                " tenant TEXT NOT NULL, PRIMARY KEY(g, member)) WITHOUT ROWID"
            )
            db.execute(
                "INSERT INTO temp.scan_gone SELECT o.g, o.member, o.nbytes, gr.tenant FROM temp.scan_unseen u"
                " JOIN main.objects o ON o.g=u.g AND o.member=u.member"
                f" JOIN main.groups gr ON gr.g=o.g WHERE {live}",  # noqa: S608 - fixed text
                (scan_began_ns, stale_before_ns),
            )
            n = int(db.execute("SELECT COUNT(*) FROM temp.scan_gone").fetchone()[0])
            if n:
                db.executemany(
                    "UPDATE tenants SET used=used-? WHERE tenant=?",
                    db.execute("SELECT SUM(nbytes), tenant FROM temp.scan_gone GROUP BY tenant").fetchall(),
                )
                db.execute(
                    "UPDATE groups SET nbytes=nbytes-(SELECT SUM(k.nbytes) FROM temp.scan_gone k"
                    " WHERE k.g=groups.g) WHERE g IN (SELECT g FROM temp.scan_gone)"
                )
                db.execute("DELETE FROM objects WHERE (g, member) IN (SELECT g, member FROM temp.scan_gone)")
                db.execute(
                    "DELETE FROM groups WHERE g IN (SELECT g FROM temp.scan_gone)"
                    " AND NOT EXISTS (SELECT 1 FROM objects o WHERE o.g=groups.g)"
                )
                db.execute(
                    "DELETE FROM facts WHERE g IN (SELECT g FROM temp.scan_gone)"
                    " AND NOT EXISTS (SELECT 1 FROM groups gr WHERE gr.g=facts.g)"
                )
                db.execute("DELETE FROM tenants WHERE used<=0")
            for table in ("scan_gone", "scan_unseen", "scan_seen"):
                db.execute(f"DROP TABLE temp.{table}")  # noqa: S608 - fixed names
        return n
