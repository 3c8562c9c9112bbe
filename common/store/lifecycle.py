"""The transfer lifecycle: lookup -> prepare_load -> complete_load; prepare_store -> complete_store.

The verbs live on `KVStore` (in the spirit of vLLM's ``kv_offload`` manager; the loads'
half is its `kvpack.store.reader.Reader`); this module holds their types and bookkeeping
(`PlanBook`, held by the store and its reader):

- `KVStore.lookup` answers a prefix hit and, per key of the hit, the name of
  the tier that holds it (`GroupLookup.located`).
- `KVStore.prepare_load(keys | located | lookup)` -> `LoadPlan`: records
  where each object is and pins those in this process's memory tier, so that
  tier's eviction skips their groups until the load is done. A lookup made in
  another process (vLLM's scheduler) cannot pin this memory: it hands over
  the tier names, and the plan pins what is still here.
- `KVStore.complete_load(plan, items)`: each object from the tier the plan
  names, the other tiers (fastest first) only when it is gone there; then the
  plan's pins are released. An object the plan located that its tier no
  longer holds is counted as ``evicted_before_load{tier}`` and logged, apart
  from plain misses (it is still a ``load_failures`` when no tier has it).
- `KVStore.prepare_store(keys)` -> the keys still to store: not stored on
  any tier and not prepared by another caller that has not completed yet.
  The one place saves are de-duplicated. `KVStore.complete_store(items)`
  stores them and ends their preparation.

Bounds: every pin is released exactly once: by `complete_load`, by
`KVStore.release` (a plan given up), or, for a plan nobody completes, once
its deadline (``pin_timeout_s`` after `prepare_load`) has passed: the memory
tier stops honouring the pin at the deadline, and the next `prepare_load`
sweeps the plan. A lost plan never holds memory past its deadline; a
prepared store that is never completed stops blocking others the same way.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config.schema import DraftPolicy
from ..identity.keys import StoreKey
from ..observe.metrics import Metrics, Tally
from ..policy.groups import GroupLookup
from ..tiers.base import GetResult

log = logging.getLogger("kvpack")


class Pinnable(Protocol):
    """The memory tier's side of a plan (`kvpack.tiers.memory.MemoryTier`)."""

    name: str

    def pin(self, keys: Sequence[StoreKey], until: float) -> list[bool]: ...

    def unpin(self, keys: Sequence[StoreKey]) -> None: ...


@dataclass(frozen=True)
class LoadPlan:
    """What `KVStore.prepare_load` found: per key, the tier that held it (keys found
    nowhere are absent), and the keys pinned in the memory tier until `expires`
    (monotonic seconds) or `complete_load`, whichever comes first."""

    id: int
    located: Mapping[StoreKey, str]
    pinned: tuple[StoreKey, ...] = ()
    expires: float = 0.0


class PlanBook:
    """Open load plans and prepared stores, each with a deadline. Thread-safe.

    Plans are kept in the order they were opened; with one timeout for all,
    that is also the order they expire in, so a sweep pops from the front."""

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"pin timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._open: dict[int, LoadPlan] = {}
        self._storing: dict[StoreKey, float] = {}  # key -> deadline

    def open(self, located: dict[StoreKey, str], memory: Pinnable | None) -> LoadPlan:
        """A plan for `located`, its objects in `memory` pinned until the plan's deadline."""
        until = time.monotonic() + self.timeout_s  # before pinning: the pins and the plan expire together
        pinned: tuple[StoreKey, ...] = ()
        if memory is not None:
            wanted = [k for k, t in located.items() if t == memory.name]
            pinned = tuple(k for k, ok in zip(wanted, memory.pin(wanted, until)) if ok)
        plan = LoadPlan(next(self._ids), located, pinned, until)
        if pinned:  # a plan that pins nothing has nothing to release: not tracked
            with self._lock:
                self._open[plan.id] = plan
        return plan

    def close(self, plan: LoadPlan) -> bool:
        """Forget `plan`; True when it was open (the caller releases its pins now)."""
        with self._lock:
            return self._open.pop(plan.id, None) is not None

    def sweep(self, now: float | None = None) -> list[LoadPlan]:
        """Remove and return the open plans past their deadline (the caller releases their pins)."""
        now = time.monotonic() if now is None else now
        expired: list[LoadPlan] = []
        with self._lock:
            while self._open:
                plan = next(iter(self._open.values()))
                if plan.expires > now:
                    break
                del self._open[plan.id]
                expired.append(plan)
        return expired

    @property
    def open_plans(self) -> int:
        with self._lock:
            return len(self._open)

    def claim_stores(self, keys: Sequence[StoreKey], stored: Sequence[bool]) -> list[StoreKey]:
        """The keys of `keys` not `stored` and not claimed by an unexpired earlier call,
        now claimed (until `end_stores` or the deadline)."""
        now = time.monotonic()
        out: list[StoreKey] = []
        with self._lock:
            storing = self._storing
            while storing:  # expired claims first (oldest at the front)
                key, until = next(iter(storing.items()))
                if until > now:
                    break
                del storing[key]
            until = now + self.timeout_s
            for key, present in zip(keys, stored):
                if present:
                    continue
                held = storing.get(key)
                if held is not None and held > now:
                    continue
                storing.pop(key, None)
                storing[key] = until
                out.append(key)
        return out

    def end_stores(self, keys: Sequence[StoreKey]) -> None:
        with self._lock:
            for key in keys:
                self._storing.pop(key, None)


def count_gone(
    metrics: Metrics, keys: Sequence[StoreKey], tiers: Sequence[str], results: Sequence[GetResult | None]
) -> None:
    """Objects a lookup found in `tiers[i]` that were gone from it at load: counted
    (``evicted_before_load``) and logged, apart from plain misses; `results` says
    whether another tier still had them."""
    tally = Tally(metrics)
    for key, tier in zip(keys, tiers):
        tally.inc("evicted_before_load", tenant=key.tenant, tier=tier)
    tally.flush()
    recovered = sum(1 for r in results if r is not None and r.ok)
    log.warning(
        "kvpack: %d objects the lookup found were gone from %s at load (evicted in between); %d loaded from "
        "another tier",
        len(keys),
        sorted(set(tiers)),
        recovered,
    )


def count_lookup(
    metrics: Metrics, policy: DraftPolicy, tenant: str, asked_tokens: int, result: GroupLookup, chunk_tokens: int
) -> None:
    """Count one lookup: asked and hit tokens, a full hit, partial hits by missing member
    (logged: a partial hit is never silent)."""
    metrics.inc("lookups", tenant=tenant)
    metrics.inc("lookup_tokens", asked_tokens, tenant=tenant)
    metrics.inc("hit_tokens", result.hit_chunks * chunk_tokens, tenant=tenant)
    if result.full_chunks and not result.partial:
        metrics.inc("full_hits", tenant=tenant)
    for member, count in result.missing.items():
        metrics.inc("partial_hits", count, tenant=tenant, missing_member=member)
    for member in result.boundary_missing:
        metrics.inc("partial_hits", tenant=tenant, missing_member=member)
    if result.boundary_missing:
        log.info(
            "kvpack: partial hit for tenant %s: the chunk after the hit holds part of its group, not %s; the hit "
            "stops before it",
            tenant,
            list(result.boundary_missing),
        )
    if result.partial:
        log.info(
            "kvpack: partial hit for tenant %s: %d chunks have the target but lack %s (%s policy)",
            tenant,
            result.target_chunks - result.full_chunks,
            sorted(result.missing),
            policy.value,
        )
