"""The process's pinned host staging: one pool of page-locked buffers, reused, bounded.

A GPU cache copies through pinned host rows (`kvpack.transfers.staging.CudaDevice`). Pinning is
slow (a system call that locks every page) and pinned memory is taken from the whole
host, so rows are not pinned per batch: they come from this pool and go back to it
after the copy's event, and the pool never holds more than its bound pinned.

- Buffers are kept by capacity class (a power of two, at least `MIN_BUFFER_BYTES`);
  `take(n)` hands out a free buffer of n's class or pins a new one.
- The bound (`TransferConfig.staging_bytes`) is on the bytes pinned (free and in use):
  a take that needs a new buffer first unpins free buffers of other classes; when the
  bound still does not leave room and some buffer is in use, it raises `StagingFull`
  (the transfer is turned away and counted, nothing waits). With nothing in use one
  buffer larger than the bound is lent (a single transfer bigger than the bound still
  runs) and unpinned when it comes back.
- `pinned_bytes()` is what the ``kvpack_pinned_bytes`` gauge reads.

One pool per process (`PinnedPool.shared`): every worker's staging of a process shares
its bound. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import ClassVar

import torch

MIN_BUFFER_BYTES = 64 << 10
"""Smallest buffer the pool pins (rows of a smaller batch share a class)."""

DEFAULT_STAGING_BYTES = 2 << 30
"""The shared pool's bound until a configuration sets one (`TransferConfig.staging_bytes`)."""


class StagingFull(RuntimeError):
    """No pinned staging within the pool's bound while other transfers hold theirs."""

    def __init__(self, nbytes: int, pinned: int, bound: int) -> None:
        super().__init__(f"pinned staging of {nbytes} bytes refused: {pinned} of {bound} bytes pinned and in use")
        self.nbytes = nbytes


def _pin(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def capacity_class(nbytes: int) -> int:
    """The capacity of the buffer a take of `nbytes` gets: the next power of two >= `MIN_BUFFER_BYTES`."""
    return max(MIN_BUFFER_BYTES, 1 << max(0, nbytes - 1).bit_length())


class PinnedPool:
    """See the module docstring. `allocate` pins a buffer of the given bytes (tests pass their own)."""

    _shared: ClassVar[PinnedPool | None] = None
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, bound_bytes: int, allocate: Callable[[int], torch.Tensor] = _pin) -> None:
        self.bound_bytes = bound_bytes
        self._allocate = allocate
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}
        """data_ptr -> buffer, for every buffer handed out and not given back."""
        self._pinned = 0

    @classmethod
    def shared(cls, bound_bytes: int | None = None) -> PinnedPool:
        """This process's pool; `bound_bytes` (a configuration's) raises its bound to at least that."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls(DEFAULT_STAGING_BYTES if bound_bytes is None else bound_bytes)
            elif bound_bytes is not None and bound_bytes > cls._shared.bound_bytes:
                cls._shared.bound_bytes = bound_bytes
            return cls._shared

    def pinned_bytes(self) -> int:
        """Bytes this pool holds pinned, free or lent."""
        return self._pinned

    def lent_bytes(self) -> int:
        """Bytes of the buffers handed out and not yet given back."""
        with self._lock:
            return sum(int(b.numel()) for b in self._lent.values())

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 pinned buffer of at least `nbytes` (its first `nbytes` are the caller's
        until `give`); `StagingFull` when the bound leaves no room (see the module docstring)."""
        cap = capacity_class(nbytes)
        with self._lock:
            free = self._free.get(cap)
            if free:
                buf = free.pop()
                self._lent[buf.data_ptr()] = buf
                return buf
            while self._pinned + cap > self.bound_bytes and self._drop_one_free():
                pass
            if self._pinned + cap > self.bound_bytes and self._lent:
                raise StagingFull(nbytes, self._pinned, self.bound_bytes)
            self._pinned += cap  # counted before the pin, so concurrent takes see the room as used
        try:
            buf = self._allocate(cap)
        except BaseException:
            with self._lock:
                self._pinned -= cap
            raise
        with self._lock:
            self._lent[buf.data_ptr()] = buf
        return buf

    def give(self, tensor: torch.Tensor) -> None:
        """Give back the buffer `tensor` starts (a view of a `take`'s buffer; anything else is
        ignored). No copy may still read or write it: the caller waited for its event."""
        with self._lock:
            buf = self._lent.pop(tensor.data_ptr(), None)
            if buf is None:
                return
            cap = int(buf.numel())
            if self._pinned > self.bound_bytes or (self._allocate is _pin and not buf.is_pinned()):
                self._pinned -= cap  # over the bound (a lone oversized transfer), or pinning was not possible
                return
            self._free.setdefault(cap, []).append(buf)

    def _drop_one_free(self) -> bool:
        """Unpin the largest free buffer (under the lock); False when none is free."""
        classes = [c for c, bufs in self._free.items() if bufs]
        if not classes:
            return False
        cap = max(classes)
        self._free[cap].pop()
        self._pinned -= cap
        return True
