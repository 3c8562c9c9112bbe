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
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .config.schema import ChecksumPolicy, KVPackConfig
from .identity.integrity import IntegrityKey
from .identity.keys import StoreKey
from .identity.objects import ObjectHeader
from .lifecycle import LoadPlan, PlanBook
from .observe.metrics import Metrics
from .reads import LoadItem, PageReads, TierReads
from .tiers.base import GetResult, PutItem, Tier, TierStatus, checksummed
from .tiers.memory import MemoryTier

if TYPE_CHECKING:
    from .tiers.host import HostTier

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
    _front: Tier | None
    _lower: tuple[Tier, ...]
    _integrity: IntegrityKey | None
    _reads: TierReads
    _by_name: dict[str, Tier]
    _plans: PlanBook

    def store(self, items: Sequence[PutItem]) -> list[TierStatus]: ...

    def complete_load(self, plan: LoadPlan, items: Sequence[LoadItem], local_only: bool = False) -> list[GetResult]: ...

    def release(self, plan: LoadPlan) -> None: ...

    def _write_through(self, items: Sequence[PutItem], tiers: Sequence[Tier]) -> list[TierStatus]: ...

    def _queue_stored(
        self, items: Sequence[PutItem], mem: Sequence[TierStatus], statuses: list[TierStatus]
    ) -> None: ...

    def _count_evictions(self) -> None: ...

    def _count_lent(self, tier: str, loaded: Mapping[str, int]) -> None: ...

    def _lending_host(self) -> HostTier | None: ...

    def _host_lend(
        self, plan: LoadPlan, items: Sequence[LoadItem], at: Sequence[int], n: int
    ) -> tuple[dict[int, tuple[ObjectHeader, memoryview]], Callable[[], list[bool]]]: ...

    def _read_not_lent(
        self, plan: LoadPlan, items: Sequence[LoadItem], local_only: bool = False, promote: bool = True
    ) -> list[GetResult]: ...

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

    def lent_host_mapping(self: _StoreParts) -> tuple[int, int] | None:
        """(address, bytes) of the host store's memory the lent loads hand out views of (the
        store's mapping in this process), None when the store lends none (`_lending_host`)."""
        host = self._lending_host()
        return None if host is None else host.mapping()

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
                items = checksummed(items)
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
        self: _StoreParts, plan: LoadPlan, items: Sequence[LoadItem], local_only: bool = False
    ) -> tuple[list[GetResult], list[memoryview | None], Callable[[], list[bool]]]:
        """`complete_load`, except that what this process's memory tier or the host store holds
        is not copied: ``views[i]`` is then its stored payload, read-only, and ``items[i].dst``
        is left as it was; every other item is read into its `dst` as `complete_load` reads it
        (``views[i]`` None). `local_only`: no remote tier is asked (`complete_load`).

        A memory-tier view stays valid while the caller holds it, evicted or not
        (`MemoryTier.lend`; only with `lends_memory`). A host-store view is shared memory
        another process may rewrite (`HostTier.lend`; only without a keyed MAC, which needs
        the payload first, and only for loads that verify no checksum: a checksum covers the
        bytes the engine reads, so a verified load copies into the item's `dst` first and
        checks that copy): the caller copies out of every view, then calls the returned
        ``held()``: per item, False where a host-store view changed meanwhile, so its copy is
        not the object and must be treated as a miss."""
        n = len(items)
        results: list[GetResult] = [_NOT_LENT] * n
        views: list[memoryview | None] = [None] * n
        try:
            rest = list(range(n))
            memory = self._memory
            lent: dict[int, tuple[ObjectHeader, memoryview]] = {}
            if memory is not None and self.lends_memory:
                got = memory.lend([it.key for it in items], [it.expected for it in items])
                lent = {i: one for i, one in enumerate(got) if one is not None}
                self._count_lent(memory.name, _bytes_per_tenant(items, lent))
                rest = [i for i in rest if i not in lent]
            from_host, held = self._host_lend(plan, [items[i] for i in rest], rest, n)
            lent.update(from_host)
            for i, (header, view) in lent.items():
                results[i], views[i] = GetResult(TierStatus.OK, header), view
            rest = [i for i in rest if i not in from_host]
            for i, res in zip(rest, self._read_not_lent(plan, [items[i] for i in rest], local_only)):
                results[i] = res
            return results, views, held
        finally:
            self.release(plan)

    def _host_lend(
        self: _StoreParts, plan: LoadPlan, items: Sequence[LoadItem], at: Sequence[int], n: int
    ) -> tuple[dict[int, tuple[ObjectHeader, memoryview]], Callable[[], list[bool]]]:
        """What the host store lends of `items` (`HostTier.lend`: those the plan located there or on
        no tier of this store), counted: ``{at[j]: (header, view)}``, and ``held()`` over the caller's `n`
        positions (True where nothing was host-lent). Without a lending host store, nothing."""
        host = self._lending_host()
        if host is None:
            return {}, lambda: [True] * n
        located, tiers = plan.located, self._by_name
        mine = [j for j, it in enumerate(items) if tiers.get(located.get(it.key, "")) in (None, host)]
        if not mine:
            return {}, lambda: [True] * n
        start = time.perf_counter()
        got, host_held = host.lend(
            [items[j].key for j in mine], [items[j].expected for j in mine], self._reads.verifies(host)
        )
        self.metrics.observe("load_seconds", time.perf_counter() - start, tier=host.name)
        lent = {j: one for j, one in zip(mine, got) if one is not None}
        self._count_lent(host.name, _bytes_per_tenant(items, lent))
        asked = [at[j] for j in mine]

        def held() -> list[bool]:
            verdict = [True] * n
            for i, kept in zip(asked, host_held()):
                verdict[i] = kept
            return verdict

        return {at[j]: one for j, one in lent.items()}, held

    def _lending_host(self: _StoreParts) -> HostTier | None:
        """The host store when the store reads its objects in place (no keyed MAC), else None."""
        from .tiers.host import HostTier

        front = self._front
        return front if isinstance(front, HostTier) and self._integrity is None else None

    def complete_load_pages_lent(
        self: _StoreParts, plan: LoadPlan, reads: Sequence[PageReads], promote: bool = True
    ) -> tuple[list[bool], list[memoryview | None], Callable[[], list[bool]]]:
        """`complete_load_lent` for batches of whole pages, in order (page j of ``reads[b]``
        at ``sum(len(r) for r in reads[:b]) + j``): per page, loaded, its payload lent by the
        memory tier or the host store (None where it was read into its `dst`, or missed), and
        ``held()`` to call after copying out of the views (`complete_load_lent`). A page memory
        holds with a header that does not match is read the ordinary way (`TierReads.load`: it
        is refused and counted there, as `complete_load` would); so is every page neither lends.
        `promote`: as `complete_load`'s."""
        memory = self._memory if self.lends_memory else None
        try:
            ok: list[bool] = []
            views: list[memoryview | None] = []
            rest: list[LoadItem] = []
            rest_at: list[int] = []
            loaded: dict[str, int] = {}  # bytes per tenant: one count per tenant, not per object
            for r in reads:
                base = len(ok)
                if memory is None:
                    ok.extend([False] * len(r))
                    views.extend([None] * len(r))
                    rest.extend(r.items())
                    rest_at.extend(range(base, base + len(r)))
                    continue
                got = memory.lend_pages(r.keys, r.expected)
                missing = [j for j, view in enumerate(got) if view is None]
                ok.extend(view is not None for view in got)
                views.extend(got)
                nbytes = sum(view.nbytes for view in got if view is not None)  # a slot is its payload
                if nbytes:
                    loaded[r.expected.tenant] = loaded.get(r.expected.tenant, 0) + nbytes
                if missing:
                    rest.extend(r.items(missing))
                    rest_at.extend(base + j for j in missing)
            if memory is not None:
                self._count_lent(memory.name, loaded)
            lent, held = self._host_lend(plan, rest, rest_at, len(ok))
            for i, (_, view) in lent.items():
                ok[i], views[i] = True, view
            todo = [(i, it) for i, it in zip(rest_at, rest) if i not in lent]
            for (i, _), res in zip(todo, self._read_not_lent(plan, [it for _, it in todo], False, promote)):
                ok[i] = res.ok
            return ok, views, held
        finally:
            self.release(plan)

    def _count_lent(self: _StoreParts, tier: str, loaded: Mapping[str, int]) -> None:
        """`loaded_bytes` of what a tier lent: one count per tenant, not per object."""
        for tenant, nbytes in loaded.items():
            self.metrics.inc("loaded_bytes", nbytes, tenant=tenant, tier=tier)

    def _read_not_lent(
        self: _StoreParts, plan: LoadPlan, items: Sequence[LoadItem], local_only: bool = False, promote: bool = True
    ) -> list[GetResult]:
        """What the memory tier did not lend, read the ordinary way (`TierReads.load`), each
        first from the tier the plan's lookup named; `local_only`: no remote tier; `promote`:
        a lower tier's hit also goes into the memory tier."""
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
