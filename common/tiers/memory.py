"""Host-RAM tier: objects in this process's memory, pinned when CUDA exists.

Capacity is enforced over whole groups by a `CapacityManager` (LRU or ARC,
per-tenant guaranteed shares). Payload checksums are computed lazily: an
object that never leaves this process is never hashed; the tiered store
hashes it when it is written to disk or Mooncake. Headers are always checked
against the reader's expectation.

Copies run outside the lock, so concurrent puts and gets of different
objects proceed in parallel; an object is visible only once fully copied.

Payload memory comes from a `SlabArena` (large pre-faulted, huge-page slabs,
pinned on CUDA hosts, one free list per slot size), so a store never pays a
page fault per 4 KiB. A slot of an evicted or overwritten object is reused only
once nothing else holds it (a reader mid-copy, or a borrowed view in the
write-back queue); the arena checks, so slots are neither reused early nor lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..eviction import CapacityManager, EvictionPolicy
from ..eviction.manager import Admission
from ..keys import GroupKey, StoreKey
from ..objects import (
    Expectation,
    ObjectHeader,
    Payload,
    check_header,
    check_payload,
    copy_into_parts,
    copy_parts_into,
    payload_nbytes,
)
from .arena import SlabArena
from .base import GetResult, PutItem, Tier, TierStatus, TierUsage, check_fits


@dataclass(frozen=True, slots=True)
class _Entry:
    header: ObjectHeader
    data: np.ndarray  # 1-D uint8, exactly header.payload_len bytes


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch import problems mean no CUDA
        return False


class MemoryTier(Tier):
    name = "memory"

    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy,
        quotas: dict[str, int] | None = None,
        pin: bool | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._objects: dict[StoreKey, _Entry] = {}
        self._members: dict[GroupKey, set[StoreKey]] = {}
        self._capacity = CapacityManager(capacity, policy, quotas)
        self._arena = SlabArena(pin=_cuda_available() if pin is None else pin)
        self._closed = False
        self.on_evict: Callable[[GroupKey, int], None] | None = None
        """Called under the tier lock for each evicted group with its bytes; must be cheap."""

    # -- reads ---------------------------------------------------------------

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        with self._lock:
            return [k in self._objects for k in keys]

    def peek_headers(self, keys: Sequence[StoreKey]) -> list[ObjectHeader | None]:
        with self._lock:
            return [e.header if (e := self._objects.get(k)) else None for k in keys]

    def borrow(self, key: StoreKey) -> tuple[ObjectHeader, memoryview] | None:
        """The stored header and a read-only view of the payload, without a copy.

        The view stays valid after eviction: while it lives, its slot is not reused."""
        with self._lock:
            entry = self._objects.get(key)
            if entry is None:
                return None
            return entry.header, memoryview(entry.data).toreadonly()

    def get_into(
        self,
        keys: Sequence[StoreKey],
        dsts: Sequence[Payload],
        expected: Sequence[Expectation],
        verify_checksum: bool,
    ) -> list[GetResult]:
        with self._lock:
            entries = [self._objects.get(k) for k in keys]
            for k, e in zip(keys, entries):
                if e is not None:
                    self._capacity.touch(k.group)
        results: list[GetResult] = []
        for entry, dst, exp in zip(entries, dsts, expected):
            if entry is None:
                results.append(GetResult(TierStatus.MISS))
                continue
            reason = check_header(entry.header, exp)
            if reason is not None:
                results.append(GetResult(TierStatus.REJECTED, entry.header, reason))
                continue
            misfit = check_fits(dst, entry.header)
            if misfit is not None:
                results.append(misfit)
                continue
            copy_into_parts(dst, entry.data)
            if verify_checksum and entry.header.checksum is not None:
                bad = check_payload(entry.header, dst)
                if bad is not None:
                    results.append(GetResult(TierStatus.REJECTED, entry.header, bad))
                    continue
            results.append(GetResult(TierStatus.OK, entry.header))
        return results

    # -- writes --------------------------------------------------------------

    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        """Store a batch: capacity and slots under one lock, the copies outside
        it, then every object made visible under one lock."""
        statuses = [TierStatus.OK] * len(items)
        slots: list[np.ndarray | None] = [None] * len(items)
        with self._lock:
            if self._closed:
                return [TierStatus.UNAVAILABLE] * len(items)
            for i, item in enumerate(items):
                key, nbytes = item.key, payload_nbytes(item.payload)
                if nbytes != item.header.payload_len:
                    statuses[i] = TierStatus.ERROR
                    continue
                plan = self._capacity.reserve(key.group, key.tenant, key.member, nbytes)
                if plan.admission is Admission.NO_SPACE:
                    statuses[i] = TierStatus.NO_SPACE
                    continue
                for victim in plan.victims:
                    self._drop_group_locked(victim, evicted=True)  # type: ignore[arg-type]
                self._capacity.commit(key.group, key.tenant, key.member, nbytes)
                slots[i] = self._arena.alloc(nbytes)
        for item, slot in zip(items, slots):
            if slot is not None:
                copy_parts_into(slot, item.payload)
        with self._lock:
            for i, (item, slot) in enumerate(zip(items, slots)):
                if slot is None:
                    continue
                key = item.key
                if not self._capacity.has_member(key.group, key.member):
                    # evicted while copying (by a later item of this batch, or a concurrent put)
                    self._arena.release(slot)
                    statuses[i] = TierStatus.NO_SPACE
                    continue
                old = self._objects.get(key)
                self._objects[key] = _Entry(item.header, slot)
                self._members.setdefault(key.group, set()).add(key)
                if old is not None:
                    self._arena.release(old.data)
        return statuses

    def _drop_group_locked(self, group: GroupKey, evicted: bool = False) -> int:
        members = self._capacity.release(group)
        if evicted and self.on_evict is not None:
            self.on_evict(group, sum(members.values()))
        keys = self._members.pop(group, set())
        for k in keys:
            entry = self._objects.pop(k, None)
            if entry is not None:
                self._arena.release(entry.data)
        return len(keys)

    def remove_groups(self, groups: Sequence[GroupKey]) -> int:
        with self._lock:
            return sum(self._drop_group_locked(g) for g in groups)

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
