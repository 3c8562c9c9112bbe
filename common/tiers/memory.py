"""Host-RAM tier: objects in this process's memory (pageable unless `pin` is asked for).

Capacity is enforced over whole groups by a `CapacityManager` (LRU or ARC,
per-tenant guaranteed shares), which sees each group by its id string
(``tenant/fingerprint/chunk``); evictions are reported as `GroupKey`s.
Payload checksums are computed lazily: an object that never leaves this
process is never hashed; the tiered store hashes it when it is written to
disk or Mooncake. Headers are always checked
against the reader's expectation.

A batch is one bookkeeping pass under the lock (capacity and eviction for
the whole batch at once, slots; new slabs it needs are made before that
pass, outside the lock: `SlabArena.order`), then its copies outside the lock, spread
over `copy_threads` threads (`kvpack.tiers.parallel`), then one pass that
makes every object visible: concurrent puts and gets of different objects
proceed in parallel, and an object is visible only once fully copied.

`pin` keeps the groups of objects about to be loaded from eviction until
`unpin` or a deadline (`kvpack.store.lifecycle`: prepare_load -> complete_load);
a store that would need a pinned group's room is dropped (NO_SPACE) instead.

Payload memory comes from a `SlabArena` (large pre-faulted slabs, one
free list per slot size; not pinned: a GPU transfer stages through the
transfer runner's own bounded pinned pool, never straight from a slot), so a store never pays a
page fault per 4 KiB. Memory bound: the arena never holds more than
``capacity + 2 * slab`` bytes, slab = capacity / 8 clamped to 4 KiB .. 64 MiB
(`kvpack.tiers.arena.slab_for_capacity`), however many distinct object sizes
are stored; a store the arena cannot place within it is dropped (NO_SPACE).
A slot of an evicted or overwritten object is reused only
once nothing else holds it (a reader mid-copy, or a borrowed view in the
write-back queue); the arena checks, so slots are neither reused early nor lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from ..identity.keys import GroupKey, StoreKey
from ..identity.objects import (
    Expectation,
    ObjectHeader,
    PageExpectation,
    Payload,
    RejectReason,
    check_header,
    check_payloads,
    payload_parts,
)
from ..policy.clearing import Cleared, ClearScope
from ..policy.eviction import CapacityManager, EvictionPolicy
from .arena import SlabArena, slab_for_capacity
from .base import GetResult, Medium, PutItem, Tier, TierStatus, TierUsage
from .parallel import CopyPair, IOThreads, RegionCopier


@dataclass(slots=True)
class _Entry:
    """One stored object (never mutated: not frozen only because frozen init is slower)."""

    header: ObjectHeader
    data: np.ndarray  # 1-D uint8, exactly header.payload_len bytes
    gid: str  # the group's id (`_gid`)


def _gid(key: StoreKey | GroupKey) -> str:
    """A group's id inside this tier: ``tenant/fingerprint/chunk``.

    Unique (no key field may contain '/') and cheap to hash repeatedly (a str
    caches its hash; a key dataclass rehashes its fields on every dict access),
    which matters with ~20 dict operations per stored object."""
    return f"{key.tenant}/{key.fingerprint}/{key.chunk}"


class MemoryTier(Tier):
    name = "memory"
    medium = Medium.HOST
    front = True

    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy,
        quotas: dict[str, int] | None = None,
        pin: bool = False,
        copy_threads: int = 1,
        region_copier: Callable[[], RegionCopier | None] | None = None,
    ) -> None:
        """`copy_threads` and `region_copier`: see `kvpack.tiers.parallel.IOThreads`
        (stores stream into the tier's slots when a native copier is available). `pin`:
        page-lock the slabs (for a device that copies straight from the tier; none does)."""
        self._lock = threading.Lock()
        self._objects: dict[StoreKey, _Entry] = {}
        self._members: dict[str, set[StoreKey]] = {}  # by group id (`_gid`)
        self._capacity = CapacityManager(capacity, policy, quotas)
        slab, limit = slab_for_capacity(capacity)
        self._arena = SlabArena(pin=pin, slab_bytes=slab, limit_bytes=limit)
        self._io = IOThreads(copy_threads, name="kvpack-memcopy", region_copier=region_copier)
        self._closed = False
        self.on_evict: Callable[[GroupKey, int], None] | None = None
        """Called under the tier lock for each evicted group with its bytes; must be cheap."""

    def keep(self, kept: Callable[[], frozenset[str]]) -> None:
        """Never evict the groups `kept()` names (``tenant/fingerprint/chunk``: `kvpack.store.pins`)."""
        with self._lock:
            self._capacity.kept = kept

    # -- reads ---------------------------------------------------------------

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        with self._lock:
            objects = self._objects
            return [k in objects for k in keys]

    def peek_headers(self, keys: Sequence[StoreKey]) -> list[ObjectHeader | None]:
        with self._lock:
            return [e.header if (e := self._objects.get(k)) else None for k in keys]

    def borrow(self, key: StoreKey) -> tuple[ObjectHeader, memoryview] | None:
        """The stored header and a read-only view of the payload, without a copy.

        The view stays valid after eviction: while it lives, its slot is not reused."""
        return self.borrow_many([key])[0]

    def borrow_many(self, keys: Sequence[StoreKey]) -> list[tuple[ObjectHeader, memoryview] | None]:
        """`borrow` for a batch, under one lock."""
        with self._lock:
            entries = [self._objects.get(k) for k in keys]
        return [(e.header, e.data.data.toreadonly()) if e is not None else None for e in entries]

    def get_into(
        self,
        keys: Sequence[StoreKey],
        dsts: Sequence[Payload],
        expected: Sequence[Expectation],
        verify_checksum: bool,
    ) -> list[GetResult]:
        """Headers checked per object, then every copy of the batch at once.

        `entries` keeps each source slot referenced until its copy is done, so a
        concurrent eviction cannot hand the slot to another object mid-copy
        (slices of a slot do not reference the slot itself)."""
        with self._lock:
            get = self._objects.get
            entries = [get(k) for k in keys]
            self._capacity.touch_many([e.gid for e in entries if e is not None])
        results: list[GetResult] = []
        pairs: list[CopyPair] = []
        copied: list[int] = []
        total = 0
        frombuffer, u8 = np.frombuffer, _U8
        for i, (entry, dst, exp) in enumerate(zip(entries, dsts, expected)):
            if entry is None:
                results.append(_MISS)
                continue
            header = entry.header
            reason = check_header(header, exp)
            if reason is not None:
                results.append(GetResult(TierStatus.REJECTED, header, reason))
                continue
            try:  # inlined `_byte_arrays`
                parts = [frombuffer(p, u8) for p in dst] if isinstance(dst, tuple) else [frombuffer(dst, u8)]
            except (ValueError, TypeError):
                parts = _byte_arrays(dst)
            size = parts[0].nbytes if len(parts) == 1 else sum([p.nbytes for p in parts])
            if size != header.payload_len:
                results.append(
                    GetResult(
                        TierStatus.REJECTED,
                        header,
                        RejectReason.LENGTH,
                        f"payload {header.payload_len} bytes, destination {size}",
                    )
                )
                continue
            data, offset = entry.data, 0
            for part in parts:
                n = part.nbytes
                pairs.append((part, data[offset : offset + n]))
                offset += n
            total += size
            copied.append(i)
            results.append(GetResult(TierStatus.OK, header))
        self._io.copy(pairs, total)  # cached stores: the caller (or the checksum below) reads them next
        del pairs
        if verify_checksum:
            headers: list[ObjectHeader] = []
            for i in copied:
                got = results[i].header
                assert got is not None
                headers.append(got)
            for i, header, bad in zip(copied, headers, check_payloads(headers, [dsts[i] for i in copied])):
                if bad is not None:
                    results[i] = GetResult(TierStatus.REJECTED, header, bad)
        return results

    # -- writes --------------------------------------------------------------

    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        """Store a batch: capacity (`CapacityManager.admit`, one reservation per
        tenant of the batch when it fits) and slots under one lock (`reserve`), the
        copies outside it (on `copy_threads` threads), then every object made visible
        under one lock (`publish`)."""
        parts: list[list[np.ndarray]] = []
        sizes: list[int] = []
        frombuffer, u8 = np.frombuffer, _U8
        for item in items:
            payload = item.payload
            try:  # inlined `_byte_arrays` (a call per item adds up at hundreds of pages)
                arrays = (
                    [frombuffer(p, u8) for p in payload] if isinstance(payload, tuple) else [frombuffer(payload, u8)]
                )
            except (ValueError, TypeError):
                arrays = _byte_arrays(payload)
            parts.append(arrays)
            sizes.append(arrays[0].nbytes if len(arrays) == 1 else sum([a.nbytes for a in arrays]))
        keys = [item.key for item in items]
        headers = [item.header for item in items]
        statuses, slots = self._reserve(keys, headers, sizes)
        pairs: list[CopyPair] = []
        total = 0
        add_pair = pairs.append
        for slot, ps in zip(slots, parts):
            if slot is None:
                continue
            if len(ps) == 1:
                add_pair((slot, ps[0]))
            else:
                offset = 0
                for part in ps:
                    m = part.nbytes
                    add_pair((slot[offset : offset + m], part))
                    offset += m
            total += slot.nbytes
        self._io.copy(pairs, total, streaming=True)
        del pairs
        return self.publish(keys, headers, slots, statuses)

    def reserve(
        self, keys: Sequence[StoreKey], headers: Sequence[ObjectHeader]
    ) -> tuple[list[TierStatus], list[np.ndarray | None]]:
        """A lent put, first half: admit a batch as `put_from` does and lend the caller
        each admitted object's slot (a writable uint8 array of exactly
        ``headers[i].payload_len`` bytes; None where the status is not OK), so it
        writes the payload in place instead of handing over a buffer to copy. Nothing
        is visible until `publish` with the same lists (call it exactly once, also
        when the caller could not fill every slot: it marks those not OK first)."""
        return self._reserve(keys, headers, [h.payload_len for h in headers])

    def _reserve(
        self, keys: Sequence[StoreKey], headers: Sequence[ObjectHeader], sizes: Sequence[int]
    ) -> tuple[list[TierStatus], list[np.ndarray | None]]:
        """Capacity and slots for a batch (`sizes`: each payload's bytes, ERROR where it is
        not the header's length), new slabs made outside the lock (`SlabArena.order`)."""
        n = len(keys)
        statuses = [TierStatus.OK] * n
        slots: list[np.ndarray | None] = [None] * n
        groups = [f"{k.tenant}/{k.fingerprint}/{k.chunk}" for k in keys]  # == _gid(key)
        with self._lock:
            if self._closed:
                return [TierStatus.UNAVAILABLE] * n, slots
            # slabs only for what fits without evicting: an evicted group's slots are reused
            room, fresh = self._capacity.capacity - self._capacity.used, []
            for size, header in zip(sizes, headers):
                if size == header.payload_len and size <= room:
                    fresh.append(size)
                    room -= size
            orders = self._arena.order(fresh)
        if orders:  # new slabs are faulted in here, outside the lock: no get, pin or lookup waits for it
            self._arena.make(orders)
        with self._lock:
            self._arena.adopt(orders)
            if self._closed:
                return [TierStatus.UNAVAILABLE] * n, slots
            todo: dict[str, list[int]] = {}
            for i, key in enumerate(keys):
                if sizes[i] != headers[i].payload_len:
                    statuses[i] = TierStatus.ERROR
                else:
                    todo.setdefault(key.tenant, []).append(i)
            for tenant, idx in todo.items():
                requests = [(groups[i], keys[i].member, sizes[i]) for i in idx]
                for i, ok in zip(idx, self._capacity.admit(tenant, requests, self._evict_locked)):
                    if not ok:
                        statuses[i] = TierStatus.NO_SPACE
            alloc, has_member = self._arena.alloc, self._capacity.has_member
            for idx in todo.values():
                for i in idx:
                    if statuses[i] is not TierStatus.OK:
                        continue
                    if not has_member(groups[i], keys[i].member):
                        statuses[i] = TierStatus.NO_SPACE  # evicted by a later item of this batch: nothing to copy
                        continue
                    slot = slots[i] = alloc(sizes[i])
                    if slot is None:  # no room within the arena's bound: drop the store (and its group, all or nothing)
                        self._drop_groups_locked([groups[i]])
                        statuses[i] = TierStatus.NO_SPACE
        return statuses, slots

    def publish(
        self,
        keys: Sequence[StoreKey],
        headers: Sequence[ObjectHeader],
        slots: Sequence[np.ndarray | None],
        statuses: Sequence[TierStatus],
    ) -> list[TierStatus]:
        """A reserved batch's second half: every filled object (status OK, a slot) made
        visible under one lock with its header (which may now carry a checksum); a slot
        whose status is not OK is handed back, and its group dropped (all or nothing).
        Returns the final statuses."""
        out = list(statuses)
        with self._lock:
            has_member = self._capacity.has_member
            objects, members = self._objects, self._members
            for i, (key, slot) in enumerate(zip(keys, slots)):
                if slot is None:
                    continue
                group = f"{key.tenant}/{key.fingerprint}/{key.chunk}"
                if out[i] is not TierStatus.OK:  # not filled: no half-written object becomes visible
                    self._arena.release(slot)
                    self._drop_groups_locked([group])
                    continue
                if not has_member(group, key.member):
                    # evicted while copying (by a later item of this batch, or a concurrent put)
                    self._arena.release(slot)
                    out[i] = TierStatus.NO_SPACE
                    continue
                old = objects.get(key)
                objects[key] = _Entry(headers[i], slot, group)
                group_keys = members.get(group)
                if group_keys is None:
                    members[group] = {key}
                else:
                    group_keys.add(key)
                if old is not None:
                    self._arena.release(old.data)
        return out

    def lend(
        self, keys: Sequence[StoreKey], expected: Sequence[Expectation]
    ) -> list[tuple[ObjectHeader, memoryview] | None]:
        """A lent get: per key, the stored header and a read-only view of the payload when
        the header passes `expected` (touched for eviction as `get_into` does), else None
        (missing, refused: the caller reads it with `get_into`, which counts why). No copy:
        the caller reads the slot itself. While the view lives its slot is not reused,
        even if the object is evicted or overwritten meanwhile (`SlabArena`)."""
        with self._lock:
            get = self._objects.get
            entries = [get(k) for k in keys]
            self._capacity.touch_many([e.gid for e in entries if e is not None])
        out: list[tuple[ObjectHeader, memoryview] | None] = []
        for entry, exp in zip(entries, expected):
            if entry is None or check_header(entry.header, exp) is not None:
                out.append(None)
            else:
                out.append((entry.header, entry.data.data.toreadonly()))
        return out

    def lend_pages(self, keys: Sequence[StoreKey], expected: PageExpectation) -> list[memoryview | None]:
        """`lend` for whole pages of one member: per key, a read-only view of the stored
        payload when its header matches `expected` with the key's chunk (the check `lend`
        makes, `PageExpectation.matches`), else None; no header and no `Expectation` per page."""
        with self._lock:
            get = self._objects.get
            entries = [get(k) for k in keys]
            self._capacity.touch_many([e.gid for e in entries if e is not None])
        matches = expected.matches
        return [
            e.data.data.toreadonly() if e is not None and matches(e.header, k.chunk) else None
            for k, e in zip(keys, entries)
        ]

    def _evict_locked(self, gids: Sequence[Hashable]) -> None:
        # The capacity manager hands back victims among the groups this tier admitted: its str gids.
        self._drop_groups_locked(cast("Sequence[str]", gids), evicted=True)

    def _drop_groups_locked(self, gids: Sequence[str], evicted: bool = False) -> int:
        """Forget whole groups and hand their slots back (one `SlabArena.release_many` for
        the batch); returns objects removed. `on_evict` hears of each group (`evicted`)."""
        released = self._capacity.release_many(gids)
        on_evict = self.on_evict if evicted else None
        if on_evict is not None:
            for group, sizes in zip(GroupKey.batch([gid.split("/") for gid in gids]), released):
                on_evict(group, sum(sizes.values()))
        members_pop, objects_pop = self._members.pop, self._objects.pop
        slots: list[np.ndarray] = []
        add = slots.append
        removed = 0
        for gid in gids:
            keys = members_pop(gid, ())
            removed += len(keys)
            for k in keys:
                entry = objects_pop(k, None)
                if entry is not None:
                    add(entry.data)
        self._arena.release_many(slots)
        return removed

    def remove_groups(self, groups: Sequence[GroupKey]) -> int:
        with self._lock:
            return self._drop_groups_locked([_gid(g) for g in groups])

    def clear(self, scope: ClearScope, dry_run: bool = False) -> Cleared:
        """Remove (or count) the groups `scope` matches, found in this tier's map under its lock;
        a group pinned by a load in progress goes too (the load already holds its slots' views)."""
        with self._lock:
            gids = [gid for gid in self._members if scope.matches(*gid.split("/", 2)[:2])]
            objects = self._objects
            keys = [k for gid in gids for k in self._members[gid]]
            nbytes = sum(objects[k].header.payload_len for k in keys if k in objects)
            if not dry_run:
                self._drop_groups_locked(gids)
        return Cleared(len(keys), nbytes, tuple(GroupKey(*gid.split("/", 2)).as_str() for gid in gids))

    def pin(self, keys: Sequence[StoreKey], until: float) -> list[bool]:
        """Per key: stored here, and its group now pinned until `unpin` or the monotonic
        time `until` (see `CapacityManager.pin`)? Each True needs one `unpin`."""
        with self._lock:
            objects, pin = self._objects, self._capacity.pin
            return [k in objects and pin(_gid(k), until) for k in keys]

    def unpin(self, keys: Sequence[StoreKey]) -> None:
        """Release the pins `pin` answered True for (one per key)."""
        with self._lock:
            unpin = self._capacity.unpin
            for k in keys:
                unpin(_gid(k))

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(
                used_bytes=self._capacity.used,
                capacity_bytes=self._capacity.capacity,
                objects=len(self._objects),
                groups=len(self._members),
            )

    def tenant_used(self, tenant: str) -> int:
        with self._lock:
            return self._capacity.tenant_used(tenant)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._objects.clear()
            self._members.clear()
        self._io.close()


_MISS = GetResult(TierStatus.MISS)


_U8 = np.dtype(np.uint8)


def _byte_arrays(payload: Payload) -> list[np.ndarray]:
    """A payload's regions as 1-D uint8 arrays over the caller's memory (no copy)."""
    frombuffer = np.frombuffer
    try:
        if isinstance(payload, tuple):
            return [frombuffer(p, _U8) for p in payload]
        return [frombuffer(payload, _U8)]
    except (ValueError, TypeError):  # e.g. a non-contiguous view: take the general path
        return [frombuffer(p, _U8) for p in payload_parts(payload)]
