"""Host memory for the memory tier: fixed-size slots carved from large slabs,
within a stated bound of the tier's capacity.

Copying into fresh memory costs a page fault per 4 KiB page, which caps a
store at a fraction of memcpy speed into reused memory. The arena therefore takes memory
from the system in slabs, faults them in once, then hands out slots of one
exact size per free list (KV chunks of one engine are uniform). A slab for
slots of `n` bytes is a whole number of slots, so no slab wastes a tail; a
size seen for the first time gets a one-slot slab, and each further slab of
that size doubles (as many slots as that size has so far, up to
``slab_bytes // n``; one slot when ``2n > slab_bytes``): uniform chunks reach
whole slabs after a few stores, while a one-off size costs exactly its bytes.

Slabs are 4 KiB pages (``MADV_NOHUGEPAGE``), never transparent huge pages:
where the kernel has no free huge page, a huge-page fault makes the faulting
thread compact memory first: in an engine, CPU taken from the cores the forward
pass runs on, for a first fill several times what 4 KiB pages cost. Copies into
the tier run at the same speed either way (both: benchmarks/RESULTS.md, "what
saving costs, after slabs left huge pages").

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

With ``pin=True`` slabs are pinned (`torch.empty(pin_memory=True)`), so a slab
costs one pinned allocation instead of one per object; the memory tier asks for
it only when told to (a GPU copy stages through its own pool, not the tier).

Making a slab takes milliseconds (the kernel zeroes and maps every page; on
Linux ``MADV_POPULATE_WRITE`` does it in 4 MiB steps, so the process's mmap
lock is never held long, else each page is touched), far longer than a lock may
be held on the data path. So it is split in three: `order` reserves the slabs a
batch needs against the bound, `make` creates them touching no arena state
(the caller holds no lock, so a reader never waits for page faults), `adopt`
adds them to the free lists.
`alloc` still grows in place when no slab was ordered (a race with another
batch): correct, only slower.

Not thread-safe, but for `make`: the memory tier calls the rest under its own lock.
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

SLAB_BYTES = 64 << 20
MIN_SLAB_BYTES = 4096
_TOUCH_STRIDE = 4096
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)
"""Linux >= 5.14 (Python < 3.12 does not name it): fault a range in, writable, in one call."""
_POPULATE_STEP = 4 << 20
"""Bytes faulted in per ``madvise`` call: one call's page faults are bounded by this."""


def slab_for_capacity(capacity: int) -> tuple[int, int]:
    """(slab_bytes, limit_bytes) for a tier of `capacity` bytes (see the module docstring)."""
    slab = min(SLAB_BYTES, max(MIN_SLAB_BYTES, capacity // 8))
    return slab, capacity + 2 * slab


def _system_slab(nbytes: int, pin: bool) -> np.ndarray:
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:  # 4 KiB pages even where THP is "always": a huge-page fault may compact memory first
            region.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:  # pragma: no cover - kernels without THP
            pass
    arr = np.frombuffer(region, dtype=np.uint8)
    # fault the pages in now, once, not on the store path
    if _MADV_POPULATE_WRITE is not None:
        try:
            # in steps: the call holds the process's mmap lock, which an allocation on the
            # engine's forward path (an mmap) would otherwise wait for over the whole slab
            for start in range(0, nbytes, _POPULATE_STEP):
                region.madvise(_MADV_POPULATE_WRITE, start, min(_POPULATE_STEP, nbytes - start))
            return arr
        except (OSError, ValueError):  # an older kernel: EINVAL
            pass
    arr[::_TOUCH_STRIDE] = 0
    return arr


@dataclass(slots=True)
class SlabOrder:
    """A slab of `slots` slots of `slot_bytes`, its bytes reserved by `SlabArena.order`;
    `region` is set by `SlabArena.make` (None until then, or when the system refused)."""

    slot_bytes: int
    slots: int
    region: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.slots


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
        self._pending: dict[int, int] = {}
        """Slots per slot size in slabs ordered (bytes reserved) and not yet adopted."""
        self.reserved_bytes = 0
        """Bytes taken from the system (or ordered from it) and not yet handed back."""

    def alloc(self, nbytes: int) -> np.ndarray | None:
        """A writable uint8 array of exactly `nbytes` (contents undefined), or None when
        it cannot be had within `limit_bytes`."""
        slot = self._pop_free(nbytes)
        if slot is not None:
            return slot
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        orders = self.order([nbytes])  # growing in place, under the caller's lock
        self.make(orders)
        self.adopt(orders)
        return self._pop_free(nbytes)  # None when no slab fits the bound or the system refused it

    def order(self, sizes: Sequence[int]) -> list[SlabOrder]:
        """The slabs that `alloc` of every size in `sizes` would make (beyond the free slots),
        their bytes reserved now against `limit_bytes`; pass them to `make` outside the
        caller's lock, then to `adopt` under it. As many as fit within the bound."""
        want: dict[int, int] = {}
        for n in sizes:
            if n > 0:
                want[n] = want.get(n, 0) + 1
        if self._deferred and any(len(self._free.get(n, ())) < k for n, k in want.items()):
            self._sweep()
        orders: list[SlabOrder] = []
        for n, k in want.items():
            ordered = 0
            # the free slots are counted again each time: a reclaim may hand idle slabs back
            while k - len(self._free.get(n, ())) - ordered > 0:
                count = self._next_slab_slots(n)
                if not count:
                    break
                orders.append(SlabOrder(n, count))
                self.reserved_bytes += n * count
                self._pending[n] = self._pending.get(n, 0) + count
                ordered += count
        return orders

    def make(self, orders: Sequence[SlabOrder]) -> None:
        """Create the ordered slabs (page faults: call it without the lock the rest of the
        arena is used under; it reads only the arena's immutable `pin` flag)."""
        for o in orders:
            try:
                o.region = _system_slab(o.nbytes, self._pin)
            except (MemoryError, OSError):  # adopt hands the reservation back
                o.region = None

    def adopt(self, orders: Sequence[SlabOrder]) -> None:
        """Add made slabs to the free lists; hand back the reservation of any the system refused."""
        for o in orders:
            n = o.slot_bytes
            self._pending[n] -= o.slots
            if not self._pending[n]:
                del self._pending[n]
            if o.region is None:
                self.reserved_bytes -= o.nbytes
                continue
            slab = _Slab(n, o.slots, o.slots)
            self._slabs.append(slab)
            self._grown[n] = self._grown.get(n, 0) + o.slots
            slots = [o.region[i * n : (i + 1) * n] for i in range(o.slots)]
            for slot in slots:
                self._slab_of[id(slot)] = slab
            self._free.setdefault(n, []).extend(reversed(slots))
            o.region = None

    def _pop_free(self, nbytes: int) -> np.ndarray | None:
        bucket = self._free.get(nbytes)
        if not bucket and self._deferred:
            self._sweep()
            bucket = self._free.get(nbytes)
        if not bucket:
            return None
        slot = bucket.pop()
        self._slab_of[id(slot)].free -= 1
        return slot

    def _next_slab_slots(self, nbytes: int) -> int:
        """Slots in the next slab for `nbytes` (the doubling in the module docstring, counting
        slabs ordered and not yet adopted), shrunk or reclaimed to fit `limit_bytes`; 0: none fits."""
        grown = self._grown.get(nbytes, 0) + self._pending.get(nbytes, 0)
        count = 1 if nbytes * 2 > self._slab_bytes else min(self._slab_bytes // nbytes, max(1, grown))
        need = nbytes * count
        if self.limit_bytes is not None and self.reserved_bytes + need > self.limit_bytes:
            self._reclaim(self.reserved_bytes + need - self.limit_bytes)
            if self.reserved_bytes + need > self.limit_bytes:
                count = max(0, (self.limit_bytes - self.reserved_bytes) // nbytes)
        return count

    def release(self, slot: np.ndarray) -> None:
        """Hand a slot back; it is reused once nothing else references it."""
        if slot.nbytes:
            self._deferred.append(slot)

    def release_many(self, slots: Sequence[np.ndarray]) -> None:
        """`release` each slot (a batch of evicted objects), last first: a free list hands out
        its last slot first, so slots released in ascending address order (the order a batch
        was given them and is evicted in) come back ascending, as a fresh slab's do. A
        conversion then walks both sides forward (the hardware prefetcher's direction; in
        reverse, SGLang page gathers and scatters ran slower in `kvpack bench sglang`)."""
        self._deferred.extend([slot for slot in reversed(slots) if slot.nbytes])

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
