"""Pinned prefixes: a tenant's named groups that no tier evicts, within a pinned budget per tenant.

What is pinned is a group (tenant, group fingerprint, chunk); a prefix is the chain of its
chunks, so pinning a prompt pins the groups of its whole chunks that the store holds. The pin
list lives in one small SQLite file in the disk store's folder (``.kvpack-store.pins``),
shared by every process on that folder and kept across restarts; it is not part of the disk
index (which is rebuilt from the object files when its schema changes), so a rebuild keeps it.

The rule, stated once (every tier's eviction asks `PinBook.kept`):

- a pin holds the group's bytes as the store held them when it was pinned;
- `pin` pins a tenant's groups in the order given (a prefix's chunks, first chunk first) while
  the tenant's pinned bytes stay within ``budget`` (`eviction.pinned_bytes_per_tenant`); the
  first group past the budget and every one after it are refused: one log line (tenant, bytes
  asked, budget; once per tenant and process), every refusal counted (`refused`);
- a pinned group is never chosen as a victim (memory tier, host store, disk folder) while its
  tenant's pinned bytes are within the budget; a tenant over it (the budget was lowered since)
  has no group kept until `unpin` brings it back under;
- `unpin` removes a tenant's pins: its groups are evictable again at once.

A process sees another process's pins at its next eviction (`kept` reads the file's generation,
one indexed row, and reloads the list only when it changed). Not a security boundary beyond the
tenant's: who may pin is the adapters' trust rule (`pin_trusted`).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ..config.schema import KVPackConfig
from ..errors import ConfigError
from ..identity.keys import GroupKey
from ..policy.tenancy import tenant_trusted
from ..tiers.index.rows import group_id

log = logging.getLogger("kvpack.store.pins")

PINS_NAME = ".kvpack-store.pins"
"""The pin list's file in the disk store's folder (a name the folder scan leaves alone)."""
PIN_PARAM = "kvpack_pin"
"""Key of a request's parameters (vLLM ``kv_transfer_params``) asking to pin its prompt."""

MAX_LOGGED = 1024
"""Tenants whose pin refusal a process logs (each once); later ones are only counted."""

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS pins(g BLOB PRIMARY KEY, tenant TEXT NOT NULL, fp TEXT NOT NULL,"
    " chunk TEXT NOT NULL, nbytes INTEGER NOT NULL, since INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS pins_tenant ON pins(tenant)",
    "CREATE TABLE IF NOT EXISTS gen(k INTEGER PRIMARY KEY, v INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO gen VALUES(0, 0)",
)


@dataclass(frozen=True)
class Pin:
    """One pinned group and the bytes it holds of its tenant's budget."""

    group: GroupKey
    nbytes: int
    since_ns: int


@dataclass(frozen=True)
class PinOutcome:
    """What one `pin` did: groups newly pinned, already pinned, refused (past the budget), bytes refused."""

    pinned: int = 0
    already: int = 0
    refused: int = 0
    refused_bytes: int = 0


def pin_trusted(config: KVPackConfig, params: object) -> bool | None:
    """Does a request's parameters ask to pin its prompt, and may it? None: it does not ask; True:
    it asks with a tenant the config trusts (`kvpack.policy.tenancy.tenant_trusted`: the same front end that
    may name the tenant may pin); False: it asks untrusted (the caller ignores it and counts it)."""
    if not isinstance(params, dict) or params.get(PIN_PARAM) is not True:
        return None
    named = params.get("kvpack_tenant")
    return named is not None and tenant_trusted(config, named, params.get("kvpack_tenant_sig"))


class PinBook:
    """One process's handle on a store folder's pin list (see the module docstring). Thread-safe."""

    def __init__(self, folder: str, budget: int, busy_timeout_s: float = 10.0) -> None:
        """Open (or create) the pin list in the store folder `folder`; ConfigError naming
        ``eviction.pinned_bytes_per_tenant`` when its file is not a regular file of this user."""
        self.budget = budget
        self.refused = 0
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        """Tenants whose refusal was logged (once each per process; at most `MAX_LOGGED`)."""
        path = os.path.join(folder, PINS_NAME)
        _check_file(path)
        try:
            db = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
            _set_up(db, busy_timeout_s)
        except sqlite3.Error as exc:
            raise ConfigError(
                "eviction.pinned_bytes_per_tenant", f"{path} is not a readable kvpack pin list ({exc})"
            ) from None
        self._db = db
        self._gen = -1
        self._kept_ids: frozenset[bytes] = frozenset()
        self._kept_names: frozenset[str] = frozenset()

    # -- the rule --------------------------------------------------------------------

    def pin(self, tenant: str, groups: Sequence[tuple[GroupKey, int]]) -> PinOutcome:
        """Pin `tenant`'s `groups` ((group, bytes) in prefix order) within the budget (module docstring)."""
        if not groups:
            return PinOutcome()
        kept = self.kept_names()
        if all(f"{g.tenant}/{g.fingerprint}/{g.chunk}" in kept for g, _ in groups):
            return PinOutcome(already=len(groups))  # the common case (every request of a pinned prompt): no write
        pinned = already = refused = refused_bytes = 0
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                used = int(
                    db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM pins WHERE tenant=?", (tenant,)).fetchone()[0]
                )
                now = time.time_ns()
                for group, nbytes in groups:
                    g = group_id(group)
                    if refused or db.execute("SELECT 1 FROM pins WHERE g=?", (g,)).fetchone() is None:
                        if refused or used + nbytes > self.budget:
                            refused += 1
                            refused_bytes += nbytes
                            continue
                        db.execute(
                            "INSERT INTO pins VALUES(?, ?, ?, ?, ?, ?)",
                            (g, tenant, group.fingerprint, group.chunk, nbytes, now),
                        )
                        used += nbytes
                        pinned += 1
                    else:
                        already += 1
                if pinned:
                    db.execute("UPDATE gen SET v=v+1 WHERE k=0")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            if refused:
                self.refused += refused
        if refused and tenant not in self._logged and len(self._logged) < MAX_LOGGED:
            self._logged.add(tenant)
            log.warning(
                "kvpack: pin refused for tenant %s: %d more bytes asked (%d groups) past its pinned budget of "
                "%d bytes (eviction.pinned_bytes_per_tenant; %d bytes pinned already; later refusals of this tenant "
                "are only counted: kvpack_pins_refused)",
                tenant,
                refused_bytes,
                refused,
                self.budget,
                used,
            )
        return PinOutcome(pinned, already, refused, refused_bytes)

    def unpin(self, tenant: str | None, fingerprints: Collection[str] | None = None) -> int:
        """Remove the pins of `tenant` (None: every tenant's) of `fingerprints` (None: every one);
        returns how many there were."""
        conds: list[str] = []
        args: list[str] = []
        if tenant is not None:
            conds.append("tenant=?")
            args.append(tenant)
        if fingerprints is not None:
            fps = list(fingerprints)
            conds.append(f"fp IN ({','.join('?' * len(fps))})")
            args += fps
        where = " WHERE " + " AND ".join(conds) if conds else ""
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                n = db.execute(f"DELETE FROM pins{where}", args).rowcount  # noqa: S608 - fixed text
                db.execute("UPDATE gen SET v=v+1 WHERE k=0")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return int(n)

    def kept(self) -> frozenset[bytes]:
        """Ids (`kvpack.tiers.index.rows.group_id`) of the groups no tier may evict now."""
        self._refresh()
        return self._kept_ids

    def kept_names(self) -> frozenset[str]:
        """The same groups as ``tenant/fingerprint/chunk`` (the memory tier's group ids)."""
        self._refresh()
        return self._kept_names

    def _refresh(self) -> None:
        with self._lock:
            gen = int(self._db.execute("SELECT v FROM gen WHERE k=0").fetchone()[0])
            if gen == self._gen:
                return
            over = {
                t
                for t, n in self._db.execute("SELECT tenant, SUM(nbytes) FROM pins GROUP BY tenant")
                if n > self.budget
            }
            rows = [r for r in self._db.execute("SELECT g, tenant, fp, chunk FROM pins") if r[1] not in over]
            self._kept_ids = frozenset(bytes(r[0]) for r in rows)
            self._kept_names = frozenset(f"{t}/{fp}/{c}" for _, t, fp, c in rows)
            self._gen = gen

    # -- listing ---------------------------------------------------------------------

    def pins(self, tenant: str | None = None) -> list[Pin]:
        """Every pin (of `tenant` only, when given), oldest first."""
        where, args = (" WHERE tenant=?", (tenant,)) if tenant is not None else ("", ())
        sql = f"SELECT tenant, fp, chunk, nbytes, since FROM pins{where} ORDER BY since, tenant"  # noqa: S608
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [Pin(GroupKey(t, fp, c), int(n), int(s)) for t, fp, c, n, s in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _set_up(db: sqlite3.Connection, busy_timeout_s: float) -> None:
    """WAL mode (an eviction's read of the list never waits for a writer) and the schema. Several
    processes may open a new list at once: SQLite answers some of those lock waits at once, so
    they are retried until `busy_timeout_s`."""
    deadline = time.monotonic() + busy_timeout_s
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            for stmt in _SCHEMA:
                db.execute(stmt)
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _check_file(path: str) -> None:
    """Refuse a pin list that is a link, not a regular file, or another user's (never opened then)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.close(fd)
        return
    except OSError as exc:
        raise ConfigError("eviction.pinned_bytes_per_tenant", f"{path}: {exc}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise ConfigError(
            "eviction.pinned_bytes_per_tenant",
            f"{path} is not a regular file of this user (kvpack's pin list is refused)",
        )


def pinned_per_tenant(folder: str) -> dict[str, tuple[int, int]]:
    """(groups, bytes) pinned per tenant in the store folder `folder`, read-only ({} without a pin
    list; a pin list that is not a regular file is never opened: ValueError)."""
    path = os.path.join(folder, PINS_NAME)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return {}
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)
    try:
        rows = db.execute("SELECT tenant, COUNT(*), SUM(nbytes) FROM pins GROUP BY tenant ORDER BY tenant").fetchall()
    finally:
        db.close()
    return {t: (int(n), int(b)) for t, n, b in rows}


def drop_pins(folder: str, tenants: Collection[str] | None, fingerprints: Collection[str] | None) -> int:
    """Remove the pins of `tenants` (None: all) of `fingerprints` (None: all) from the folder's pin
    list, if it has one (what a clear of those objects leaves no trace of); returns how many."""
    if not os.path.lexists(os.path.join(folder, PINS_NAME)):
        return 0
    book = PinBook(folder, 0)
    try:
        if tenants is None:
            return book.unpin(None, fingerprints)
        return sum(book.unpin(t, fingerprints) for t in tenants)
    finally:
        book.close()
