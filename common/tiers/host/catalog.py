"""The host store's index: the disk tier's shared catalog plus who is writing each object.

`HostCatalog` adds one table to `kvpack.tiers.disk.catalog.Catalog`:
``pending(g, member, owner)``, a row per object admitted and not yet marked
ready, naming the owner (`kvpack.tiers.host.owners`) whose process writes it.
It is inserted in the admitting transaction (`_apply`) and deleted with the
object's group (`_delete_groups`) or once the object is ready (`mark_ready`), each a
constant number of statements per batch (`kvpack.tiers.disk.batch_sql`).
So when a process dies mid-store, `reclaim` finds at once (no grace period)
which not-ready rows were its and returns their groups' bytes to the budget;
the disk tier's time-based grace (`WRITE_GRACE_S`) stays as a second net.

Invariant: a pending row names the only owner that may mark its object ready; a
newer admission of the same object (another process) replaces it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from ...keys import StoreKey
from ..disk.batch_sql import chunks, flat, marks, values
from ..disk.catalog import Catalog
from ..disk.rows import Victim, group_id

_PENDING = (
    "CREATE TABLE IF NOT EXISTS pending(g BLOB NOT NULL, member TEXT NOT NULL, owner TEXT NOT NULL,"
    " PRIMARY KEY(g, member)) WITHOUT ROWID"
)


class HostCatalog(Catalog):
    """The disk catalog with pending-writer rows. Set `owner` before the first `admit`."""

    owner = ""
    """This process's owner token (`Owner.token`)."""

    def _set_up(self, busy_timeout_s: float) -> None:
        super()._set_up(busy_timeout_s)
        self._db.execute(_PENDING)  # autocommit, under the writer lock the caller holds

    def _apply(
        self,
        db: sqlite3.Connection,
        tenant: str,
        requests: Sequence[tuple[StoreKey, int, int | None]],
        plan: tuple[list[bytes], int],
        used: dict[str, int],
    ) -> list[Victim]:
        gone = super()._apply(db, tenant, requests, plan, used)
        rows = list(dict.fromkeys((group_id(key.group), key.member, self.owner) for key, _, _ in requests))
        for part in chunks(rows, 3):
            sql = f"INSERT OR REPLACE INTO pending VALUES {values(len(part), 3)}"  # noqa: S608 - placeholders only
            db.execute(sql, flat(part))
        return gone

    def _delete_groups(
        self, db: sqlite3.Connection, ids: Sequence[bytes], used: dict[str, int] | None = None
    ) -> list[Victim]:
        victims = super()._delete_groups(db, ids, used)
        unique = list(dict.fromkeys(ids))
        for part in chunks(unique, 1):
            db.execute(f"DELETE FROM pending WHERE g IN ({marks(len(part))})", part)  # noqa: S608 - placeholders only
        return victims

    def mark_ready(self, keys: Sequence[StoreKey]) -> list[bool]:
        """`Catalog.mark_ready`, then the keys' pending rows go (a crash between leaves ready rows
        with stale pending rows, which `reclaim` ignores and removes)."""
        ready = super().mark_ready(keys)
        if keys:
            with self._lock, self._tx() as db:
                rows = list(dict.fromkeys((group_id(k.group), k.member) for k in keys))
                for part in chunks(rows, 2):
                    sql = (
                        f"WITH k(g, m) AS (VALUES {values(len(part), 2)})"  # noqa: S608 - placeholders only
                        " DELETE FROM pending WHERE owner=? AND (g, member) IN (SELECT g, m FROM k)"
                    )
                    db.execute(sql, [*flat(part), self.owner])
        return ready

    def pending_owners(self) -> set[str]:
        """Owners with a pending row (read only)."""
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT DISTINCT owner FROM pending")}

    def reclaim(self, dead: set[str]) -> list[Victim]:
        """Delete, in one transaction, the groups holding an object that a `dead` owner admitted and
        never marked ready, and every pending row of those owners; returns the deleted groups."""
        if not dead:
            return []
        marks = ",".join("?" * len(dead))
        owners = sorted(dead)
        with self._lock, self._tx() as db:
            sql = (
                "SELECT DISTINCT p.g FROM pending p JOIN objects o ON o.g=p.g AND o.member=p.member"  # noqa: S608
                f" WHERE o.ready=0 AND p.owner IN ({marks})"
            )
            groups = [r[0] for r in db.execute(sql, owners)]
            victims = self._delete_groups(db, groups)
            db.execute(f"DELETE FROM pending WHERE owner IN ({marks})", owners)  # noqa: S608
            return victims
