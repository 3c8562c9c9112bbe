"""How `KVStore` stores: into the front tier (`Tier.front`) and behind it, or through every tier.

- With a front tier and write-back (the default), `store` returns once the front tier holds a
  copy; each object is queued for the lower tiers (`kvpack.writeback`). Behind the per-process
  memory tier the queue borrows that tier's copy; behind the host store it holds a copy of its
  own, at most `HOST_QUEUE_BYTES` (another process may evict and reuse the host store's pages),
  and what does not fit is written now by the caller.
- Without one (a disk-only store, SGLang's write-through), `store` writes every tier before it
  returns (`_write_through`).
- Sealing (the integrity key) and the payload checksum are applied once per object, before
  the first tier that needs them (`_sealed`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from .config.schema import KVPackConfig
from .identity.integrity import IntegrityKey, seal_items
from .identity.objects import ObjectHeader, copy_parts_into
from .observe.metrics import Metrics, Tally
from .observe.router_facts import record_stored_facts
from .observe.tier_events import TierEventFeed
from .tiers.base import PutItem, Tier, TierStatus, checksummed
from .tiers.memory import MemoryTier
from .writeback import WriteBack

HOST_QUEUE_BYTES = 64 << 20
"""Payload bytes a process queues behind the host store for the lower tiers (copies), at most:
past it a store writes them itself (`StoreWrites._store_host`). The per-process memory tier's
queue lends the tier's own copies instead, so it holds nothing of its own."""

log = logging.getLogger("kvpack")


class _StoreParts(Protocol):
    """What `StoreWrites` uses of `KVStore`."""

    config: KVPackConfig
    metrics: Metrics
    read_only: bool
    write_back: bool
    events: TierEventFeed | None
    tiers: tuple[Tier, ...]
    _closed: bool
    _front: Tier | None
    _memory: MemoryTier | None
    _lower: tuple[Tier, ...]
    _integrity: IntegrityKey | None
    _writeback: WriteBack
    _stamp_lock: threading.Lock
    _last_stamp: int

    def _count_evictions(self) -> None: ...

    def _store_host(self, items: Sequence[PutItem], host: Tier) -> list[TierStatus]: ...

    def _queue_stored(
        self, items: Sequence[PutItem], mem: Sequence[TierStatus], statuses: list[TierStatus]
    ) -> None: ...

    def _accept_stamps(self, n: int) -> range: ...

    def _enqueue(self, item: PutItem) -> bool: ...

    def _sealed(self, items: Sequence[PutItem], checksum: bool) -> Sequence[PutItem]: ...

    def _write_through(
        self, items: Sequence[PutItem], tiers: Sequence[Tier], sealed: bool = False
    ) -> list[TierStatus]: ...


class StoreWrites:
    """The store verbs of `KVStore` (see the module docstring). Thread-safe as the store is."""

    def store(self: _StoreParts, items: Sequence[PutItem]) -> list[TierStatus]:
        """Accept objects for storage; the caller's buffers may be reused on return.

        Returns per item: OK when accepted (in memory and/or queued for the lower
        tiers, or written to at least one lower tier when there is no memory
        tier), else the status of the failure."""
        if self._closed or self.read_only:
            return [TierStatus.UNAVAILABLE] * len(items)
        if self._front is None or not self.write_back:
            return self._write_through(items, self.tiers)
        if self._memory is None:
            return self._store_host(items, self._front)
        start = time.perf_counter()
        mem = self._memory.put_from(items)
        self.metrics.observe("store_seconds", time.perf_counter() - start, tier=self._memory.name)
        if self.events is not None:
            self.events.stored_where(self._memory.name, [it.key for it in items], [st is TierStatus.OK for st in mem])
        statuses = list(mem)
        tally = Tally(self.metrics)
        stored: dict[str, list[int]] = {}  # tenant -> [bytes, objects]
        for item, st in zip(items, mem):
            if st is TierStatus.OK:
                acc = stored.setdefault(item.key.tenant, [0, 0])
                acc[0] += item.header.payload_len  # == the payload's size: put_from checked it
                acc[1] += 1
            else:
                tally.inc("store_dropped", tier="memory", reason=st.value)
        for tenant, (nbytes, count) in stored.items():
            tally.inc("stored_bytes", nbytes, tenant=tenant, tier="memory")
            tally.inc("stored_objects", count, tenant=tenant, tier="memory")
        if self._lower:
            self._queue_stored(items, mem, statuses)
        tally.flush()
        self._count_evictions()
        return statuses

    def _store_host(self: _StoreParts, items: Sequence[PutItem], host: Tier) -> list[TierStatus]:
        """`store` with the host store in front: each item sealed and checksummed once, written
        to the host store now, then a copy of it queued for the lower tiers (the host store's
        pages are not this process's to lend: another process may evict and reuse them). What
        the queue has no room for (`HOST_QUEUE_BYTES`, `write_queue_depth`) this call writes
        to the lower tiers itself, as a store without write-back does: never dropped."""
        items = self._sealed(items, checksum=True)
        statuses = self._write_through(items, [host], sealed=True)
        if not self._lower:
            return statuses
        accepted = self._accept_stamps(len(items))
        now: list[int] = []
        for i, item in enumerate(items):
            if not self._writeback.has_room(item.nbytes):
                now.append(i)
                continue
            if self._writeback.enqueue(_owned_copy(item, accepted[i])):
                statuses[i] = TierStatus.OK
            else:
                now.append(i)
        if now:
            lower = self._write_through([items[i] for i in now], self._lower, sealed=True)
            for i, status in zip(now, lower):
                if status is TierStatus.OK:
                    statuses[i] = TierStatus.OK
        return statuses

    def _queue_stored(
        self: _StoreParts, items: Sequence[PutItem], mem: Sequence[TierStatus], statuses: list[TierStatus]
    ) -> None:
        """Queue every item for the lower tiers: from the memory tier's copy
        (borrowed, all under one lock) where it holds one, else from a copy."""
        assert self._memory is not None
        accepted = self._accept_stamps(len(items))
        stored = [i for i, st in enumerate(mem) if st is TierStatus.OK]
        views: list[tuple[ObjectHeader, memoryview] | None] = [None] * len(items)
        for i, borrowed in zip(stored, self._memory.borrow_many([items[i].key for i in stored])):
            views[i] = borrowed
        for i, item in enumerate(items):
            borrowed = views[i]
            if borrowed is not None:
                queued = PutItem(item.key, item.header, borrowed[1], accepted[i], item.announce)
            else:  # the memory tier holds no copy: take one for the queue
                queued = _owned_copy(item, accepted[i])
            if self._enqueue(queued):
                statuses[i] = TierStatus.OK

    def _accept_stamps(self: _StoreParts, n: int) -> range:
        """`n` wall-clock ns stamps, strictly increasing across every call of this store: the order
        in which `store` accepted its items. The write-back's threads reach a lower tier in their
        own order; the tier ranks recency by these stamps (`PutItem.accepted_ns`), so an older
        store arriving late never evicts a newer one."""
        with self._stamp_lock:
            first = max(self._last_stamp + 1, time.time_ns())
            self._last_stamp = first + n - 1
        return range(first, first + n)

    def _enqueue(self: _StoreParts, item: PutItem) -> bool:
        if self._writeback.enqueue(item):
            return True
        for tier in self._lower:
            self.metrics.inc("store_dropped", tier=tier.name, reason="backpressure")
        return False

    def _sealed(self: _StoreParts, items: Sequence[PutItem], checksum: bool) -> Sequence[PutItem]:
        """`items` sealed with the integrity key when there is one, and, if `checksum`, each
        with its payload checksum (computed once, here, for every tier they go to)."""
        if self._integrity is not None:
            items = seal_items(self._integrity, items)
        return checksummed(items) if checksum else items

    def _write_through(
        self: _StoreParts, items: Sequence[PutItem], tiers: Sequence[Tier], sealed: bool = False
    ) -> list[TierStatus]:
        """Write a batch to `tiers` now, one `put_from` per tier; per item OK if at
        least one tier took it. Never raises. `sealed`: `items` went through `_sealed` already.

        With one tier, a missing payload checksum is left to that tier, which
        computes it where it writes (the disk tier on its I/O threads); with
        several it is computed once here and shared."""
        if not items:
            return []
        if not sealed:
            items = self._sealed(items, checksum=len(tiers) > 1)
        best: list[TierStatus | None] = [None] * len(items)
        for tier in tiers:
            start = time.perf_counter()
            try:
                got = tier.put_from(items)
                if len(got) != len(items):
                    raise RuntimeError(f"{tier.name}.put_from returned {len(got)} statuses for {len(items)} items")
            except Exception as exc:
                log.warning("kvpack: %s.put_from failed: %s", tier.name, exc)
                got = [TierStatus.ERROR] * len(items)
            self.metrics.observe("store_seconds", time.perf_counter() - start, tier=tier.name)
            if self.events is not None:
                self.events.stored_where(tier.name, [it.key for it in items], [st is TierStatus.OK for st in got])
            if any(it.announce is not None for it in items):
                record_stored_facts(tier, items, [st is TierStatus.OK for st in got], self.metrics)
            tally = Tally(self.metrics)
            for i, (item, status) in enumerate(zip(items, got)):
                if status is TierStatus.OK:
                    tally.inc("stored_bytes", item.header.payload_len, tenant=item.key.tenant, tier=tier.name)
                    tally.inc("stored_objects", tenant=item.key.tenant, tier=tier.name)
                else:
                    tally.inc("store_dropped", tier=tier.name, reason=status.value)
                    if status is not TierStatus.NO_SPACE:
                        tally.inc("tier_errors", tier=tier.name, status=status.value)
                if best[i] is None or status is TierStatus.OK:
                    best[i] = status
            tally.flush()
        self._count_evictions()
        return [b or TierStatus.ERROR for b in best]


def _owned_copy(item: PutItem, accepted_ns: int) -> PutItem:
    """`item` over a copy of its payload (for the write-back queue: the caller's buffers may be
    reused once `store` returns), accepted at `accepted_ns`."""
    owned = np.empty(item.nbytes, dtype=np.uint8)
    copy_parts_into(owned, item.payload)
    return PutItem(item.key, item.header, owned.data, accepted_ns, item.announce)
