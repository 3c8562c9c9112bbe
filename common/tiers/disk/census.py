"""The index's answers for operators: what it holds per tenant and model, which groups a clear
selects, and the names of the group fingerprints (`kvpack.policy.clearing`, ``kvpack usage``).

Every function reads or writes the shared SQLite index only (never a file of the store), in the
caller's transaction or lock (`kvpack.tiers.disk.catalog.Catalog`):

- `usage_rows`: objects and bytes per (tenant, fingerprint): one grouped scan of ``objects``
  joined to ``groups`` (rows being written count: they hold their bytes);
- `select_groups`: the ids of the groups of some tenants and fingerprints, through the
  ``groups(tenant, fp)`` index (`OWNER_INDEX`), a bounded batch at a time;
- ``models(fp, label, since)``: one row per group fingerprint a process stored under, naming
  it (`KVLayoutSpec.label`: model identity and layout), written once per fingerprint per
  process (`name_fingerprint`); the digest alone names nothing an operator recognizes.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .batch_sql import marks
from .rows import pack_name, unpack_name

OWNER_INDEX = "CREATE INDEX IF NOT EXISTS groups_owner ON groups(tenant, fp)"
"""Makes a clear of one tenant (and model) an index range, not a scan of every group."""
MODELS_TABLE = (
    "CREATE TABLE IF NOT EXISTS models(fp TEXT PRIMARY KEY, label TEXT NOT NULL, since INTEGER NOT NULL) WITHOUT ROWID"
)
MAX_LABEL = 200
"""Characters of a fingerprint's label kept (it comes from an engine's model name)."""


@dataclass(frozen=True, slots=True)
class UsageRow:
    """What the index holds for one tenant under one group fingerprint."""

    tenant: str
    fingerprint: str
    objects: int
    nbytes: int


def usage_rows(db: sqlite3.Connection) -> list[UsageRow]:
    """Objects and bytes per (tenant, fingerprint), by tenant then fingerprint."""
    sql = (
        "SELECT gr.tenant, gr.fp, COUNT(*), SUM(o.nbytes) FROM objects o JOIN groups gr ON gr.g = o.g"
        " GROUP BY gr.tenant, gr.fp ORDER BY gr.tenant, gr.fp"
    )
    return [UsageRow(t, unpack_name(fp), int(n), int(b or 0)) for t, fp, n, b in db.execute(sql)]


def _where(tenants: frozenset[str] | None, fingerprints: frozenset[str] | None, extra: str) -> tuple[str, list[object]]:
    conds: list[str] = []
    params: list[object] = []
    if tenants is not None:
        conds.append(f"tenant IN ({marks(len(tenants))})")
        params += sorted(tenants)
    if fingerprints is not None:
        conds.append(f"fp IN ({marks(len(fingerprints))})")
        params += [pack_name(f) for f in sorted(fingerprints)]
    if extra:
        conds.append(extra)
    return (" WHERE " + " AND ".join(conds)) if conds else "", params


def select_groups(
    db: sqlite3.Connection,
    tenants: frozenset[str] | None,
    fingerprints: frozenset[str] | None,
    extra: str = "",
    limit: int = 10_000,
) -> list[bytes]:
    """Up to `limit` ids of groups of `tenants` and `fingerprints` (None: any) that also meet
    `extra` (a fixed SQL condition on ``groups``, e.g. none of its objects being written)."""
    where, params = _where(tenants, fingerprints, extra)
    return [r[0] for r in db.execute(f"SELECT g FROM groups{where} LIMIT ?", [*params, limit])]  # noqa: S608


def count_groups(
    db: sqlite3.Connection, tenants: frozenset[str] | None, fingerprints: frozenset[str] | None, extra: str = ""
) -> tuple[int, int]:
    """(objects, bytes) of the groups `select_groups` would select, all of them (a dry run)."""
    where, params = _where(tenants, fingerprints, extra)
    sql = f"SELECT COUNT(o.g), COALESCE(SUM(o.nbytes), 0) FROM objects o WHERE o.g IN (SELECT g FROM groups{where})"  # noqa: S608
    n, b = db.execute(sql, params).fetchone()
    return int(n), int(b)


def name_fingerprint(db: sqlite3.Connection, fingerprint: str, label: str) -> None:
    """Record `label` for `fingerprint` (the first label given stays)."""
    db.execute("INSERT OR IGNORE INTO models VALUES(?, ?, ?)", (fingerprint, label[:MAX_LABEL], time.time_ns()))


def fingerprint_names(db: sqlite3.Connection, fingerprints: Sequence[str] | None = None) -> dict[str, str]:
    """fingerprint -> label of those recorded (of `fingerprints`, or every one)."""
    if fingerprints is None:
        return dict(db.execute("SELECT fp, label FROM models"))
    out: dict[str, str] = {}
    for lo in range(0, len(fingerprints), 500):
        part = list(fingerprints[lo : lo + 500])
        out.update(db.execute(f"SELECT fp, label FROM models WHERE fp IN ({marks(len(part))})", part))  # noqa: S608
    return out
