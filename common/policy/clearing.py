"""What a reset or a clear removes from a store that others share: the one rule, in the core.

A store's tiers may hold the objects of other engines, models and tenants (a disk folder, the
host store, a Mooncake cluster are shared by every instance that names them). Every verb that
removes objects in bulk goes through this module: vLLM's ``reset_cache`` (its
``reset_prefix_cache(reset_connector=True)`` and the server's ``/reset_prefix_cache?reset_external=true``),
SGLang's storage ``clear`` (``/hicache/storage-backend/clear``) and ``kvpack clear``.

The rule (`ClearScope`):

- an engine's reset (`engine_scope`) removes the objects of the engine's *current* group
  fingerprint(s) (model identity + layout: another model's objects in the same folder are never
  touched), of every tenant, in every tier the instance reaches; the config's ``reset`` section
  (`ResetConfig`) narrows it to some tiers, widens it to every object of the reachable tiers
  (``scope: all``) or turns it off (``scope: off``: vLLM's ``reset_cache`` answers False);
- ``kvpack clear`` removes one tenant's objects (optionally of one model) from the tiers it is
  given.

Each tier enumerates what matches from its own index (`kvpack.tiers.base.Tier.clear`): the memory
tier its in-process map, the host store and the disk folder one indexed SQL statement per batch
of their shared index (no file is scanned), Mooncake one ``remove_by_regex`` over the key prefix
``kvpack/<tenant>/<fingerprint>/`` (it cannot count or size objects without removing them, so a
dry run there reports nothing, and its bytes are unknown). The result is a `ClearReport`: objects
and bytes removed per tier and the tiers that failed.

Running engines stay correct: an object removed between a lookup and its load is a miss (the
disk's row is gone or its file unlinked, the host store's pages change their stamps, the memory
tier's entry is gone, Mooncake answers not found), which the engine recomputes; never an error,
never a wrong load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..config.reset import ResetConfig, ResetScope


class ClearUnsupported(Exception):
    """A tier cannot enumerate the objects a scope names (reported as failed, never raised on)."""


@dataclass(frozen=True)
class ClearScope:
    """Which objects a clear removes: those of `tenants` (None: every tenant) and `fingerprints`
    (group fingerprints; None: every one) in `tiers` (tier names; None: every tier reached).
    Picklable: vLLM hands it from the scheduler to its workers in the connector metadata."""

    tenants: frozenset[str] | None = None
    fingerprints: frozenset[str] | None = None
    tiers: frozenset[str] | None = None

    def __post_init__(self) -> None:
        for name in ("tenants", "fingerprints", "tiers"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, frozenset):
                object.__setattr__(self, name, frozenset(value))

    def covers_tier(self, name: str) -> bool:
        return self.tiers is None or name in self.tiers

    def matches(self, tenant: str, fingerprint: str) -> bool:
        """Does an object of `tenant` under group fingerprint `fingerprint` fall in this scope?"""
        return (self.tenants is None or tenant in self.tenants) and (
            self.fingerprints is None or fingerprint in self.fingerprints
        )

    def key_regex(self) -> str:
        """A regular expression (ECMAScript and Python alike) matching exactly the flat keys
        (`StoreKey.as_str`: ``kvpack/<tenant>/<fingerprint>/<chunk>/<member>``) in this scope.
        Tenant and fingerprint characters are validated names (no ``/``), escaped anyway."""

        def part(values: frozenset[str] | None) -> str:
            if values is None:
                return "[^/]+"
            return "(" + "|".join(re.escape(v) for v in sorted(values)) + ")"

        return f"^kvpack/{part(self.tenants)}/{part(self.fingerprints)}/"

    def describe(self) -> str:
        """One line: ``tenants=a,b fingerprints=all tiers=disk,host``."""

        def shown(values: frozenset[str] | None) -> str:
            return "all" if values is None else ",".join(sorted(values)) or "none"

        return f"tenants={shown(self.tenants)} fingerprints={shown(self.fingerprints)} tiers={shown(self.tiers)}"


def engine_scope(reset: ResetConfig, fingerprints: Iterable[str]) -> ClearScope | None:
    """The scope of an engine's reset (see the module docstring): None when ``reset.scope`` is
    off; `fingerprints` are the engine's current group fingerprints, read at the time of the call."""
    if reset.scope is ResetScope.OFF:
        return None
    tiers = frozenset(t.value for t in reset.tiers) if reset.tiers else None
    fps = None if reset.scope is ResetScope.ALL else frozenset(f for f in fingerprints if f)
    return ClearScope(tenants=None, fingerprints=fps, tiers=tiers)


@dataclass(frozen=True)
class Cleared:
    """What one tier removed (or, in a dry run, would remove): `objects`, `nbytes` (None:
    the tier cannot tell, Mooncake), and `groups` (``GroupKey.as_str()`` of each group removed,
    filled by a per-process memory tier only: its removals are reported to vLLM's scheduler)."""

    objects: int = 0
    nbytes: int | None = 0
    groups: tuple[str, ...] = ()


@dataclass
class ClearReport:
    """The result of one clear: per tier what it removed, and the tiers that failed (why)."""

    scope: ClearScope
    removed: dict[str, Cleared] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        """Did every tier in scope remove what the scope names?"""
        return not self.failed

    @property
    def objects(self) -> int:
        return sum(c.objects for c in self.removed.values())

    def line(self, who: str) -> str:
        """The one log line: ``<who> removed 12 objects (3.0 MiB): disk 8 (2.0 MiB), ...``."""
        verb = "would remove" if self.dry_run else "removed"
        parts = [f"{name} {c.objects} ({_size(c.nbytes)})" for name, c in sorted(self.removed.items())]
        failed = "".join(f"; {name} failed: {why}" for name, why in sorted(self.failed.items()))
        where = ", ".join(parts) or "no tier in scope"
        return f"{who} {verb} {self.objects} objects [{self.scope.describe()}]: {where}{failed}"

    def to_dict(self) -> dict[str, object]:
        return {
            "dry_run": self.dry_run,
            "ok": self.ok,
            "scope": {
                "tenants": sorted(self.scope.tenants) if self.scope.tenants is not None else None,
                "fingerprints": sorted(self.scope.fingerprints) if self.scope.fingerprints is not None else None,
                "tiers": sorted(self.scope.tiers) if self.scope.tiers is not None else None,
            },
            "removed": {name: {"objects": c.objects, "bytes": c.nbytes} for name, c in sorted(self.removed.items())},
            "failed": dict(sorted(self.failed.items())),
        }


def _size(nbytes: int | None) -> str:
    if nbytes is None:
        return "bytes unknown"
    return f"{nbytes / (1 << 20):.1f} MiB"


class Clearable(Protocol):
    """What `clear_tiers` needs of a tier (`kvpack.tiers.base.Tier` has it)."""

    @property
    def name(self) -> str: ...

    def clear(self, scope: ClearScope, dry_run: bool = False) -> Cleared: ...


def clear_tiers(tiers: Sequence[Clearable], scope: ClearScope, dry_run: bool = False) -> ClearReport:
    """Apply `scope` to each of `tiers` it covers, in order; a tier that raises is reported failed
    (its reason in one line), never raised on. Two tiers of one name add up."""
    report = ClearReport(scope, dry_run=dry_run)
    if scope.tenants == frozenset() or scope.fingerprints == frozenset():
        return report  # names nothing (an engine that has not bound its fingerprint yet)
    for tier in tiers:
        if not scope.covers_tier(tier.name):
            continue
        try:
            got = tier.clear(scope, dry_run)
        except Exception as exc:  # noqa: BLE001 - a tier's failure is reported, never raised
            report.failed[tier.name] = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            continue
        before = report.removed.get(tier.name)
        if before is not None:
            nbytes = None if before.nbytes is None or got.nbytes is None else before.nbytes + got.nbytes
            got = Cleared(before.objects + got.objects, nbytes, before.groups + got.groups)
        report.removed[tier.name] = got
    return report
