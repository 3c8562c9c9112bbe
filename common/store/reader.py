"""The store's reading part: load plans, read-through and lending.

- `prepare_load(located)` -> `LoadPlan` (`kvpack.store.lifecycle.PlanBook`: the memory tier's
  copies pinned); `complete_load(plan, items)` reads each object from the tier the plan names,
  read-through from the others (`kvpack.store.reads.TierReads`), then releases the plan.
- Lending: `complete_load_lent` / `complete_load_pages_lent` hand back what this process's memory
  tier (`MemoryTier.lend`) or the host store (`HostTier.lend`) holds as read-only views of the
  stored payloads instead of copies, so a caller that converts the bytes anyway (an SGLang host
  pool's pages, a staging row) makes that conversion the only copy. Both return one `LentLoad`:
  the results, the views, and the re-check a caller runs after copying out of them (`lost`).

Lending falls back to the ordinary copies where it would skip a check (`KVStore.lends_memory`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..identity.keys import StoreKey
from ..identity.objects import ObjectHeader
from ..observe.metrics import Metrics
from ..tiers.base import GetResult, Tier, TierStatus
from ..tiers.memory import MemoryTier
from .lifecycle import LoadPlan, PlanBook
from .reads import LoadItem, PageReads, TierReads

if TYPE_CHECKING:
    from ..tiers.host import HostTier

_NOT_LENT = GetResult(TierStatus.MISS)
"""A placeholder in `complete_load_lent` for an item read the ordinary way."""
_LENT_PAGE = GetResult(TierStatus.OK)
"""The result of a page the memory tier lent (`lend_pages` checks without a header per page)."""


def _all_held() -> list[bool]:
    return []


@dataclass(frozen=True, eq=False)
class LentLoad:
    """What a load did, per item in the caller's order: its result, and the stored payload lent
    in place of a copy (``views[i]``, read-only; None where the item's buffer was filled, or it
    missed). A memory-tier view stays valid while the caller holds it. A host-store view is shared
    memory another process may rewrite: the caller copies out of every view, then calls `lost`.

    Invariant: ``len(results) == len(views)``; `asked` are the positions the host store lent."""

    results: list[GetResult]
    views: list[memoryview | None]
    asked: list[int] = field(default_factory=list)
    held: Callable[[], list[bool]] = _all_held
    """Per position of `asked`: whether its host-store view is still the object (`HostTier.lend`)."""

    @classmethod
    def copied(cls, results: list[GetResult]) -> LentLoad:
        """A load that lent nothing (every item read into its buffer)."""
        return cls(results, [None] * len(results))

    @property
    def ok(self) -> list[bool]:
        """Per item: loaded (into its buffer, or lent)."""
        return [r.ok for r in self.results]

    def lost(self) -> list[int]:
        """The re-check, once the caller copied out of every view: the items whose host-store view
        changed meanwhile (another process took its pages). Their copies are not the objects: the
        caller treats them as misses. Empty when the host store lent nothing."""
        if not self.asked:
            return []
        return [i for i, kept in zip(self.asked, self.held()) if not kept]


class Reader:
    """The load verbs of `KVStore` (see the module docstring). Thread-safe.

    `tiers` fastest first; `memory` the per-process memory tier among them; `host` the host store
    when the store reads its objects in place (no keyed MAC), else None; `plans` the store's
    `PlanBook` (a load plan's pins); `lends_memory`: the memory tier's slots are lent."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        reads: TierReads,
        plans: PlanBook,
        metrics: Metrics,
        *,
        memory: MemoryTier | None,
        host: HostTier | None,
        lends_memory: bool,
    ) -> None:
        self.metrics = metrics
        self._reads = reads
        self._plans = plans
        self._memory = memory
        self._host = host
        self._lends_memory = lends_memory
        self._by_name = {t.name: t for t in reversed(tuple(tiers))}  # the fastest of a name

    def prepare_load(self, located: Mapping[StoreKey, str]) -> LoadPlan:
        """A plan for the keys `located` names (key -> tier name; names no tier of this store has
        are dropped), its memory-tier copies pinned. Plans past their deadline are released first."""
        for stale in self._plans.sweep():
            self._unpin(stale)
        return self._plans.open({k: t for k, t in located.items() if t in self._by_name}, self._memory)

    def release(self, plan: LoadPlan) -> None:
        """Release `plan`'s pins now (idempotent; every `complete_load*` calls it)."""
        if self._plans.close(plan):
            self._unpin(plan)

    def _unpin(self, plan: LoadPlan) -> None:
        if plan.pinned and self._memory is not None:
            self._memory.unpin(plan.pinned)

    def load(self, items: Sequence[LoadItem]) -> list[GetResult]:
        """Restore each item into its `dst`, fastest tier first (read-through). Never raises."""
        return self._reads.load(items, [None] * len(items))

    def complete_load(
        self, plan: LoadPlan, items: Sequence[LoadItem], local_only: bool = False, promote: bool = True
    ) -> list[GetResult]:
        """Restore each item, from the tier `plan` names first (read-through when it names
        none or that tier lost it), then release the plan's pins. Never raises.
        `local_only`: no `Tier.remote` tier is asked (a load on an engine's step must not wait
        on the network; what only a remote tier holds is a miss). `promote`: a lower tier's
        hit is also put into this process's memory tier (False where the destination is a
        cache the engine keeps in host memory itself: it holds the object now)."""
        try:
            first = [self._by_name.get(plan.located.get(it.key, "")) for it in items]
            return self._reads.load(items, first, local_only, promote)
        finally:
            self.release(plan)

    def lent_host_mapping(self) -> tuple[int, int] | None:
        """(address, bytes) of the host store's memory the lent loads hand out views of (the
        store's mapping in this process), None when the store lends none."""
        return None if self._host is None else self._host.mapping()

    def complete_load_lent(self, plan: LoadPlan, items: Sequence[LoadItem], local_only: bool = False) -> LentLoad:
        """`complete_load`, except that what this process's memory tier or the host store holds
        is not copied: ``views[i]`` is then its stored payload, read-only, and ``items[i].dst``
        is left as it was; every other item is read into its `dst` as `complete_load` reads it
        (``views[i]`` None). `local_only`: no remote tier is asked (`complete_load`).

        A memory-tier view stays valid while the caller holds it, evicted or not
        (`MemoryTier.lend`; only when the store lends its memory). A host-store view is shared
        memory another process may rewrite (`HostTier.lend`; only without a keyed MAC, which needs
        the payload first, and only for loads that verify no checksum: a checksum covers the
        bytes the engine reads, so a verified load copies into the item's `dst` first and
        checks that copy): the caller copies out of every view, then runs `LentLoad.lost`."""
        n = len(items)
        results: list[GetResult] = [_NOT_LENT] * n
        views: list[memoryview | None] = [None] * n
        try:
            rest = list(range(n))
            memory = self._memory
            lent: dict[int, tuple[ObjectHeader, memoryview]] = {}
            if memory is not None and self._lends_memory:
                got = memory.lend([it.key for it in items], [it.expected for it in items])
                lent = {i: one for i, one in enumerate(got) if one is not None}
                self._count_lent(memory.name, _bytes_per_tenant(items, lent))
                rest = [i for i in rest if i not in lent]
            from_host, asked, held = self._host_lend(plan, [items[i] for i in rest], rest)
            lent.update(from_host)
            for i, (header, view) in lent.items():
                results[i], views[i] = GetResult(TierStatus.OK, header), view
            rest = [i for i in rest if i not in from_host]
            for i, res in zip(rest, self._read(plan, [items[i] for i in rest], local_only)):
                results[i] = res
            return LentLoad(results, views, asked, held)
        finally:
            self.release(plan)

    def complete_load_pages_lent(self, plan: LoadPlan, reads: Sequence[PageReads], promote: bool = True) -> LentLoad:
        """`complete_load_lent` for batches of whole pages, in order (page j of ``reads[b]``
        at ``sum(len(r) for r in reads[:b]) + j``). A page memory holds with a header that does
        not match is read the ordinary way (`TierReads.load`: it is refused and counted there, as
        `complete_load` would); so is every page neither lends. `promote`: as `complete_load`'s."""
        memory = self._memory if self._lends_memory else None
        try:
            results: list[GetResult] = []
            views: list[memoryview | None] = []
            rest: list[LoadItem] = []
            rest_at: list[int] = []
            loaded: dict[str, int] = {}  # bytes per tenant: one count per tenant, not per object
            for r in reads:
                base = len(results)
                if memory is None:
                    results.extend([_NOT_LENT] * len(r))
                    views.extend([None] * len(r))
                    rest.extend(r.items())
                    rest_at.extend(range(base, base + len(r)))
                    continue
                got = memory.lend_pages(r.keys, r.expected)
                missing = [j for j, view in enumerate(got) if view is None]
                results.extend(_LENT_PAGE if view is not None else _NOT_LENT for view in got)
                views.extend(got)
                nbytes = sum(view.nbytes for view in got if view is not None)  # a slot is its payload
                if nbytes:
                    loaded[r.expected.tenant] = loaded.get(r.expected.tenant, 0) + nbytes
                if missing:
                    rest.extend(r.items(missing))
                    rest_at.extend(base + j for j in missing)
            if memory is not None:
                self._count_lent(memory.name, loaded)
            lent, asked, held = self._host_lend(plan, rest, rest_at)
            for i, (_, view) in lent.items():
                results[i], views[i] = _LENT_PAGE, view
            todo = [(i, it) for i, it in zip(rest_at, rest) if i not in lent]
            for (i, _), res in zip(todo, self._read(plan, [it for _, it in todo], False, promote)):
                results[i] = res
            return LentLoad(results, views, asked, held)
        finally:
            self.release(plan)

    def _host_lend(
        self, plan: LoadPlan, items: Sequence[LoadItem], at: Sequence[int]
    ) -> tuple[dict[int, tuple[ObjectHeader, memoryview]], list[int], Callable[[], list[bool]]]:
        """What the host store lends of `items` (`HostTier.lend`: those the plan located there or on
        no tier of this store), counted: ``{at[j]: (header, view)}``, the caller's positions it was
        asked for, and the host store's re-check over them. Without a lending host store, nothing."""
        host = self._host
        if host is None:
            return {}, [], _all_held
        located, tiers = plan.located, self._by_name
        mine = [j for j, it in enumerate(items) if tiers.get(located.get(it.key, "")) in (None, host)]
        if not mine:
            return {}, [], _all_held
        start = time.perf_counter()
        got, held = host.lend(
            [items[j].key for j in mine], [items[j].expected for j in mine], self._reads.verifies(host)
        )
        self.metrics.observe("load_seconds", time.perf_counter() - start, tier=host.name)
        lent = {j: one for j, one in zip(mine, got) if one is not None}
        self._count_lent(host.name, _bytes_per_tenant(items, lent))
        return {at[j]: one for j, one in lent.items()}, [at[j] for j in mine], held

    def _count_lent(self, tier: str, loaded: Mapping[str, int]) -> None:
        """`loaded_bytes` of what a tier lent: one count per tenant, not per object."""
        for tenant, nbytes in loaded.items():
            self.metrics.inc("loaded_bytes", nbytes, tenant=tenant, tier=tier)

    def _read(
        self, plan: LoadPlan, items: Sequence[LoadItem], local_only: bool = False, promote: bool = True
    ) -> list[GetResult]:
        """`items` read the ordinary way (`TierReads.load`), each first from the tier the plan's
        lookup named; `local_only`: no remote tier; `promote`: a lower tier's hit also goes into
        the memory tier."""
        if not items:
            return []
        located: Mapping[StoreKey, str] = plan.located
        first = [self._by_name.get(located.get(it.key, "")) for it in items]
        return self._reads.load(items, first, local_only, promote)


def _bytes_per_tenant(items: Sequence[LoadItem], lent: Mapping[int, tuple[ObjectHeader, memoryview]]) -> dict[str, int]:
    """Payload bytes of the lent ``items[i]`` (``lent[i]``: its header and view) per tenant."""
    out: dict[str, int] = {}
    for i, (header, _) in lent.items():
        tenant = items[i].key.tenant
        out[tenant] = out.get(tenant, 0) + header.payload_len
    return out
