"""The canonical conversion's copies for SGLang host pools: pages <-> objects at any host
addresses, in pieces on several native threads (`copy_runs`), and the staging rows kept between
calls for objects a tier reads or writes itself (`StagingRows`)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import numpy as np

from .. import CanonicalGeometry, Payload


def raw_view(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of `nbytes` at address `ptr` (host memory the pool owns)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")


MIN_BYTES_PER_THREAD = 4 << 20
"""Fewest object bytes `copy_runs` gives a thread of its own (below, one thread converts)."""


def copy_runs(
    geo: CanonicalGeometry,
    ids: Sequence[int],
    addrs: Sequence[int],
    *,
    gather: bool,
    threads: int = 1,
) -> None:
    """Pages ``ids[i]`` of the pool <-> the canonical object at host address ``addrs[i]``
    (``geo.object_bytes(geo.heads)`` bytes each; written when `gather`, else read), at any
    addresses in any order (a tier's slots, staging rows): one `CanonicalGeometry.copy_at`
    call over the batch (one kernel call; without the kernel, one copy per run of objects
    back to back), cut into up to `threads` pieces of about equal count where each piece
    moves at least `MIN_BYTES_PER_THREAD`, one native thread each, the caller's included.
    The GIL is given up once, inside the kernel, and no helper thread runs Python: beside
    an SGLang scheduler thread busy in Python (a GPU server's), a helper that had to take
    the GIL back would wait for its switch interval, so Python worker threads made a get
    slower there than one thread (benchmarks/RESULTS.md, issue 34's sections). Every address
    must stay valid until this returns."""
    pieces = max(1, min(threads, len(ids) * geo.object_bytes(geo.heads) // MIN_BYTES_PER_THREAD))
    geo.copy_at(ids, addrs, gather=gather, threads=pieces)


def row_views(rows: np.ndarray) -> list[Payload]:
    """Each row of a C-contiguous 2-D uint8 array as a writable 1-D memoryview of its bytes,
    equal to ``memoryview(rows[i])``: slices of one view of the whole buffer, not a view per
    indexed row (a save or a load builds one per object, hundreds per call)."""
    if rows.ndim != 2 or not rows.flags.c_contiguous:
        raise ValueError(f"row_views: a C-contiguous 2-D array, not shape {rows.shape}")
    flat, width = rows.reshape(-1).data, rows.shape[1]
    return [flat[i : i + width] for i in range(0, rows.shape[0] * width, width)]


STAGING_KEPT_BYTES = 512 << 20
"""Most bytes of conversion staging a pool binding keeps between calls (`StagingRows`)."""


class StagingRows:
    """Conversion staging buffers kept between calls (a fresh 96 MiB buffer costs more in
    first-touch page faults than the conversion itself). A save takes one and gives it back
    once the store returned (`KVStore.store` lets the caller reuse its buffers then); a load
    takes one per group of pages and gives it back once its rows were scattered (no tier
    writes into a load's buffers after its call returned: `Tier.get_into`). Several may be
    in use at once, from several threads. Thread-safe.

    numpy, not torch: every torch call from Python gives the GIL up and takes it back
    (``view``, ``set_``, ``empty``), and inside an SGLang server, whose scheduler thread runs
    Python, each re-take can wait a switch interval (5 ms); numpy's views and ``empty`` keep
    the GIL. A take and its give-back make no torch call."""

    def __init__(self, kept_bytes: int = STAGING_KEPT_BYTES) -> None:
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        """Kept buffers: 1-D uint8 arrays that own their memory, each handed out at most once at a time."""
        self._kept_bytes = kept_bytes

    def take(self, rows: int, width: int) -> np.ndarray:
        """``[rows, width]`` uint8, C-contiguous: a view of the smallest kept buffer large
        enough, else of a new one."""
        need = rows * width
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.size >= need]
            # by position, never by value: `list.remove` would compare arrays element-wise
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].size)) if fits else None
        if buf is None:
            buf = np.empty(need, dtype=np.uint8)
        return buf[:need].reshape(rows, width)

    def give_back(self, rows: np.ndarray) -> None:
        """Keep the buffer `rows` (from `take`) views, for a later call (dropped when the kept
        bytes would exceed the bound)."""
        base = rows.base if isinstance(rows.base, np.ndarray) else rows  # numpy: the array owning the memory
        with self._lock:
            if any(b is base for b in self._free):
                raise ValueError("StagingRows.give_back: this buffer was given back already")
            if sum(b.size for b in self._free) + base.size <= self._kept_bytes:
                self._free.append(base)
