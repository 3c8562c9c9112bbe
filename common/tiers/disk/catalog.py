"""The disk tier's persistent, host-shared index: one SQLite file in the store folder.

Every process that opens a store folder (a vLLM scheduler and its TP workers,
several instances) shares this one index and its capacity authority, so
opening is O(1) (nothing is scanned when the index is complete), the index
costs no per-object Python objects, and `capacity` bounds the folder, not a
process.

Schema (``.kvpack-store.index``; SQLite in WAL mode, so readers never wait for
a writer; every write is one short ``BEGIN IMMEDIATE`` transaction bounded by
`busy_timeout_s`, whose number of statements does not grow with its batch: `batch_sql`):

- ``groups(g, tenant, fp, chunk, nbytes, tick)``: one row per stored group
  (``fp`` and ``chunk`` as bytes when they are lowercase hex, else text);
  ``g`` is a 16-byte BLAKE2b of ``tenant/fp/chunk``; ``tick`` (ns) orders
  eviction (LRU over groups; an index on it makes the oldest cheap to find);
- ``objects(g, member, nbytes, ready, since)``: one row per object file; ``ready`` is 0 from
  `Catalog.admit` until its writer marks the file written (`Catalog.mark_ready`), 1 after (and for
  files the folder scan found); ``since`` is the wall-clock ns of that last change (admitted, or ready);
- ``tenants(tenant, used)``: bytes per tenant, updated in the same transaction
  as every insert and delete, so ``SUM(used)`` is the folder's usage;
- ``meta``: the schema version and ``complete`` once every file of an older
  store was indexed (`kvpack.tiers.disk.scan` builds it in the background);
- ``facts(seq, g, origin, identity, blob)``: at most one row per group, what its writer told
  routers about it (`kvpack.observe.router_facts`): inserted only while the group has a ready object
  (`record_facts`), deleted with the group; ``seq`` only grows (AUTOINCREMENT: never reused),
  so a reader tails it with a cursor (`facts_after`).

Invariants: a group row's ``nbytes`` is the sum of its objects' (ready or not: a row being
written holds its bytes), a tenant's ``used`` the sum of its groups'; a row is inserted (not
ready) before its file is written and deleted before its file is unlinked; `lookup` sees only
ready rows, so no process finds an object whose file is still to come. A ready row's file
exists unless something outside kvpack removed it: a load miss on it `forget`s it at once, and
the folder scan at open drops ready rows whose file it did not find (`sweep_unseen`). A row
still not ready `WRITE_GRACE_S` after its admission is a crashed writer's, dropped the same
ways (or marked ready when the scan finds its file whole). An orphan file of an evicted group
is never loaded because loads verify the file's own header.

A group's ``tick`` is when its last store was accepted (`PutItem.accepted_ns`, or the
admission's own time) or it was last read: a store that arrives after newer ones evicts only
less recent groups, or is refused. Eviction is LRU over groups (this index selects the candidates in tick order)
decided by the one victim rule of `kvpack.policy.eviction.shares`, the memory tier's too
(a tenant over its share evicts its own groups first; no other tenant is pushed below its share). The configured ARC
policy is approximated by this shared LRU order: ARC's per-process ghost lists
would not be shared, and the recency order is what all processes agree on.
Reads do not write: touched groups are buffered and their ticks written in
one transaction at most every `TOUCH_FLUSH_S` (or with the next put), at most
`MAX_TOUCHES` of them (LRU over a sample of the reads beyond that rate).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, cast

from ...errors import ConfigError
from ...identity.keys import GroupKey, StoreKey
from ...observe.router_facts import MAX_FACTS_BYTES, FactsRow, RouterFacts
from ...policy.eviction.shares import Candidate, choose_victims
from . import batch_sql, census, index_files, private
from .batch_sql import GroupRows, ObjectRows
from .reconcile import ScanReconcile
from .rows import Victim, group_id, pack_name, unpack_name

INDEX_NAME = ".kvpack-store.index"
"""Starts with the marker's name plus a dot: `fs` treats it (and its -wal/-shm) as the marker's own."""
INDEX_FILES = (INDEX_NAME, *(INDEX_NAME + suffix for suffix in ("-wal", "-shm", ".lock")))
"""The index and SQLite's and the writer lock's files beside it."""
SCHEMA_VERSION = "2"
INDEX_BUSY_TIMEOUT_S = 10.0
"""Seconds start-up (and `kvpack config`'s read-only check) waits for another process's index lock."""
WRITE_LOCK_WAIT_S = 0.1
"""Seconds a write after start-up waits for another process's index lock (the lock file, then SQLite's):
less than a step's budget (`io_timeout_ms`). A save that cannot have it in time is dropped and counted
(``index_busy``: a later miss), so a process stopped inside a transaction never stalls the others."""
WRITE_GRACE_S = 60.0
"""A row not ready this long after its admission is a crashed writer's (no write takes this long)."""
TOUCH_FLUSH_S = 1.0
"""Buffered read touches are written at most this often (and with every put)."""
MAX_TOUCHES = 2048
"""Groups touched per flush at most: each dirties a page of ``groups`` and two of its tick index,
so the read path's writes stay bounded (about 25 MB of WAL a second at the worst) however fast
a process reads; reads beyond it in one `TOUCH_FLUSH_S` do not refresh their group's tick."""

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v TEXT NOT NULL) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS groups(g BLOB PRIMARY KEY, tenant TEXT NOT NULL, fp TEXT NOT NULL,"
    " chunk TEXT NOT NULL, nbytes INTEGER NOT NULL, tick INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS groups_tick ON groups(tick)",
    "CREATE TABLE IF NOT EXISTS objects(g BLOB NOT NULL, member TEXT NOT NULL, nbytes INTEGER NOT NULL,"
    " ready INTEGER NOT NULL, since INTEGER NOT NULL, PRIMARY KEY(g, member)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS tenants(tenant TEXT PRIMARY KEY, used INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS facts(seq INTEGER PRIMARY KEY AUTOINCREMENT, g BLOB NOT NULL UNIQUE,"
    " origin TEXT NOT NULL, identity TEXT NOT NULL, blob BLOB NOT NULL)",
    census.OWNER_INDEX,
    census.MODELS_TABLE,
)


class IndexBusy(TimeoutError):
    """Another process held the index's lock longer than this write waits for it (`WRITE_LOCK_WAIT_S`)."""


def _flock(fd: int, timeout_s: float) -> None:
    """Take the exclusive lock on `fd` within `timeout_s` (IndexBusy), polling every 0.2 ms."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise IndexBusy("the disk index is held by another process") from None
            time.sleep(0.0002)


class Catalog(ScanReconcile):
    """One process's connection to the folder's index. Thread-safe (one lock per connection)."""

    EVICTABLE = ""
    """A condition on ``groups`` rows that eviction may take ("": any; the host store's: none being written)."""
    kept: Callable[[], Collection[bytes]] | None = None
    """The group ids pinned by their tenant (`kvpack.store.pins`): never victims while it answers them."""

    def __init__(
        self, path: str, busy_timeout_s: float = INDEX_BUSY_TIMEOUT_S, *, private_fd: int | None = None
    ) -> None:
        """Open (or create) the index at `path`; a file of another schema version is emptied
        and rebuilt from the folder (it is derived data: the object files are the truth).

        `private_fd`: the fd of the private folder `path` lies in (`kvpack.tiers.disk.private`):
        the index's files are created there (or opened) and checked through their descriptors
        first (`private.open_file`), SQLite then opens the same files by path, and the index's
        inode is checked to be the one checked (NotPrivate otherwise)."""
        self._lock = threading.Lock()
        self._timeout_s = busy_timeout_s
        self._path = path
        self._private_fd = private_fd
        held = index_files.hold_private(path, private_fd, INDEX_FILES) if private_fd is not None else {}
        if private_fd is None:
            self._lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        else:
            self._lock_fd = held.pop(INDEX_FILES[3])
        db: sqlite3.Connection | None = None
        try:
            # Set-up runs under the writer lock: turning a new file to WAL needs it alone (SQLite answers
            # "database is locked" at once, not after its busy timeout, while another opener reads it).
            _flock(self._lock_fd, busy_timeout_s)
            db = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
            self._db = db
            if private_fd is not None:
                index_files.same_inode(private_fd, INDEX_FILES[0], held[INDEX_FILES[0]])
            deadline = time.monotonic() + busy_timeout_s
            while True:
                try:
                    self._set_up(busy_timeout_s)
                    break
                except sqlite3.OperationalError as exc:  # SQLite answers some lock waits at once
                    if "locked" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)
            # from now on a write waits for SQLite's own lock no longer than for the lock file (`_Tx`)
            db.execute(f"PRAGMA busy_timeout={int(WRITE_LOCK_WAIT_S * 1000)}")
        except BaseException:
            if db is not None:
                db.close()
            os.close(self._lock_fd)  # releases the lock too
            for fd in held.values():
                os.close(fd)
            raise
        # Kept open until the connection is closed: closing any descriptor of a file drops every POSIX
        # lock this process holds on it, SQLite's included (its WAL read marks on -shm), and a reader
        # without them keeps reading an old snapshot while other processes write and checkpoint.
        self._held_fds = list(held.values())
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        index_files.FORKED.add(self)
        self._tick = 0
        self._touched: dict[bytes, int] = {}
        self._last_flush = time.monotonic()

    def _set_up(self, busy_timeout_s: float) -> None:
        """WAL mode and the schema (the caller holds the writer lock)."""
        db = self._db
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute(_SCHEMA[0])
            row = db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()
            if row is not None and row[0] != SCHEMA_VERSION:
                for table in ("groups", "objects", "tenants", "facts", "models", "meta"):
                    db.execute(f"DROP TABLE IF EXISTS {table}")  # noqa: S608 - fixed names
            for stmt in _SCHEMA:
                db.execute(stmt)
            if row is None or row[0] != SCHEMA_VERSION:
                db.execute("INSERT INTO meta VALUES('schema', ?)", (SCHEMA_VERSION,))
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # -- transactions --------------------------------------------------------------

    class _Tx:
        """One write transaction, entered under the folder's writer ``flock`` first.

        SQLite's own busy handler sleeps in growing steps (up to 100 ms) while
        another process writes; waiting on the lock file instead hands the index
        over as soon as the holder commits, so several writers do not idle.

        Without `begin`: the ``flock`` only, for a change of one statement, which
        SQLite makes atomic by itself (``BEGIN`` and ``COMMIT`` are two more
        statements, each giving the GIL up)."""

        def __init__(self, db: sqlite3.Connection, lock_fd: int, timeout_s: float, begin: bool = True) -> None:
            self._db, self._fd, self._timeout_s, self._begin = db, lock_fd, timeout_s, begin

        def __enter__(self) -> sqlite3.Connection:
            _flock(self._fd, self._timeout_s)
            try:
                if self._begin:
                    self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:  # SQLite's own lock, held without the lock file
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                if "locked" in str(exc) or "busy" in str(exc):
                    raise IndexBusy(f"the disk index is held by another process ({exc})") from None
                raise
            except BaseException:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                raise
            return self._db

        def __exit__(
            self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
        ) -> None:
            try:
                if self._begin:
                    self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _tx(self, begin: bool = True, save: bool = False) -> Catalog._Tx:
        """A write transaction; `save`: one on a save's path, which waits `WRITE_LOCK_WAIT_S` at most
        for another process's lock (IndexBusy), not the start-up's `busy_timeout_s`."""
        wait_s = min(self._timeout_s, WRITE_LOCK_WAIT_S) if save else self._timeout_s
        return Catalog._Tx(self._db, self._lock_fd, wait_s, begin)

    # -- state ---------------------------------------------------------------------

    def complete(self) -> bool:
        """Is every file of the folder indexed (no background build needed or running)?"""
        with self._lock:
            return self._db.execute("SELECT 1 FROM meta WHERE k='complete'").fetchone() is not None

    def mark_complete(self) -> None:
        with self._lock, self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES('complete', '1')")

    # -- reads ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Per key: is it indexed and its file written (ready)? One ``SELECT ... IN`` per batch (no write)."""
        return [row is not None for row in self.ready_rows(keys)]

    def ready_rows(self, keys: Sequence[StoreKey]) -> list[tuple[int, int] | None]:
        """Per key: (bytes, wall-clock ns it became ready) of its ready row, else None (no write)."""
        ids = [group_id(k.group) for k in keys]
        rows = {(g, m): (n, t) for g, m, n, t in self._select_ready("g, member, nbytes, since", ids)}
        return [rows.get((g, k.member)) for g, k in zip(ids, keys)]

    def ready_bytes(self, groups: Sequence[GroupKey]) -> list[int | None]:
        """Per group: the bytes of its ready objects, None when it has none (one ``SELECT ... IN``
        per 500 groups, no write)."""
        ids = [group_id(g) for g in groups]
        found = {g: int(n) for g, n in self._select_ready("g, SUM(nbytes)", ids, " GROUP BY g")}
        return [found.get(g) for g in ids]

    def _select_ready(self, columns: str, ids: Sequence[bytes], tail: str = "") -> list[Any]:
        """The rows of ``SELECT columns FROM objects WHERE g IN (ids) AND ready=1 tail``: one
        statement per 500 distinct group ids (SQLite bounds the parameters of one), under the
        lock, no write."""
        unique = list(dict.fromkeys(ids))
        out: list[Any] = []
        with self._lock:
            for lo in range(0, len(unique), 500):
                part = unique[lo : lo + 500]
                marks = ",".join("?" * len(part))
                sql = f"SELECT {columns} FROM objects WHERE g IN ({marks}) AND ready=1{tail}"  # noqa: S608
                out.extend(self._db.execute(sql, part))
        return out

    def facts_after(self, seq: int, limit: int) -> list[FactsRow]:
        """The facts rows numbered after `seq`, at most `limit`, in their order (one indexed read, no write)."""
        sql = (
            "SELECT f.seq, gr.tenant, gr.fp, gr.chunk, f.origin, f.identity, f.blob FROM facts f"
            " JOIN groups gr ON gr.g=f.g WHERE f.seq>? ORDER BY f.seq LIMIT ?"
        )
        with self._lock:
            rows = self._db.execute(sql, (seq, limit)).fetchall()
        return [
            FactsRow(s, GroupKey(t, unpack_name(fp), unpack_name(c)), RouterFacts(o, i, bytes(b)))
            for s, t, fp, c, o, i, b in rows
        ]

    def _next_tick(self) -> int:
        """Wall-clock ns, strictly increasing in this process (the LRU order of one batch is its order)."""
        self._tick = max(self._tick + 1, time.time_ns())
        return self._tick

    def touch(self, groups: Iterable[GroupKey]) -> None:
        """Buffer a read of `groups`; written with the next put or after `TOUCH_FLUSH_S`."""
        with self._lock:
            touched = self._touched
            for group in groups:
                if len(touched) >= MAX_TOUCHES:
                    break  # a sample of the reads: the rest keep their older tick this round
                touched[group_id(group)] = self._next_tick()
            due = time.monotonic() - self._last_flush >= TOUCH_FLUSH_S
        if due:
            self.flush_touches()

    def flush_touches(self) -> None:
        with self._lock:
            if self._touched:
                with self._tx(save=True) as db:
                    self._flush_locked(db)
            self._last_flush = time.monotonic()

    def _flush_locked(self, db: sqlite3.Connection) -> None:
        ticks, self._touched = self._touched, {}
        if ticks:
            batch_sql.set_ticks(db, ticks)

    def usage(self) -> tuple[int, int, int]:
        """(used bytes, objects, groups) of the whole folder."""
        with self._lock:
            used = self._db.execute("SELECT COALESCE(SUM(used), 0) FROM tenants").fetchone()[0]
            objects = self._db.execute("SELECT COUNT(*) FROM objects").fetchone()[0]
            groups = self._db.execute("SELECT COUNT(*) FROM groups").fetchone()[0]
        return int(used), int(objects), int(groups)

    def tenant_used(self, tenant: str) -> int:
        with self._lock:
            row = self._db.execute("SELECT used FROM tenants WHERE tenant=?", (tenant,)).fetchone()
        return int(row[0]) if row else 0

    def tenants(self) -> list[str]:
        with self._lock:
            return sorted(r[0] for r in self._db.execute("SELECT tenant FROM tenants WHERE used > 0"))

    # -- writes --------------------------------------------------------------------

    def admit(
        self,
        tenant: str,
        requests: Sequence[tuple[StoreKey, int, int | None]],
        capacity: int,
        quotas: dict[str, int],
    ) -> tuple[list[bool], list[Victim]]:
        """Index `tenant`'s (key, bytes, accepted ns) requests in one transaction, evicting whole
        groups (never one of the batch) so the folder stays within `capacity`; per request, admitted?

        The batch is admitted whole when it fits, else request by request. A request's accepted
        ns (`PutItem.accepted_ns`; None: now) is its group's recency: only groups less recent
        than it may be evicted for it, so a store that reaches the index after newer ones (the
        write-back's threads) is refused rather than evicting them (the order of the stores
        decides, not the order of their arrival)."""
        with self._lock, self._tx(save=True) as db:
            self._flush_locked(db)
            used = dict(db.execute("SELECT tenant, used FROM tenants"))
            batch = {group_id(r[0].group) for r in requests}
            victims: list[Victim] = []
            plan = self._plan(db, tenant, requests, capacity, quotas, used, batch)
            if plan is not None:
                victims += self._apply(db, tenant, requests, plan, used)
                return [True] * len(requests), victims
            admitted: list[bool] = []
            for req in requests:
                plan = self._plan(db, tenant, [req], capacity, quotas, used, {group_id(req[0].group)})
                if plan is None:
                    admitted.append(False)
                    continue
                victims += self._apply(db, tenant, [req], plan, used)
                admitted.append(True)
            # a later request may have evicted an earlier one's group: that one is not admitted
            evicted = {group_id(v.group) for v in victims}
            admitted = [ok and group_id(r[0].group) not in evicted for ok, r in zip(admitted, requests)]
            return admitted, victims

    @staticmethod
    def _objects(requests: Sequence[tuple[StoreKey, int, int | None]]) -> ObjectRows:
        """(group id, member) -> bytes of `requests` (a key stored twice: its last size)."""
        return {(group_id(key.group), key.member): n for key, n, _ in requests}

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
        """(the victims that make room for `requests` (maybe none), the bytes `requests` add), or
        None when they cannot fit. The victims are never of `batch`, so deleting them leaves the
        bytes `requests` add as they are."""
        if any(n > capacity for _, n, _ in requests):
            return None
        stamps = [t for _, _, t in requests if t is not None]
        older: list[tuple[str, object]] = [("tick<?", min(stamps))] if stamps else []  # less recent than the store

        def candidates(owner: str | None) -> Iterator[Candidate]:
            conds = older if owner is None else [("tenant=?", owner), *older]
            texts = [c for c, _ in conds] + ([self.EVICTABLE] if self.EVICTABLE else [])
            where = " WHERE " + " AND ".join(texts) if texts else ""
            sql = f"SELECT g, tenant, nbytes FROM groups{where} ORDER BY tick"  # noqa: S608 - fixed text
            kept = self.kept() if self.kept is not None else ()
            for g, who, size in db.execute(sql, [v for _, v in conds]):
                if g not in kept:
                    yield Candidate(g, who, size)

        delta = batch_sql.bytes_delta(db, self._objects(requests))
        victims = choose_victims(tenant, delta, sum(used.values()), capacity, used, quotas, candidates, batch)
        return None if victims is None else ([cast(bytes, v.group) for v in victims], delta)

    def _apply(
        self,
        db: sqlite3.Connection,
        tenant: str,
        requests: Sequence[tuple[StoreKey, int, int | None]],
        plan: tuple[list[bytes], int],
        used: dict[str, int],
    ) -> list[Victim]:
        """Delete `plan`'s victims, then index `requests` not ready: a constant number of statements
        (`batch_sql`), whatever the batch's size; ticks are taken in the requests' order."""
        victims, delta = plan
        gone = self._delete_groups(db, victims, used)
        groups: GroupRows = {}
        for key, _, accepted in requests:
            tick = self._next_tick() if accepted is None else accepted
            g = group_id(key.group)
            row = groups.get(g)
            if row is None:
                groups[g] = (key.tenant, pack_name(key.fingerprint), pack_name(key.chunk), tick)
            elif tick > row[3]:
                groups[g] = (*row[:3], tick)
        batch_sql.store_rows(db, self._objects(requests), groups, time.time_ns())
        used[tenant] = used.get(tenant, 0) + delta
        db.execute("INSERT OR REPLACE INTO tenants VALUES(?, ?)", (tenant, used[tenant]))
        return gone

    def _delete_groups(
        self, db: sqlite3.Connection, ids: Sequence[bytes], used: dict[str, int] | None = None
    ) -> list[Victim]:
        """Delete the indexed groups of `ids` (`batch_sql.delete_groups`), in `ids`' order; `used` follows."""
        found = batch_sql.delete_groups(db, ids)
        gone: list[Victim] = []
        for g in dict.fromkeys(ids):
            row = found.get(g)
            if row is None:
                continue
            if used is not None:
                used[row.tenant] = used.get(row.tenant, 0) - row.nbytes
            group = GroupKey(row.tenant, unpack_name(row.fp), unpack_name(row.chunk))
            gone.append(Victim(group, row.members, row.nbytes))
        return gone

    def record_facts(self, rows: Sequence[tuple[GroupKey, RouterFacts]]) -> int:
        """Record each group's facts, in one transaction, where the group has a ready object and no
        facts yet (a blob over `MAX_FACTS_BYTES` is skipped); returns the rows inserted."""
        todo = [(group_id(g), f) for g, f in rows if len(f.blob) <= MAX_FACTS_BYTES]
        if not todo:
            return 0
        with self._lock, self._tx(save=True) as db:
            return batch_sql.insert_facts(db, [(g, f.origin, f.identity, f.blob) for g, f in todo])

    def remove_groups(self, groups: Sequence[GroupKey], save: bool = False) -> list[Victim]:
        """Delete the groups' rows; returns those that were indexed. `save`: on a save's path (`_tx`)."""
        if not groups:
            return []
        with self._lock, self._tx(save=save) as db:
            return self._delete_groups(db, [group_id(g) for g in groups])

    # -- operators (`kvpack.tiers.disk.census`) -------------------------------------------

    def usage_rows(self) -> list[census.UsageRow]:
        """Objects and bytes per (tenant, group fingerprint): one grouped read, no write."""
        with self._lock:
            return census.usage_rows(self._db)

    def clear_matching(
        self,
        tenants: frozenset[str] | None,
        fingerprints: frozenset[str] | None,
        drop: Callable[[list[Victim]], int] | None,
        batch: int = 2_000,
    ) -> tuple[int, int]:
        """(objects, bytes) of the groups of `tenants` and `fingerprints` (None: any) that eviction
        could take; with `drop`, deleted `batch` groups per transaction (others' writes wait at most
        one batch), each batch handed to `drop` once committed (it removes their files and answers
        how many objects went); without, only counted (no write)."""
        if drop is None:
            with self._lock:
                return census.count_groups(self._db, tenants, fingerprints, self.EVICTABLE)
        objects = nbytes = 0
        while True:
            with self._lock, self._tx() as db:
                ids = census.select_groups(db, tenants, fingerprints, self.EVICTABLE, batch)
                gone = self._delete_groups(db, ids) if ids else []
            if not ids:
                return objects, nbytes
            objects, nbytes = objects + drop(gone), nbytes + sum(v.nbytes for v in gone)

    def name_fingerprint(self, fingerprint: str, label: str) -> None:
        """Name `fingerprint` in the index (``kvpack usage``); the first name recorded stays. Never
        raises: a name is for operators, it never fails a store."""
        with contextlib.suppress(sqlite3.Error, OSError, TimeoutError), self._lock, self._tx(begin=False) as db:
            census.name_fingerprint(db, fingerprint, label)

    def mark_kept(self) -> None:
        """Note in the index that a user asked for this store to outlive its processes
        (``memory.mode: host``): `kvpack.tiers.host.stores.give_back` then leaves it."""
        with self._lock, self._tx(begin=False) as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES('kept', '1')")

    def fingerprint_names(self) -> dict[str, str]:
        with self._lock:
            return census.fingerprint_names(self._db)

    def mark_ready(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Mark the rows of `keys` ready (their files are written), atomically (one statement, or a
        transaction around several); per key, was it still indexed (False: evicted or removed while
        it was written)?"""
        if not keys:
            return []
        rows = [(group_id(k.group), k.member) for k in keys]
        # one UPDATE (any batch under ~16k objects) commits by itself; a SELECT after it, if any, only reads
        with self._lock, self._tx(not batch_sql.mark_ready_changes_one_statement(rows), save=True) as db:
            return batch_sql.mark_ready(db, rows, time.time_ns())

    def forget(self, keys: Sequence[StoreKey], stale_before_ns: int) -> None:
        """Delete single objects' rows (their file is gone or damaged); the group's and tenant's bytes follow.

        A ready row goes at once (its file was written, so a miss means it is gone); a row
        not ready only when admitted before `stale_before_ns` (a crashed writer's): a younger
        one is a write in progress, maybe in another process, whose file is still to come."""
        with self._lock, self._tx() as db:
            for key in keys:
                g = group_id(key.group)
                row = db.execute(
                    "SELECT nbytes FROM objects WHERE g=? AND member=? AND (ready=1 OR since<?)",
                    (g, key.member, stale_before_ns),
                ).fetchone()
                if row is None:
                    continue
                db.execute("DELETE FROM objects WHERE g=? AND member=?", (g, key.member))
                db.execute("UPDATE groups SET nbytes=nbytes-? WHERE g=?", (row[0], g))
                db.execute("DELETE FROM groups WHERE g=? AND NOT EXISTS (SELECT 1 FROM objects WHERE g=?)", (g, g))
                db.execute("DELETE FROM facts WHERE g=? AND NOT EXISTS (SELECT 1 FROM groups WHERE g=?)", (g, g))
                db.execute("UPDATE tenants SET used=used-? WHERE tenant=?", (row[0], key.tenant))
                db.execute("DELETE FROM tenants WHERE tenant=? AND used<=0", (key.tenant,))

    def reopen_lock(self) -> None:
        """In a forked child: a lock fd of its own at the same number (`index_files._Forked`). Where the
        lock file cannot be opened the number holds ``/dev/null``: it shares nothing with the parent's
        lock, and SQLite's own lock still orders the child's writes."""
        try:
            if self._private_fd is not None:
                fd = private.open_file(self._private_fd, INDEX_FILES[3], os.O_RDWR, INDEX_FILES[3], create=False)
            else:
                fd = os.open(self._path + ".lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.dup2(fd, self._lock_fd, inheritable=False)
        except OSError:
            pass
        finally:
            os.close(fd)

    def close(self) -> None:
        try:
            self.flush_touches()
        except sqlite3.Error:
            pass
        index_files.FORKED.discard(self)
        with self._lock:
            self._db.close()
            os.close(self._lock_fd)
            for fd in self._held_fds:  # only now: see `__init__`
                os.close(fd)
            self._held_fds = []


def present_index_files(root: str, lstat: Callable[[str], os.stat_result], field: str) -> list[str]:
    """The index's files (`INDEX_FILES`) present in the store folder `root`, by name.

    `lstat(name)` stats a name in `root` without following a link. Every one present is a
    regular file: a link or anything else raises ConfigError naming `field` (never opened).
    """
    present: list[str] = []
    for name in INDEX_FILES:
        try:
            st = lstat(name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ConfigError(field, f"{root}/{name}: {exc}") from None
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(field, f"{root}/{name} is not a regular file (kvpack's index is refused)")
        present.append(name)
    return present


def open_catalog(
    root: str,
    root_fd: int,
    busy_timeout_s: float,
    field: str = "disk.path",
    kind: Callable[[str, float], Catalog] | None = None,
    private_root: bool = False,
) -> Catalog:
    """The folder's shared index (made by `kind` from its path and busy timeout; default: a `Catalog`,
    its files checked through their descriptors when `private_root`: `kvpack.tiers.disk.private`);
    ConfigError naming `field` when its files are not regular files (a planted symlink is never
    opened), not this user's alone in a private folder, or it is not a readable index."""
    too_old = batch_sql.sqlite_too_old()
    if too_old is not None:
        raise ConfigError(field, too_old)
    present_index_files(root, lambda name: os.stat(name, dir_fd=root_fd, follow_symlinks=False), field)
    if kind is None:

        def kind(path: str, timeout_s: float) -> Catalog:
            return Catalog(path, timeout_s, private_fd=root_fd if private_root else None)

    try:
        return kind(f"{root}/{INDEX_NAME}", busy_timeout_s)
    except private.NotPrivate as exc:
        raise ConfigError(field, f"{exc.problem}; {private.REFUSED}") from None
    except (OSError, sqlite3.Error) as exc:
        raise ConfigError(
            field,
            f"{root}/{INDEX_NAME} is not a readable kvpack index ({exc}); delete it (and its -wal, -shm) "
            "to have it rebuilt from the object files",
        ) from None
