"""Lent copies: a store or a load whose payloads the caller writes into, or reads from, the
memory tier's own slots, so a caller that must convert the bytes anyway (an SGLang host
pool's pages into canonical objects) makes that conversion the only copy, instead of a
conversion into its own buffer beside the tier's copy out of it.

`KVStore` has these verbs through `LentCopies`:

- `store_lent(keys, headers, fill)` (`complete_store_lent` after `prepare_store`): the
  memory tier reserves each object's slot (`MemoryTier.reserve`, the capacity rules of
  `put_from`), `fill` writes every payload in place, then the objects become visible
  (`MemoryTier.publish`); the lower tiers get them as `store` gives them theirs.
- `complete_load_lent(plan, items)`: `complete_load`, except that an object the memory tier
  holds is handed back as a read-only view of its slot (`MemoryTier.lend`) instead of copied
  into the item's buffer; `complete_load_pages_lent(plan, reads)` the same for whole pages
  (`PageReads`: one expectation per member, a `LoadItem` only for what memory does not lend).

Both fall back to the ordinary copies where lending would skip a check (`lends_memory`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from .config import ChecksumPolicy, KVPackConfig
from .integrity import IntegrityKey
from .keys import StoreKey
from .lifecycle import LoadPlan, PlanBook
from .metrics import Metrics
from .objects import ObjectHeader, payload_checksum
from .reads import LoadItem, PageReads, TierReads
from .tiers.base import GetResult, PutItem, Tier, TierStatus
from .tiers.memory import MemoryTier

_NOT_LENT = GetResult(TierStatus.MISS)
"""A placeholder in `complete_load_lent` for an item read the ordinary way."""


class _StoreParts(Protocol):
    """What `LentCopies` uses of `KVStore`."""

    config: KVPackConfig
    metrics: Metrics
    read_only: bool
    write_back: bool
    _closed: bool
    _memory: MemoryTier | None
    _lower: tuple[Tier, ...]
    _integrity: IntegrityKey | None
    _reads: TierReads
    _by_name: dict[str, Tier]
    _plans: PlanBook

    def store(self, items: Sequence[PutItem]) -> list[TierStatus]: ...

    def complete_load(self, plan: LoadPlan, items: Sequence[LoadItem]) -> list[GetResult]: ...

    def release(self, plan: LoadPlan) -> None: ...

    def _write_through(self, items: Sequence[PutItem], tiers: Sequence[Tier]) -> list[TierStatus]: ...

    def _queue_stored(
        self, items: Sequence[PutItem], mem: Sequence[TierStatus], statuses: list[TierStatus]
    ) -> None: ...

    def _count_evictions(self) -> None: ...

    def _count_lent(self, tier: str, loaded: Mapping[str, int]) -> None: ...

    def _read_not_lent(self, plan: LoadPlan, items: Sequence[LoadItem]) -> list[GetResult]: ...

    @property
    def lends_memory(self) -> bool: ...


class LentCopies:
    """The lent verbs of `KVStore` (see the module docstring). Thread-safe as the store is."""

    @property
    def lends_memory(self: _StoreParts) -> bool:
        """Whether the lent verbs hand out the memory tier's slots: the store has one and
        stores, no keyed MAC (a sealed header needs its payload first), and its loads from
        memory are not checksummed (``checksum`` is not ``always``). Else they copy."""
        return (
            self._memory is not None
            and not self.read_only
            and self._integrity is None
            and self.config.checksum is not ChecksumPolicy.ALWAYS
        )

    def store_lent(
        self: _StoreParts,
        keys: Sequence[StoreKey],
        headers: Sequence[ObjectHeader],
        fill: Callable[[list[np.ndarray]], None],
    ) -> list[TierStatus]:
        """`store`, the payloads written by the caller instead of copied from its buffers:
        `fill(dsts)` is called once with a writable uint8 array of exactly
        ``headers[i].payload_len`` bytes per object and must fill every one (a slot the
        memory tier reserved, or, where it refused the object or `lends_memory` is False,
        a fresh array). The memory tier shows an object only once `fill` returned; if
        `fill` raises, nothing is stored and the exception propagates. Per object: OK when
        accepted, as `store` answers."""
        n = len(keys)
        if self._closed or self.read_only:
            return [TierStatus.UNAVAILABLE] * n
        memory = self._memory
        if memory is None or not self.lends_memory:
            owned = [np.empty(h.payload_len, dtype=np.uint8) for h in headers]
            fill(owned)
            return self.store([PutItem(k, h, d.data) for k, h, d in zip(keys, headers, owned)])
        start = time.perf_counter()
        reserved, slots = memory.reserve(keys, headers)
        dsts = [s if s is not None else np.empty(h.payload_len, dtype=np.uint8) for s, h in zip(slots, headers)]
        try:
            fill(dsts)
        except BaseException:
            memory.publish(keys, headers, slots, [TierStatus.ERROR] * n)
            raise
        items: list[PutItem] = []  # only for the tiers below (the memory tier alone builds none)
        if self._lower:
            items = [PutItem(k, h, d.data) for k, h, d in zip(keys, headers, dsts)]
            if not self.write_back:  # one checksum for every tier, as `_write_through` gives
                items = [
                    replace(it, header=replace(it.header, checksum=payload_checksum(it.payload)))
                    if it.header.checksum is None
                    else it
                    for it in items
                ]
            headers = [it.header for it in items]
        mem = memory.publish(keys, headers, slots, reserved)
        self.metrics.observe("store_seconds", time.perf_counter() - start, tier=memory.name)
        _count_stored(self.metrics, memory.name, keys, headers, mem)
        statuses = list(mem)
        if self._lower and self.write_back:
            self._queue_stored(items, mem, statuses)
        elif self._lower:
            lower = self._write_through(items, self._lower)
            statuses = [m if m is TierStatus.OK or lo is not TierStatus.OK else lo for m, lo in zip(mem, lower)]
        self._count_evictions()
        return statuses

    def complete_store_lent(
        self: _StoreParts,
        keys: Sequence[StoreKey],
        headers: Sequence[ObjectHeader],
        fill: Callable[[list[np.ndarray]], None],
    ) -> list[TierStatus]:
        """`store_lent` the items `prepare_store` gave, and end their preparation (as
        `complete_store` does for `store`)."""
        try:
            return LentCopies.store_lent(self, keys, headers, fill)
        finally:
            self._plans.end_stores(keys)

    def complete_load_lent(
        self: _StoreParts, plan: LoadPlan, items: Sequence[LoadItem]
    ) -> tuple[list[GetResult], list[memoryview | None]]:
        """`complete_load`, except that what this process's memory tier holds is not copied:
        ``views[i]`` is then its stored payload, read-only, and ``items[i].dst`` is left as
        it was; every other item is read into its `dst` as `complete_load` reads it
        (``views[i]`` None). A view stays valid while the caller holds it, evicted or not
        (`MemoryTier.lend`). Without `lends_memory` every view is None."""
        memory = self._memory
        if memory is None or not self.lends_memory:
            return self.complete_load(plan, items), [None] * len(items)
        try:
            lent = memory.lend([it.key for it in items], [it.expected for it in items])
            results: list[GetResult] = []
            views: list[memoryview | None] = []
            rest: list[int] = []
            loaded: dict[str, int] = {}  # bytes per tenant: one count per tenant, not per object
            for i, (item, got) in enumerate(zip(items, lent)):
                if got is None:
                    results.append(_NOT_LENT)
                    views.append(None)
                    rest.append(i)
                    continue
                header, view = got
                results.append(GetResult(TierStatus.OK, header))
                views.append(view)
                tenant = item.key.tenant
                loaded[tenant] = loaded.get(tenant, 0) + header.payload_len
            self._count_lent(memory.name, loaded)
            for i, res in zip(rest, self._read_not_lent(plan, [items[i] for i in rest])):
                results[i] = res
            return results, views
        finally:
            self.release(plan)

    def complete_load_pages_lent(
        self: _StoreParts, plan: LoadPlan, reads: Sequence[PageReads]
    ) -> tuple[list[bool], list[memoryview | None]]:
        """`complete_load_lent` for batches of whole pages, in order (page j of ``reads[b]``
        at ``sum(len(r) for r in reads[:b]) + j``): per page, loaded, and its memory-tier
        payload lent (None where it was read into its `dst`, or missed). A page memory holds
        with a header that does not match is read the ordinary way (`TierReads.load`: it is
        refused and counted there, as `complete_load` would); so is every page without
        `lends_memory`."""
        memory = self._memory
        if memory is None or not self.lends_memory:
            items = [it for r in reads for it in r.items()]
            return [res.ok for res in self.complete_load(plan, items)], [None] * len(items)
        try:
            ok: list[bool] = []
            views: list[memoryview | None] = []
            rest: list[LoadItem] = []
            rest_at: list[int] = []
            loaded: dict[str, int] = {}  # bytes per tenant: one count per tenant, not per object
            for r in reads:
                got = memory.lend_pages(r.keys, r.expected)
                base = len(ok)
                missing = [j for j, view in enumerate(got) if view is None]
                ok.extend(view is not None for view in got)
                views.extend(got)
                nbytes = sum(view.nbytes for view in got if view is not None)  # a slot is its payload
                if nbytes:
                    loaded[r.expected.tenant] = loaded.get(r.expected.tenant, 0) + nbytes
                if missing:
                    rest.extend(r.items(missing))
                    rest_at.extend(base + j for j in missing)
            self._count_lent(memory.name, loaded)
            for i, res in zip(rest_at, self._read_not_lent(plan, rest)):
                ok[i] = res.ok
            return ok, views
        finally:
            self.release(plan)

    def _count_lent(self: _StoreParts, tier: str, loaded: Mapping[str, int]) -> None:
        """`loaded_bytes` of what the memory tier lent: one count per tenant, not per object."""
        for tenant, nbytes in loaded.items():
            self.metrics.inc("loaded_bytes", nbytes, tenant=tenant, tier=tier)

    def _read_not_lent(self: _StoreParts, plan: LoadPlan, items: Sequence[LoadItem]) -> list[GetResult]:
        """What the memory tier did not lend, read the ordinary way (`TierReads.load`), each
        first from the tier the plan's lookup named."""
        if not items:
            return []
        located: Mapping[StoreKey, str] = plan.located
        first = [self._by_name.get(located.get(it.key, "")) for it in items]
        return self._reads.load(items, first)


def _count_stored(
    metrics: Metrics,
    tier: str,
    keys: Sequence[StoreKey],
    headers: Sequence[ObjectHeader],
    statuses: Sequence[TierStatus],
) -> None:
    """`stored_bytes` and `stored_objects` per tenant, `store_dropped` per reason: one
    count per label set of the batch (hundreds of pages a call), as `Tally` would give."""
    stored: dict[str, list[int]] = {}  # tenant -> [objects, bytes]
    dropped: dict[str, int] = {}
    for key, header, st in zip(keys, headers, statuses):
        if st is TierStatus.OK:
            acc = stored.get(key.tenant)
            if acc is None:
                acc = stored[key.tenant] = [0, 0]
            acc[0] += 1
            acc[1] += header.payload_len
        else:
            dropped[st.value] = dropped.get(st.value, 0) + 1
    for tenant, (objects, nbytes) in stored.items():
        metrics.inc("stored_bytes", nbytes, tenant=tenant, tier=tier)
        metrics.inc("stored_objects", objects, tenant=tenant, tier=tier)
    for reason, count in dropped.items():
        metrics.inc("store_dropped", count, tier=tier, reason=reason)
