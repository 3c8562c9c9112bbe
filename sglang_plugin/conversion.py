"""The canonical conversion's copies for SGLang host pools: pages <-> objects at any host
addresses, in runs and on several threads (`copy_runs`), and the staging rows kept between
calls for objects a tier reads or writes itself (`StagingRows`)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

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
    workers: ThreadPoolExecutor | None = None,
    threads: int = 1,
) -> None:
    """Pages ``ids[i]`` of the pool <-> the canonical object at host address ``addrs[i]``
    (``geo.object_bytes(geo.heads)`` bytes each; written when `gather`, else read), one
    kernel call per run of objects that lie back to back in memory, in either order (a
    tier's slots, staging rows). With `workers`, the runs are cut into up to `threads`
    pieces of about equal size, run on the caller and the workers at once (the kernel
    releases the GIL; pieces touch disjoint pages and objects). Every address must stay
    valid until this returns; it returns once every piece is done, and raises the first
    piece's error."""
    size = geo.object_bytes(geo.heads)
    runs: list[tuple[list[int], int]] = []  # (page ids in address order, lowest address)
    i, n = 0, len(ids)
    while i < n:
        j = i + 1
        step = addrs[j] - addrs[i] if j < n and abs(addrs[j] - addrs[i]) == size else 0
        while step and j < n and addrs[j] - addrs[j - 1] == step:
            j += 1
        run_ids = list(ids[i:j]) if step >= 0 else list(reversed(ids[i:j]))
        runs.append((run_ids, min(addrs[i], addrs[j - 1])))
        i = j
    pieces = min(threads, n * size // MIN_BYTES_PER_THREAD) if workers is not None else 1
    if pieces > 1:
        share, cut = -(-n // pieces), []
        for run_ids, low in runs:  # split runs longer than a share, so every piece gets about one
            for k in range(0, len(run_ids), share):
                cut.append((run_ids[k : k + share], low + k * size))
        runs = cut
    groups: list[list[tuple[list[int], int]]] = [[] for _ in range(max(1, pieces))]
    load = [0] * len(groups)
    for run in sorted(runs, key=lambda r: -len(r[0])):
        g = load.index(min(load))
        groups[g].append(run)
        load[g] += len(run[0])

    def convert(group: list[tuple[list[int], int]]) -> None:
        for run_ids, low in group:
            rows = torch.frombuffer(raw_view(low, size * len(run_ids)), dtype=torch.uint8)
            geo.copy(run_ids, rows, gather=gather, obj_heads=geo.heads)

    futures = [workers.submit(convert, g) for g in groups[1:] if g] if workers is not None else []
    try:
        convert(groups[0])
    finally:
        for f in futures:
            f.result()


def address_of(buf: Any) -> int:
    """The host address of a C-contiguous buffer (numpy array, memoryview, read-only or not).
    Through ctypes where it can (0.4 us; numpy's ``.ctypes.data`` 1.1 us, a view through
    ``np.frombuffer`` 2.7 us: a save's or a load's 256 objects): a writable buffer, or a
    read-only view of all of a writable array (a tier's lent slot); else through numpy."""
    target = buf
    if isinstance(buf, memoryview) and buf.readonly:
        owner = buf.obj
        whole = isinstance(owner, np.ndarray) and buf.c_contiguous and owner.nbytes == buf.nbytes
        target = owner if whole and isinstance(owner, np.ndarray) and owner.flags.writeable else None
    if target is not None:
        try:
            return ctypes.addressof(ctypes.c_char.from_buffer(target))
        except (TypeError, ValueError):  # read-only, empty or not C-contiguous
            pass
    return (
        int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if not isinstance(buf, np.ndarray) else int(buf.ctypes.data)
    )


def row_views(rows: np.ndarray) -> list[Payload]:
    """Each row of a C-contiguous 2-D uint8 array as a writable 1-D memoryview of its bytes,
    equal to ``memoryview(rows[i])``: slices of one view of the whole buffer (0.1 us a row;
    indexing the array first costs 0.6 us: a save's or a load's 256 objects)."""
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
    in use at once, from several threads. Thread-safe."""

    def __init__(self, kept_bytes: int = STAGING_KEPT_BYTES) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._kept_bytes = kept_bytes

    def take(self, rows: int, width: int) -> torch.Tensor:
        """``[rows, width]`` uint8: a kept buffer large enough (the smallest), else a new one."""
        need = rows * width
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= need]
            # by position, never by value: `list.remove` would compare tensors element-wise
            buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel())) if fits else None
        if buf is None:
            buf = torch.empty(need, dtype=torch.uint8)
        return buf[:need].view(rows, width)

    def give_back(self, rows: torch.Tensor) -> None:
        """Keep `rows`' buffer for a later call (dropped when the kept bytes would exceed the bound)."""
        buf = rows.view(-1)
        base = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage())
        with self._lock:
            if sum(b.numel() for b in self._free) + base.numel() <= self._kept_bytes:
                self._free.append(base)
