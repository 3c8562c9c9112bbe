"""The disk index's multi-row statements: a batch's rows in a number of statements that does not
grow with the batch (one per `MAX_VARIABLES` bound parameters), never one statement per row.

Why: every sqlite3 step gives the GIL up and takes it back; inside a process with a busy Python
thread (SGLang's scheduler) each re-take can wait up to the interpreter's switch interval (5 ms),
so a put that ran ~4 statements per page waited on the GIL ~4 times per page. Each function runs
inside the caller's write transaction (`Catalog._tx`) and keeps every invariant of
`kvpack.tiers.index.catalog`'s docstring; rows are bound as parameters, never formatted into SQL.

Row shapes: ``objects`` maps (group id, member) to the object's bytes, one entry per object (a key
stored twice in a batch counts once, with its last size); ``groups`` maps a group id to
(tenant, packed fingerprint, packed chunk, tick), the tick being the largest of its requests'.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

MAX_VARIABLES = 32766
"""Bound parameters per statement at most: SQLite's default ``SQLITE_MAX_VARIABLE_NUMBER`` since 3.32."""
MIN_SQLITE = (3, 35, 0)
"""The oldest SQLite these statements run on: ``DELETE ... RETURNING`` (3.35), ``UPDATE ... FROM``
(3.33), `MAX_VARIABLES` parameters (3.32)."""


def sqlite_too_old(version: tuple[int, int, int] | None = None) -> str | None:
    """Why this Python's SQLite (or `version`) cannot hold a kvpack index, or None when it can."""
    have = version or sqlite3.sqlite_version_info
    if tuple(have) >= MIN_SQLITE:
        return None
    return (
        f"needs SQLite >= {'.'.join(map(str, MIN_SQLITE))} for its index; this Python's sqlite3 module is "
        f"SQLite {'.'.join(map(str, have))} (use a Python built against a newer SQLite, or disk.enabled: false)"
    )


ObjectRows = dict[tuple[bytes, str], int]
GroupRows = dict[bytes, tuple[str, "str | bytes", "str | bytes", int]]


@dataclass(frozen=True, slots=True)
class DeletedGroup:
    """A group row deleted with its objects and facts (members in the index's order: by name)."""

    tenant: str
    fp: str | bytes
    chunk: str | bytes
    nbytes: int
    members: tuple[str, ...]


def chunks(rows: Sequence[T], width: int, extra: int = 0) -> Iterator[Sequence[T]]:
    """`rows` in slices of at most `(MAX_VARIABLES - extra) // width` rows (`width`: parameters per
    row, `extra`: the statement's parameters besides the rows')."""
    step = max(1, (MAX_VARIABLES - extra) // width)
    for lo in range(0, len(rows), step):
        yield rows[lo : lo + step]


def values(rows: int, width: int, one: str = "") -> str:
    """``(?,?),(?,?)``: `rows` rows of `width` parameters (or `rows` copies of `one`), for a ``VALUES`` list."""
    return ",".join([one or "(" + ",".join("?" * width) + ")"] * rows)


def marks(n: int) -> str:
    """``?,?,?``: `n` parameters, for an ``IN`` list."""
    return ",".join("?" * n)


def flat(rows: Sequence[Sequence[Any]]) -> list[Any]:
    """The rows' values in one list, row after row (the parameters of a ``VALUES`` list)."""
    return [v for row in rows for v in row]


def _changes(db: sqlite3.Connection, sql: str, params: Sequence[Any]) -> int:
    """Run `sql`; the rows it changed (``total_changes``: a statement that starts with ``WITH``
    has no ``rowcount`` in Python's sqlite3)."""
    before = db.total_changes
    db.execute(sql, params)
    return db.total_changes - before


def bytes_delta(db: sqlite3.Connection, objects: ObjectRows) -> int:
    """Bytes the folder's usage grows by when `objects` are stored (new sizes less those indexed now)."""
    rows = [(g, m, n) for (g, m), n in objects.items()]
    delta = 0
    for part in chunks(rows, 3):
        sql = (
            f"WITH req(g, m, n) AS (VALUES {values(len(part), 3)})"  # noqa: S608 - placeholders only
            " SELECT COALESCE(SUM(req.n - COALESCE(o.nbytes, 0)), 0) FROM req"
            " LEFT JOIN objects o ON o.g=req.g AND o.member=req.m"
        )
        delta += int(db.execute(sql, flat(part)).fetchone()[0])
    return delta


Rows = list[tuple[Any, ...]]


def _group_parts(objects: ObjectRows, groups: GroupRows) -> Iterator[tuple[Rows, Rows]]:
    """(group rows, object rows) slices, each group with all its objects, under `MAX_VARIABLES`."""
    members: dict[bytes, Rows] = {}
    for (g, m), n in objects.items():
        members.setdefault(g, []).append((g, m, n))
    grp: Rows = []
    obj: Rows = []
    for g, (tenant, fp, chunk, tick) in groups.items():
        mine = members.get(g, [])
        if grp and 5 * (len(grp) + 1) + 3 * (len(obj) + len(mine)) > MAX_VARIABLES:
            yield grp, obj
            grp, obj = [], []
        grp.append((g, tenant, fp, chunk, tick))
        obj += mine
    if grp:
        yield grp, obj


def store_rows(db: sqlite3.Connection, objects: ObjectRows, groups: GroupRows, now_ns: int) -> None:
    """Index `objects` not ready (``since`` = `now_ns`) and grow their groups' rows by the bytes they
    add (a new group row takes its requests' tick; an indexed one the larger of its tick and theirs).

    The groups' statement reads the objects' present sizes, so it runs before the objects'."""
    for grp, obj in _group_parts(objects, groups):
        sql = (
            f"WITH req(g, m, n) AS (VALUES {values(len(obj), 3)}),"  # noqa: S608 - placeholders only
            " d(g, delta) AS (SELECT req.g, SUM(req.n - COALESCE(o.nbytes, 0)) FROM req"
            " LEFT JOIN objects o ON o.g=req.g AND o.member=req.m GROUP BY req.g),"
            f" grp(g, tenant, fp, chunk, tick) AS (VALUES {values(len(grp), 5)})"
            " INSERT INTO groups(g, tenant, fp, chunk, nbytes, tick)"
            " SELECT grp.g, grp.tenant, grp.fp, grp.chunk, COALESCE(d.delta, 0), grp.tick"
            " FROM grp LEFT JOIN d ON d.g=grp.g WHERE true"
            " ON CONFLICT(g) DO UPDATE SET nbytes=nbytes+excluded.nbytes, tick=MAX(tick, excluded.tick)"
        )
        db.execute(sql, flat(obj) + flat(grp))
    rows = [(g, m, n, now_ns) for (g, m), n in objects.items()]
    for part in chunks(rows, 4):
        rows_sql = values(len(part), 4, "(?,?,?,0,?)")
        sql = f"INSERT OR REPLACE INTO objects(g, member, nbytes, ready, since) VALUES {rows_sql}"  # noqa: S608
        db.execute(sql, flat(part))


def delete_groups(db: sqlite3.Connection, ids: Sequence[bytes]) -> dict[bytes, DeletedGroup]:
    """Delete the groups `ids` that are indexed, their objects and facts, and take their bytes off
    their tenants (a tenant left with none is deleted); returns them by id."""
    unique = list(dict.fromkeys(ids))
    found: dict[bytes, DeletedGroup] = {}
    members: dict[bytes, list[str]] = {}
    for part in chunks(unique, 2):  # the objects' statement binds each id twice
        ids_in = marks(len(part))
        objects = db.execute(
            f"DELETE FROM objects WHERE g IN ({ids_in}) AND g IN (SELECT g FROM groups WHERE g IN ({ids_in}))"  # noqa: S608
            " RETURNING g, member",
            [*part, *part],
        ).fetchall()
        for g, member in objects:
            members.setdefault(g, []).append(member)
        sql = f"DELETE FROM groups WHERE g IN ({ids_in}) RETURNING g, tenant, fp, chunk, nbytes"  # noqa: S608
        rows = db.execute(sql, list(part)).fetchall()
        for g, tenant, fp, chunk, nbytes in rows:
            found[g] = DeletedGroup(tenant, fp, chunk, int(nbytes), tuple(sorted(members.get(g, []))))
        db.execute(f"DELETE FROM facts WHERE g IN ({ids_in})", list(part))  # noqa: S608
    per_tenant: dict[str, int] = {}
    for row in found.values():
        per_tenant[row.tenant] = per_tenant.get(row.tenant, 0) + row.nbytes
    for part2 in chunks(list(per_tenant.items()), 2):
        db.execute(
            f"WITH d(t, n) AS (VALUES {values(len(part2), 2)})"  # noqa: S608 - placeholders only
            " UPDATE tenants SET used=used-d.n FROM d WHERE tenants.tenant=d.t",
            flat(part2),
        )
        db.execute(
            f"DELETE FROM tenants WHERE used<=0 AND tenant IN ({marks(len(part2))})",  # noqa: S608
            [t for t, _ in part2],
        )
    return found


def mark_ready_changes_one_statement(keys: Sequence[tuple[bytes, str]]) -> bool:
    """Does `mark_ready` of `keys` change the index in one statement (then it needs no transaction
    of its own: a single statement is atomic)?"""
    return len(set(keys)) <= max(1, (MAX_VARIABLES - 1) // 2)


def mark_ready(db: sqlite3.Connection, keys: Sequence[tuple[bytes, str]], now_ns: int) -> list[bool]:
    """Mark the objects `keys` ready (``since`` = `now_ns`); per key, is it indexed? One ``UPDATE``
    per slice; only when some key is no longer indexed, one ``SELECT`` per slice says which."""
    unique = list(dict.fromkeys(keys))
    updated = 0
    for part in chunks(unique, 2, extra=1):  # + since
        sql = (
            f"WITH k(g, m) AS (VALUES {values(len(part), 2)})"  # noqa: S608 - placeholders only
            " UPDATE objects SET ready=1, since=? WHERE (g, member) IN (SELECT g, m FROM k)"
        )
        updated += _changes(db, sql, [*flat(part), now_ns])
    if updated == len(unique):
        return [True] * len(keys)
    present: set[tuple[bytes, str]] = set()
    for part in chunks(unique, 2):
        sql = (
            f"WITH k(g, m) AS (VALUES {values(len(part), 2)})"  # noqa: S608 - placeholders only
            " SELECT g, member FROM objects WHERE (g, member) IN (SELECT g, m FROM k)"
        )
        present.update((g, m) for g, m in db.execute(sql, flat(part)))
    return [k in present for k in keys]


def set_ticks(db: sqlite3.Connection, ticks: dict[bytes, int]) -> None:
    """Set each indexed group's tick (`ticks`: group id -> tick)."""
    rows = list(ticks.items())
    for part in chunks(rows, 2):
        db.execute(
            f"WITH t(g, tick) AS (VALUES {values(len(part), 2)})"  # noqa: S608 - placeholders only
            " UPDATE groups SET tick=t.tick FROM t WHERE groups.g=t.g",
            flat(part),
        )


def insert_facts(db: sqlite3.Connection, rows: Sequence[tuple[bytes, str, str, bytes]]) -> int:
    """Insert (group id, origin, identity, blob) facts rows, in their order, where the group has a
    ready object and no facts yet (the first row of a group wins); returns the rows inserted."""
    inserted = 0
    numbered = [(i, *row) for i, row in enumerate(rows)]
    for part in chunks(numbered, 5):
        sql = (
            f"WITH f(i, g, origin, identity, blob) AS (VALUES {values(len(part), 5)})"  # noqa: S608
            " INSERT OR IGNORE INTO facts(g, origin, identity, blob) SELECT g, origin, identity, blob FROM f"
            " WHERE EXISTS (SELECT 1 FROM objects o WHERE o.g=f.g AND o.ready=1) ORDER BY i"
        )
        inserted += _changes(db, sql, flat(part))
    return inserted
