"""Host memory for the memory tier: fixed-size slots carved from large slabs,
within a stated bound of the tier's capacity.

Copying into fresh memory costs a page fault per 4 KiB page, which on a VM
caps a store at a fraction of memcpy speed (measured here: ~1.6 GB/s into
fresh buffers vs ~12 GB/s into reused ones). The arena therefore takes memory
from the system in slabs, asks for transparent huge pages and touches them
once, then hands out slots of one exact size per free list (KV chunks of one
engine are uniform). A slab for slots of `n` bytes is a whole number of slots,
so no slab wastes a tail; a size seen for the first time gets a one-slot
slab, and each further slab of that size doubles (as many slots as that size
has so far, up to ``slab_bytes // n``; one slot when ``2n > slab_bytes``):
uniform chunks reach whole slabs after a few stores, while a one-off size
costs exactly its bytes.

Bound (the invariant the tests check): ``reserved_bytes <= limit_bytes``
always. `slab_for_capacity` sizes both from the tier's capacity: slabs of
capacity/8 (4 KiB .. 64 MiB) and a limit of capacity + 2 slabs. When a new
slab would cross the limit, slabs whose every slot is free are handed back
to the system first (whatever their slot size); if that is not enough,
`alloc` returns None and the tier drops that store (NO_SPACE) rather than
grow. Many distinct object sizes therefore cost reuse, never memory.

A slot handed back with `release` is reused (or its slab freed) only once
nothing references it any more (a reader or a write-back job may still hold
the object it belonged to): until then it waits on a deferred list that
`alloc` sweeps, so no slot is ever reused early and none is lost.

On CUDA hosts slabs are pinned (`torch.empty(pin_memory=True)`), so a slab
costs one pinned allocation instead of one per object (torch's host cache may
keep a freed pinned slab for reuse).

Not thread-safe: the memory tier calls it under its own lock.
"""

from __future__ import annotations

import mmap
import sys
from dataclasses import dataclass

import numpy as np

SLAB_BYTES = 64 << 20
MIN_SLAB_BYTES = 4096
_TOUCH_STRIDE = 4096


def slab_for_capacity(capacity: int) -> tuple[int, int]:
    """(slab_bytes, limit_bytes) for a tier of `capacity` bytes (see the module docstring)."""
    slab = min(SLAB_BYTES, max(MIN_SLAB_BYTES, capacity // 8))
    return slab, capacity + 2 * slab


def _system_slab(nbytes: int, pin: bool) -> np.ndarray:
    if pin:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # pragma: no cover - kernels without THP
            pass
    arr = np.frombuffer(region, dtype=np.uint8)
    arr[::_TOUCH_STRIDE] = 0  # fault the pages in now, once, not on the store path
    return arr


@dataclass(slots=True)
class _Slab:
    """One allocation from the system: `slots` slots of `slot_bytes`, `free` of them in a free list."""

    slot_bytes: int
    slots: int
    free: int

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.slots


class SlabArena:
    """Slots of exact sizes within `limit_bytes`; see the module docstring."""

    def __init__(self, pin: bool = False, slab_bytes: int = SLAB_BYTES, limit_bytes: int | None = None) -> None:
        self._pin = pin
        self._slab_bytes = slab_bytes
        self.limit_bytes = limit_bytes
        """Most bytes the arena ever takes from the system (None: unbounded)."""
        self._free: dict[int, list[np.ndarray]] = {}
        self._deferred: list[np.ndarray] = []
        self._slab_of: dict[int, _Slab] = {}
        """id(slot) -> its slab, for every slot the arena made and has not handed back to the system."""
        self._slabs: list[_Slab] = []
        self._grown: dict[int, int] = {}
        """Slots made so far per slot size with a slab still held (the next slab's size)."""
        self.reserved_bytes = 0
        """Bytes taken from the system and not yet handed back."""

    def alloc(self, nbytes: int) -> np.ndarray | None:
        """A writable uint8 array of exactly `nbytes` (contents undefined), or None when
        it cannot be had within `limit_bytes`."""
        bucket = self._free.get(nbytes)
        if not bucket and self._deferred:
            self._sweep()
            bucket = self._free.get(nbytes)
        if bucket:
            slot = bucket.pop()
            self._slab_of[id(slot)].free -= 1
            return slot
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        count = 1 if nbytes * 2 > self._slab_bytes else min(self._slab_bytes // nbytes, max(1, self._grown.get(nbytes, 0)))
        need = nbytes * count
        if self.limit_bytes is not None and self.reserved_bytes + need > self.limit_bytes:
            self._reclaim(self.reserved_bytes + need - self.limit_bytes)
            if self.reserved_bytes + need > self.limit_bytes:
                if count == 1:
                    return None
                count = max(1, (self.limit_bytes - self.reserved_bytes) // nbytes)
                need = nbytes * count
                if self.reserved_bytes + need > self.limit_bytes:
                    return None
        region = _system_slab(need, self._pin)
        self.reserved_bytes += need
        slab = _Slab(nbytes, count, count - 1)
        self._slabs.append(slab)
        self._grown[nbytes] = self._grown.get(nbytes, 0) + count
        slots = [region[i * nbytes : (i + 1) * nbytes] for i in range(count)]
        for s in slots:
            self._slab_of[id(s)] = slab
        if count > 1:
            self._free.setdefault(nbytes, []).extend(reversed(slots[1:]))
        return slots[0]

    def release(self, slot: np.ndarray) -> None:
        """Hand a slot back; it is reused once nothing else references it."""
        if slot.nbytes:
            self._deferred.append(slot)

    def _sweep(self) -> None:
        waiting: list[np.ndarray] = []
        for slot in self._deferred:
            # references: the deferred list, this loop variable, getrefcount's argument
            if sys.getrefcount(slot) <= 3:
                self._free.setdefault(slot.nbytes, []).append(slot)
                slab = self._slab_of.get(id(slot))
                if slab is not None:
                    slab.free += 1
            else:
                waiting.append(slot)
        self._deferred = waiting

    def _reclaim(self, want: int) -> None:
        """Hand slabs whose every slot is free back to the system until `want` bytes are freed."""
        self._sweep()
        idle = [s for s in self._slabs if s.free == s.slots]
        if not idle:
            return
        freed = 0
        drop: set[int] = set()
        for slab in idle:
            if freed >= want:
                break
            drop.add(id(slab))
            freed += slab.nbytes
        for size in {s.slot_bytes for s in idle if id(s) in drop}:
            keep = []
            for slot in self._free.get(size, []):
                slab = self._slab_of[id(slot)]
                if id(slab) in drop:
                    del self._slab_of[id(slot)]
                else:
                    keep.append(slot)
            if keep:
                self._free[size] = keep
            else:
                self._free.pop(size, None)
        self._slabs = [s for s in self._slabs if id(s) not in drop]
        self.reserved_bytes -= freed
        held = {s.slot_bytes for s in self._slabs}
        for size in [n for n in self._grown if n not in held]:
            del self._grown[size]

    def free_bytes(self) -> int:
        """Bytes in slots ready for reuse (after sweeping released ones)."""
        self._sweep()
        return sum(len(b) * size for size, b in self._free.items())
