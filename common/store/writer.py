"""The store's writing part: into the front tier (`Tier.front`) and behind it, or through every tier.

- With a front tier and write-back (the default), `Writer.store` returns once the front tier holds
  a copy; each object is queued for the lower tiers (`kvpack.store.writeback`). Behind the
  per-process memory tier the queue borrows that tier's copy; behind the host store it holds a
  copy of its own, at most `HOST_QUEUE_BYTES` (another process may evict and reuse the host
  store's pages), and what does not fit is written now by the caller.
- Without one (a disk-only store, SGLang's write-through), `store` writes every tier before it
  returns (`write_through`).
- `store_lent`: the payloads are written by the caller straight into the memory tier's slots
  (`MemoryTier.reserve` / `publish`), so a caller that converts the bytes anyway makes no copy
  beside the tier's; the lower tiers get them as `store` gives them theirs.
- Sealing (the integrity key) and the payload checksum are applied once per object, before
  the first tier that needs them (`_sealed`).
- Counted in one place (`_count_stored`): ``stored_bytes`` / ``stored_objects`` per tenant and
  tier, ``store_dropped`` per reason, whichever verb stored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..config.schema import KVPackConfig
from ..identity.keys import StoreKey
from ..identity.objects import ObjectHeader, copy_parts_into
from ..observe.metrics import Metrics, Tally
from ..observe.tier_events import TierEventFeed
from ..tiers.base import PutItem, Tier, TierStatus, checksummed
from ..tiers.memory import MemoryTier
from .integrity import IntegrityKey, seal_items
from .writeback import WriteBack

HOST_QUEUE_BYTES = 64 << 20
"""Payload bytes a process queues behind the host store for the lower tiers (copies), at most:
past it a store writes them itself (`Writer._store_host`). The per-process memory tier's
queue lends the tier's own copies instead, so it holds nothing of its own."""

log = logging.getLogger("kvpack")


class Writer:
    """The store verbs of `KVStore` (see the module docstring). Thread-safe.

    `tiers` fastest first; `memory` the per-process memory tier among them, `front` the tier in
    host memory a store reaches first, `lower` the tiers behind both (written from the queue).
    `write_back`: lower tiers from the queue (False: every tier before `store` returns);
    `read_only`: every store refused. `lends_memory`: `store_lent` writes into the memory tier's
    slots (`KVStore.lends_memory`). `after_batch`: called once per stored batch (the store
    counts evictions there)."""

    def __init__(
        self,
        config: KVPackConfig,
        metrics: Metrics,
        tiers: Sequence[Tier],
        *,
        memory: MemoryTier | None,
        front: Tier | None,
        lower: Sequence[Tier],
        integrity: IntegrityKey | None,
        write_back: bool,
        read_only: bool,
        lends_memory: bool,
        after_batch: Callable[[], None],
    ) -> None:
        self.metrics = metrics
        self.tiers = tuple(tiers)
        self._memory = memory
        self._front = front
        self._lower = tuple(lower)
        self._integrity = integrity
        self._write_back = write_back
        self._read_only = read_only
        self._lends_memory = lends_memory
        self._after_batch = after_batch
        self.events: TierEventFeed | None = None
        """What the tiers took (`KVStore.tier_events` sets it); None: nothing reported."""
        self._closed = False
        self._stamp_lock = threading.Lock()
        self._last_stamp = 0
        threads = config.io_threads if self._lower and front is not None and write_back else 0
        # Items queued behind the host store were sealed and checksummed before it took them,
        # and are copies: bounded in bytes (`HOST_QUEUE_BYTES`).
        host_front = front is not None and memory is None
        self._writeback = WriteBack(
            threads,
            config.write_queue_depth,
            lambda items: self.write_through(items, self._lower, sealed=host_front),
            max_bytes=HOST_QUEUE_BYTES if host_front else None,
        )

    @property
    def queues(self) -> bool:
        """Whether stores are queued for lower tiers (write-back threads run)."""
        return bool(self._writeback)

    @property
    def pending(self) -> int:
        """Objects accepted and not yet written to the lower tiers."""
        return self._writeback.pending

    def store(self, items: Sequence[PutItem]) -> list[TierStatus]:
        """Accept objects for storage; the caller's buffers may be reused on return.

        Returns per item: OK when accepted (in memory and/or queued for the lower
        tiers, or written to at least one lower tier when there is no memory
        tier), else the status of the failure. Never raises."""
        if self._closed or self._read_only:
            return [TierStatus.UNAVAILABLE] * len(items)
        if self._front is None or not self._write_back:
            return self.write_through(items, self.tiers)
        if self._memory is None:
            return self._store_host(items, self._front)
        start = time.perf_counter()
        mem = self._memory.put_from(items)
        self.metrics.observe("store_seconds", time.perf_counter() - start, tier=self._memory.name)
        keys = [it.key for it in items]
        if self.events is not None:
            self.events.stored_where(self._memory.name, keys, [st is TierStatus.OK for st in mem])
        # payload_len == the payload's size: put_from checked it
        self._count_stored(self._memory.name, keys, [it.header for it in items], mem)
        statuses = list(mem)
        if self._lower:
            self._queue_stored(items, mem, statuses)
        self._after_batch()
        return statuses

    def store_lent(
        self,
        keys: Sequence[StoreKey],
        headers: Sequence[ObjectHeader],
        fill: Callable[[list[np.ndarray]], None],
    ) -> list[TierStatus]:
        """`store`, the payloads written by the caller instead of copied from its buffers:
        `fill(dsts)` is called once with a writable uint8 array of exactly
        ``headers[i].payload_len`` bytes per object and must fill every one (a slot the
        memory tier reserved, or, where it refused the object or the store does not lend
        its memory, a fresh array). The memory tier shows an object only once `fill`
        returned; if `fill` raises, nothing is stored and the exception propagates. Per
        object: OK when accepted, as `store` answers."""
        n = len(keys)
        if self._closed or self._read_only:
            return [TierStatus.UNAVAILABLE] * n
        memory = self._memory
        if memory is None or not self._lends_memory:
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
            if not self._write_back:  # one checksum for every tier, as `write_through` gives
                items = checksummed(items)
            headers = [it.header for it in items]
        mem = memory.publish(keys, headers, slots, reserved)
        self.metrics.observe("store_seconds", time.perf_counter() - start, tier=memory.name)
        self._count_stored(memory.name, keys, headers, mem)
        statuses = list(mem)
        if self._lower and self._write_back:
            self._queue_stored(items, mem, statuses)
        elif self._lower:
            lower = self.write_through(items, self._lower)
            statuses = [m if m is TierStatus.OK or lo is not TierStatus.OK else lo for m, lo in zip(mem, lower)]
        self._after_batch()
        return statuses

    def write_through(self, items: Sequence[PutItem], tiers: Sequence[Tier], sealed: bool = False) -> list[TierStatus]:
        """Write a batch to `tiers` now, one `put_from` per tier; per item OK if at
        least one tier took it. Never raises. `sealed`: `items` went through `_sealed` already.

        With one tier, a missing payload checksum is left to that tier, which
        computes it where it writes (the disk tier on its I/O threads); with
        several it is computed once here and shared."""
        if not items:
            return []
        if not sealed:
            items = self._sealed(items, checksum=len(tiers) > 1)
        keys = [it.key for it in items]
        headers = [it.header for it in items]
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
                self.events.stored_where(tier.name, keys, [st is TierStatus.OK for st in got])
            if any(it.announce is not None for it in items):
                record_stored_facts(tier, items, [st is TierStatus.OK for st in got], self.metrics)
            self._count_stored(tier.name, keys, headers, got, errors=True)
            for i, status in enumerate(got):
                if best[i] is None or status is TierStatus.OK:
                    best[i] = status
        self._after_batch()
        return [b or TierStatus.ERROR for b in best]

    def flush(self, timeout_s: float) -> bool:
        """Wait (bounded) until every queued store reached its tiers. True if drained."""
        return self._writeback.flush(timeout_s)

    def count_cut_off(self) -> int:
        """Count what is still queued as lost at exit (``store_dropped{reason="shutdown"}`` per
        lower tier); returns how many objects that is."""
        left = self._writeback.pending
        for tier in self._lower:
            self.metrics.inc("store_dropped", left, tier=tier.name, reason="shutdown")
        return left

    @property
    def lower_names(self) -> list[str]:
        """The tiers the queue writes, by name."""
        return [t.name for t in self._lower]

    def close(self) -> None:
        """Refuse every later store and stop the write-back threads (callers flush first)."""
        self._closed = True
        self._writeback.close()

    def _count_stored(
        self,
        tier: str,
        keys: Sequence[StoreKey],
        headers: Sequence[ObjectHeader],
        statuses: Sequence[TierStatus],
        errors: bool = False,
    ) -> None:
        """The one count of what a tier took: ``stored_bytes`` and ``stored_objects`` per
        tenant, ``store_dropped`` per reason, and with `errors` (a tier written through) a
        ``tier_errors`` for a failure other than NO_SPACE; one count per label set of the
        batch (hundreds of pages a call)."""
        tally = Tally(self.metrics)
        for key, header, status in zip(keys, headers, statuses):
            if status is TierStatus.OK:
                tally.inc("stored_bytes", header.payload_len, tenant=key.tenant, tier=tier)
                tally.inc("stored_objects", tenant=key.tenant, tier=tier)
            else:
                tally.inc("store_dropped", tier=tier, reason=status.value)
                if errors and status is not TierStatus.NO_SPACE:
                    tally.inc("tier_errors", tier=tier, status=status.value)
        tally.flush()

    def _store_host(self, items: Sequence[PutItem], host: Tier) -> list[TierStatus]:
        """`store` with the host store in front: each item sealed and checksummed once, written
        to the host store now, then a copy of it queued for the lower tiers (the host store's
        pages are not this process's to lend: another process may evict and reuse them). What
        the queue has no room for (`HOST_QUEUE_BYTES`, `write_queue_depth`) this call writes
        to the lower tiers itself, as a store without write-back does: never dropped."""
        items = self._sealed(items, checksum=True)
        statuses = self.write_through(items, [host], sealed=True)
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
            lower = self.write_through([items[i] for i in now], self._lower, sealed=True)
            for i, status in zip(now, lower):
                if status is TierStatus.OK:
                    statuses[i] = TierStatus.OK
        return statuses

    def _queue_stored(self, items: Sequence[PutItem], mem: Sequence[TierStatus], statuses: list[TierStatus]) -> None:
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

    def _accept_stamps(self, n: int) -> range:
        """`n` wall-clock ns stamps, strictly increasing across every call of this store: the order
        in which `store` accepted its items. The write-back's threads reach a lower tier in their
        own order; the tier ranks recency by these stamps (`PutItem.accepted_ns`), so an older
        store arriving late never evicts a newer one."""
        with self._stamp_lock:
            first = max(self._last_stamp + 1, time.time_ns())
            self._last_stamp = first + n - 1
        return range(first, first + n)

    def _enqueue(self, item: PutItem) -> bool:
        if self._writeback.enqueue(item):
            return True
        for tier in self._lower:
            self.metrics.inc("store_dropped", tier=tier.name, reason="backpressure")
        return False

    def _sealed(self, items: Sequence[PutItem], checksum: bool) -> Sequence[PutItem]:
        """`items` sealed with the integrity key when there is one, and, if `checksum`, each
        with its payload checksum (computed once, here, for every tier they go to)."""
        if self._integrity is not None:
            items = seal_items(self._integrity, items)
        return checksummed(items) if checksum else items


def _owned_copy(item: PutItem, accepted_ns: int) -> PutItem:
    """`item` over a copy of its payload (for the write-back queue: the caller's buffers may be
    reused once `store` returns), accepted at `accepted_ns`."""
    owned = np.empty(item.nbytes, dtype=np.uint8)
    copy_parts_into(owned, item.payload)
    return PutItem(item.key, item.header, owned.data, accepted_ns, item.announce)


def record_stored_facts(tier: object, items: Sequence[PutItem], stored: Sequence[bool], metrics: Metrics) -> None:
    """The save path's part (`KVStore`, right after ``tier.put_from(items)``): record the facts
    (`PutItem.announce`) of the items `tier` stored (`stored[i]`), on a tier that keeps them
    (``record_facts``: the host store, the disk tier; elsewhere nothing). Counted as
    ``kvpack_shared_facts{outcome="recorded"}`` (or ``"not_recorded"`` on an index error). Never raises."""
    record = getattr(tier, "record_facts", None)
    if record is None:
        return
    rows = {it.key.group: it.announce for it, ok in zip(items, stored) if ok and it.announce is not None}
    if not rows:
        return
    name = str(getattr(tier, "name", "tier"))
    try:
        n = int(record(list(rows.items())))
    except Exception as exc:  # noqa: BLE001 - a busy index: the objects are stored, only unannounced elsewhere
        log.debug("kvpack: facts not recorded on %s: %s", name, exc)
        metrics.inc("shared_facts", len(rows), tier=name, outcome="not_recorded")
        return
    metrics.inc("shared_facts", n, tier=name, outcome="recorded")
