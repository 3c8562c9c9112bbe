"""Objects at host addresses of their own (a memory tier's slots, lent views): the runs of
objects that lie back to back, for copies that take one contiguous buffer per call."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def address_runs(ids: Sequence[int], addrs: Sequence[int], size: int) -> list[tuple[list[int], int]]:
    """Object ``i`` (``size`` bytes at ``addrs[i]``, for block ``ids[i]``) grouped into runs of
    objects back to back in memory, ascending or descending: ``(block ids in address order,
    lowest address)`` per run, runs in the batch's order. Every object is in exactly one run."""
    runs: list[tuple[list[int], int]] = []
    i, n = 0, len(ids)
    while i < n:
        j = i + 1
        step = addrs[j] - addrs[i] if j < n and abs(addrs[j] - addrs[i]) == size else 0
        while step and j < n and addrs[j] - addrs[j - 1] == step:
            j += 1
        run_ids = list(ids[i:j]) if step >= 0 else list(reversed(ids[i:j]))
        runs.append((run_ids, min(addrs[i], addrs[j - 1])))
        i = j
    return runs


def bytes_at(addr: int, nbytes: int) -> torch.Tensor:
    """A writable uint8 tensor over `nbytes` of host memory at `addr` (memory the caller
    keeps valid for the tensor's use; nothing is copied)."""
    return torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(addr), dtype=torch.uint8)


def address_of(buf: Any) -> int:
    """The host address of a C-contiguous buffer (numpy array, memoryview, read-only or not).
    Through ctypes where it can (cheaper than numpy's ``.ctypes.data`` or a view through
    ``np.frombuffer``, per object of a save or a load): a writable buffer, or a
    read-only view of all of a writable array (a tier's lent slot); else through numpy."""
    target = buf
    if isinstance(buf, memoryview) and buf.readonly:
        owner = buf.obj
        whole = isinstance(owner, np.ndarray) and buf.c_contiguous and owner.nbytes == buf.nbytes
        target = owner if whole and isinstance(owner, np.ndarray) and owner.flags.writeable else None
    if target is not None:
        try:
            return ctypes.addressof(ctypes.c_char.from_buffer(target))
        except (TypeError, ValueError, BufferError):  # read-only, empty or not C-contiguous
            pass
    return (
        int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if not isinstance(buf, np.ndarray) else int(buf.ctypes.data)
    )


def upload_runs(addrs: Sequence[int], size: int, out: torch.Tensor) -> list[int]:
    """Objects ``size`` bytes each, object i at host address ``addrs[i]``, copied into the rows of
    `out` (``[>= len(addrs), size]`` uint8, on any device): one ``copy_`` per run of objects back to
    back in memory (`address_runs`), queued on the current stream (``non_blocking``: from pinned or
    CUDA-registered memory a DMA that reads the objects until the stream reaches it, so the caller
    keeps them valid until its event; from pageable memory CUDA copies before it returns). Returns
    the order of the rows: row r holds object ``order[r]``."""
    order: list[int] = []
    for run, low in address_runs(list(range(len(addrs))), addrs, size):
        at = len(order)
        out[at : at + len(run)].view(-1).copy_(bytes_at(low, size * len(run)), non_blocking=True)
        order += run
    return order
