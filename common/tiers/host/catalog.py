"""The host store's index: the disk tier's shared catalog, plus who writes each object and which
pages of the arena (`kvpack.tiers.host.pages`) hold it.

`HostCatalog` adds to `kvpack.tiers.disk.catalog.Catalog`:

- ``pending(g, member, owner)``: a row per object admitted and not yet marked ready, naming the
  owner (`kvpack.tiers.host.owners`) whose process writes it. So when a process dies mid-store,
  `reclaim` finds at once (no grace period) which not-ready rows were its;
- ``extents(g, member, gen, pages, runs, writer)``: per object, its generation, its pages (a JSON
  list, in the record's order) and the same as runs of consecutive pages (what a load reads);
  ``writer`` names the put (``<owner>/<put>``) still writing it, NULL once the object is ready;
- ``free(page)``: the pages no object holds; ``limbo(page, writer)``: pages of objects deleted
  while their writer was still writing them (evicted, replaced, or a failed put), held until that
  writer is done (`finish`) or found dead (`reclaim`), so no page is handed to a new object while
  an old writer may still copy into it;
- ``meta``: the arena's geometry (``arena_page``, ``arena_pages``), written once with the arena
  (and again, the index emptied, if the arena file is found gone or of another size).

Invariants (each kept inside the transaction that changes them; the tests check the first):
every page is in exactly one of ``free``, ``limbo`` and one extents row; an object's extents row
exists exactly while its objects row does (a trigger moves its pages to ``free``, or to ``limbo``
while its writer is named, when the objects row is deleted or replaced: SQLite code, no
statement per row from Python); the bytes an object is charged (`tenants.used`) are its pages';
`admit` plans with the capacity less the pages that will not be free (``limbo``'s, and those of
objects being written that the batch replaces) and never evicts a group being written
(`EVICTABLE`), so an admitted batch always finds its pages free. A pending row names the owner
writing the object; a newer admission of the same object replaces its row, its pages (the older
writer's wait in limbo) and its pending row. Whoever marks it ready, a load finds its bytes only
once their stamps carry its generation, which only its own writer sets.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import ConfigError
from ...identity.keys import StoreKey
from ..disk.batch_sql import chunks, flat, marks, values
from ..disk.catalog import Catalog
from ..disk.private import fd_problem
from ..disk.rows import Victim, group_id
from .pages import ARENA, Geometry, create_arena, new_generations, page_runs

FIELD = "memory.mode"
"""The config field a host store's start-up errors name."""

_TABLES = (
    "CREATE TABLE IF NOT EXISTS pending(g BLOB NOT NULL, member TEXT NOT NULL, owner TEXT NOT NULL,"
    " PRIMARY KEY(g, member)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS extents(g BLOB NOT NULL, member TEXT NOT NULL, gen INTEGER NOT NULL,"
    " pages TEXT NOT NULL, runs TEXT NOT NULL, writer TEXT, PRIMARY KEY(g, member)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS free(page INTEGER PRIMARY KEY)",
    "CREATE TABLE IF NOT EXISTS limbo(page INTEGER PRIMARY KEY, writer TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS extents_writer ON extents(writer) WHERE writer IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS limbo_writer ON limbo(writer)",
    "CREATE TRIGGER IF NOT EXISTS objects_gone AFTER DELETE ON objects BEGIN"
    " INSERT INTO free(page) SELECT j.value FROM extents e, json_each(e.pages) j"
    "  WHERE e.g=OLD.g AND e.member=OLD.member AND e.writer IS NULL;"
    " INSERT INTO limbo(page, writer) SELECT j.value, e.writer FROM extents e, json_each(e.pages) j"
    "  WHERE e.g=OLD.g AND e.member=OLD.member AND e.writer IS NOT NULL;"
    " DELETE FROM extents WHERE g=OLD.g AND member=OLD.member;"
    " END",
)


@dataclass(frozen=True, slots=True)
class Extent:
    """Where one object lies in the arena: its generation and its pages as (first page, count) runs
    of consecutive pages, in the record's order (`pages.page_runs`)."""

    gen: int
    runs: tuple[tuple[int, int], ...]


class HostCatalog(Catalog):
    """The disk catalog with pending writers and arena pages. Set `owner` before the first `admit`."""

    owner = ""
    """This process's owner token (`Owner.token`)."""
    EVICTABLE = "NOT EXISTS (SELECT 1 FROM pending p WHERE p.g=groups.g)"
    """Eviction never takes a group with an object being written: its pages would stay in limbo, not
    free, until its writer ends (a dead writer's are reclaimed first: `HostTier.put_from`)."""

    def __init__(self, path: str, busy_timeout_s: float, *, capacity: int, root_fd: int) -> None:
        """Open (or create) the index at `path` and, for a new store, its arena of `capacity` bytes
        in the folder `root_fd` (an existing store keeps its own: `geometry`)."""
        self._want = Geometry.for_capacity(capacity)
        self._root_fd = root_fd
        self.geometry = self._want
        self._admit_lock = threading.Lock()
        self._writer = ""
        self._allocated: dict[tuple[bytes, str], Extent] = {}
        super().__init__(path, busy_timeout_s, private_fd=root_fd)

    def _set_up(self, busy_timeout_s: float) -> None:
        """The disk schema, this one's tables, and the arena: made with the geometry when the index
        has none (a new store: every page free), read from it otherwise. Runs under the writer lock."""
        super()._set_up(busy_timeout_s)
        db = self._db
        db.execute("PRAGMA recursive_triggers=ON")  # a replaced objects row frees its pages too
        db.execute("BEGIN IMMEDIATE")
        try:
            for stmt in _TABLES:
                db.execute(stmt)
            meta = dict(db.execute("SELECT k, v FROM meta WHERE k IN ('arena_page', 'arena_pages')"))
            if len(meta) == 2:
                self.geometry = Geometry(int(meta["arena_page"]), int(meta["arena_pages"]))
                if not self._arena_whole():
                    self._new_arena(db, wipe=True)
            else:
                self._new_arena(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _arena_whole(self) -> bool:
        """Is the store's arena file there, a regular file of its geometry's size, this user's alone?
        (Else a new one replaces it; what is mapped is checked again on its own descriptor: `SharedPages`.)"""
        try:
            st = os.stat(ARENA, dir_fd=self._root_fd, follow_symlinks=False)
        except OSError:
            return False
        whole = stat.S_ISREG(st.st_mode) and st.st_size == self.geometry.file_bytes
        return whole and fd_problem(st, ARENA, folder=False) is None

    def _new_arena(self, db: sqlite3.Connection, wipe: bool = False) -> None:
        """A new arena of the wanted geometry, every page free. `wipe`: the index describes an arena
        that is gone (its file removed behind kvpack's back): its rows go first (a cache: misses)."""
        if wipe:
            for table in ("extents", "limbo", "pending", "facts", "objects", "groups", "tenants"):
                db.execute(f"DELETE FROM {table}")  # noqa: S608 - fixed names; extents first: the trigger finds none
        elif db.execute("SELECT 1 FROM objects LIMIT 1").fetchone() is not None:
            raise ConfigError(
                FIELD,
                "host store written by an older kvpack (one file per object); drop it with "
                "`kvpack host drop NAME` once no process uses it",
            )
        geometry = self._want
        try:
            create_arena(self._root_fd, geometry)
        except OSError as exc:
            raise ConfigError(
                FIELD, f"host: the shared memory cannot hold {geometry.file_bytes >> 20} MiB ({exc})"
            ) from None
        db.execute("DELETE FROM free")
        db.execute("DELETE FROM limbo")
        db.execute("DELETE FROM extents")
        db.execute(
            "WITH RECURSIVE n(p) AS (SELECT 0 WHERE ?>0 UNION ALL SELECT p+1 FROM n WHERE p+1<?)"
            " INSERT INTO free(page) SELECT p FROM n",
            (geometry.pages, geometry.pages),
        )
        db.executemany(
            "INSERT OR REPLACE INTO meta VALUES(?, ?)",
            [("arena_page", str(geometry.page_bytes)), ("arena_pages", str(geometry.pages)), ("complete", "1")],
        )
        self.geometry = geometry

    # -- admission: rows and pages ---------------------------------------------------------

    def admit_pages(
        self,
        tenant: str,
        requests: Sequence[tuple[StoreKey, int, int | None]],
        quotas: dict[str, int],
        writer: str,
    ) -> tuple[list[bool], list[Victim], dict[tuple[bytes, str], Extent]]:
        """`Catalog.admit` within the arena's capacity, each request's bytes being whole pages;
        also returns the pages allocated per (group id, member), held for `writer` until `finish`."""
        with self._admit_lock:
            self._writer, self._allocated = writer, {}
            try:
                admitted, victims = self.admit(tenant, requests, self.geometry.capacity, quotas)
                return admitted, victims, self._allocated
            finally:
                self._writer, self._allocated = "", {}

    def _plan(
        self,
        db: sqlite3.Connection,
        tenant: str,
        requests: Sequence[tuple[StoreKey, int, int | None]],
        capacity: int,
        quotas: dict[str, int],
        used: dict[str, int],
        batch: set[bytes],
    ) -> tuple[list[bytes], int] | None:
        """`Catalog._plan` with the pages that will not be free off the capacity: those in limbo, and
        those of objects being written that `requests` replace (they go to limbo, not to ``free``)."""
        keys = list({(group_id(key.group), key.member) for key, _, _ in requests})
        (held,) = db.execute("SELECT COUNT(*) FROM limbo").fetchone()
        for part in chunks(keys, 2):
            sql = (
                f"WITH k(g, m) AS (VALUES {values(len(part), 2)})"  # noqa: S608 - placeholders only
                " SELECT COALESCE(SUM(json_array_length(e.pages)), 0) FROM extents e JOIN k ON e.g=k.g AND e.member=k.m"
                " WHERE e.writer IS NOT NULL"
            )
            held += db.execute(sql, flat(part)).fetchone()[0]
        held_bytes = int(held) * self.geometry.page_bytes
        return super()._plan(db, tenant, requests, capacity - held_bytes, quotas, used, batch)

    def _apply(
        self,
        db: sqlite3.Connection,
        tenant: str,
        requests: Sequence[tuple[StoreKey, int, int | None]],
        plan: tuple[list[bytes], int],
        used: dict[str, int],
    ) -> list[Victim]:
        """`Catalog._apply` (victims deleted: their pages freed by the trigger), the pending rows,
        then each new object's pages taken from ``free`` (the lowest first: records stay contiguous
        while the arena is not fragmented) and its extents row: a constant number of statements."""
        gone = super()._apply(db, tenant, requests, plan, used)
        objects = self._objects(requests)
        rows = [(g, m, self.owner) for g, m in objects]
        for part in chunks(rows, 3):
            sql = f"INSERT OR REPLACE INTO pending VALUES {values(len(part), 3)}"  # noqa: S608 - placeholders only
            db.execute(sql, flat(part))
        page = self.geometry.page_bytes
        counts = [n // page for n in objects.values()]
        # one row read and one delete (a RETURNING row per page would be a step, a GIL hand-off, each)
        lowest = "SELECT page FROM free ORDER BY page LIMIT ?"
        (listed,) = db.execute(f"SELECT json_group_array(page) FROM ({lowest})", (sum(counts),)).fetchone()
        pages = sorted(json.loads(listed))
        if len(pages) != sum(counts):
            raise RuntimeError(f"host store index: {len(pages)} free pages for {sum(counts)} admitted")
        db.execute(f"DELETE FROM free WHERE page IN ({lowest})", (sum(counts),))  # noqa: S608 - fixed text
        extents: list[tuple[bytes, str, int, str, str, str]] = []
        at = 0
        for (g, m), count, gen in zip(objects, counts, new_generations(len(counts))):
            mine = pages[at : at + count]
            at += count
            runs = page_runs(mine)
            self._allocated[(g, m)] = Extent(gen, runs)
            listed = ",".join(map(str, mine))
            spans = ",".join(f"[{first},{count}]" for first, count in runs)
            extents.append((g, m, gen, f"[{listed}]", f"[{spans}]", self._writer))
        for part6 in chunks(extents, 6):
            db.execute(f"INSERT INTO extents VALUES {values(len(part6), 6)}", flat(part6))  # noqa: S608
        return gone

    def _delete_groups(
        self, db: sqlite3.Connection, ids: Sequence[bytes], used: dict[str, int] | None = None
    ) -> list[Victim]:
        victims = super()._delete_groups(db, ids, used)
        unique = list(dict.fromkeys(ids))
        for part in chunks(unique, 1):
            db.execute(f"DELETE FROM pending WHERE g IN ({marks(len(part))})", part)  # noqa: S608 - placeholders only
        return victims

    def finish(self, keys: Sequence[StoreKey], writer: str) -> list[bool]:
        """The end of `writer`'s put, in one transaction of a constant number of statements: the
        objects whose pages it still holds (none replaced, evicted or removed meanwhile) marked ready
        and no longer pending, their pages no longer held, and the writer's limbo pages freed. Per key
        of `keys`, was it marked ready (False: replaced, evicted or removed while it was written)?
        An object another writer admitted again is never marked ready by this one."""
        mine = "SELECT g, member FROM extents WHERE writer=?"
        with self._lock, self._tx(save=True) as db:
            (listed,) = db.execute(
                "SELECT json_group_array(json_array(hex(g), member)) FROM extents WHERE writer=?", (writer,)
            ).fetchone()
            ours = {(bytes.fromhex(g), m) for g, m in json.loads(listed)}
            if ours:
                db.execute(
                    f"UPDATE objects SET ready=1, since=? WHERE (g, member) IN ({mine})",  # noqa: S608 - fixed text
                    (time.time_ns(), writer),
                )
                db.execute(
                    f"DELETE FROM pending WHERE owner=? AND (g, member) IN ({mine})",  # noqa: S608 - fixed text
                    (self.owner, writer),
                )
                db.execute("UPDATE extents SET writer=NULL WHERE writer=?", (writer,))
            self._release(db, "writer=?", [writer])
        return [(group_id(k.group), k.member) in ours for k in keys]

    @staticmethod
    def _release(db: sqlite3.Connection, where: str, params: Sequence[str]) -> None:
        """Free the limbo pages `where` selects."""
        db.execute(f"INSERT INTO free(page) SELECT page FROM limbo WHERE {where}", params)  # noqa: S608 - fixed text
        db.execute(f"DELETE FROM limbo WHERE {where}", params)  # noqa: S608 - fixed text

    # -- reads -----------------------------------------------------------------------------

    def ready_extents(self, keys: Sequence[StoreKey]) -> list[Extent | None]:
        """Per key: the extent of its ready object, else None (one read per 500 groups, no write)."""
        ids = [group_id(k.group) for k in keys]
        unique = list(dict.fromkeys(ids))
        found: dict[tuple[bytes, str], Extent] = {}
        with self._lock:
            for lo in range(0, len(unique), 500):
                part = unique[lo : lo + 500]
                sql = (
                    "SELECT o.g, o.member, e.gen, e.runs FROM objects o JOIN extents e"  # noqa: S608 - placeholders only
                    f" ON e.g=o.g AND e.member=o.member WHERE o.g IN ({marks(len(part))}) AND o.ready=1"
                )
                for g, m, gen, runs in self._db.execute(sql, part):
                    found[(g, m)] = Extent(int(gen), tuple(map(tuple, json.loads(runs))))
        return [found.get((g, k.member)) for g, k in zip(ids, keys)]

    def page_census(self) -> tuple[int, int, int]:
        """(free, in limbo, held by extents) pages: their sum is the arena's pages (the invariant)."""
        with self._lock:
            free = self._db.execute("SELECT COUNT(*) FROM free").fetchone()[0]
            limbo = self._db.execute("SELECT COUNT(*) FROM limbo").fetchone()[0]
            held = self._db.execute("SELECT COALESCE(SUM(json_array_length(pages)), 0) FROM extents").fetchone()[0]
        return int(free), int(limbo), int(held)

    # -- dead writers ----------------------------------------------------------------------

    def pending_owners(self) -> set[str]:
        """Owners with a pending row or pages in limbo (read only)."""
        with self._lock:
            pending = {r[0] for r in self._db.execute("SELECT DISTINCT owner FROM pending")}
            held = self._db.execute("SELECT DISTINCT writer FROM limbo").fetchall()
        return pending | {w.split("/", 1)[0] for (w,) in held}

    def reclaim(self, dead: set[str]) -> list[Victim]:
        """Delete, in one transaction, the groups holding an object that a `dead` owner admitted and
        never marked ready, every pending row of those owners, and free the pages their puts held;
        returns the deleted groups."""
        if not dead:
            return []
        owners = sorted(dead)
        ids = marks(len(owners))
        with self._lock, self._tx() as db:
            sql = (
                "SELECT DISTINCT p.g FROM pending p JOIN objects o ON o.g=p.g AND o.member=p.member"  # noqa: S608
                f" WHERE o.ready=0 AND p.owner IN ({ids})"
            )
            groups = [r[0] for r in db.execute(sql, owners)]
            victims = self._delete_groups(db, groups)
            db.execute(f"DELETE FROM pending WHERE owner IN ({ids})", owners)  # noqa: S608
            self._release(db, f"substr(writer, 1, instr(writer, '/') - 1) IN ({ids})", owners)
            return victims


def writer_name(owner: str) -> str:
    """A new put's writer name: its process's owner token, a slash, a random part."""
    return f"{owner}/{os.urandom(6).hex()}"
