"""Per-batch figures of page loads and stores, for an engine that asks for them between scrapes.

SGLang's HiCache controller asks its storage backend, once per metrics interval, for the
batches moved since it last asked (`StorageMetrics`: pages per batch, GB/s per batch) and
records each in a histogram; the backend forgets what it handed over. `BatchLog` keeps
those figures in the meantime. It is bounded: when nobody asks (metrics off), the oldest
batches are dropped (``max_batches`` per direction), so a long run holds a fixed amount.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass, field

GIB = float(1 << 30)
"""Bytes per GB in the bandwidth figures (SGLang's own backends divide by 2**30)."""


class Direction(enum.Enum):
    LOAD = "load"
    """Pages read from the store into the engine (SGLang: prefetch)."""
    STORE = "store"
    """Pages written from the engine to the store (SGLang: backup)."""


@dataclass
class BatchFigures:
    """The batches of one direction since the last take, oldest first."""

    pages: list[int] = field(default_factory=list)
    """Pages each batch moved."""
    gb_per_s: list[float] = field(default_factory=list)
    """Each batch's payload bytes over its wall time, in GiB/s (batches with no bytes or no
    measurable time give none)."""


class BatchLog:
    """Thread-safe; `note` from any transfer thread, `take` from the engine's metrics thread."""

    def __init__(self, max_batches: int = 4096) -> None:
        self._lock = threading.Lock()
        self._pages = {d: deque[int](maxlen=max_batches) for d in Direction}
        self._rates = {d: deque[float](maxlen=max_batches) for d in Direction}

    def note(self, direction: Direction, pages: int, nbytes: int, seconds: float) -> None:
        """One batch: `pages` pages (of `nbytes` payload bytes in all) moved in `seconds`."""
        if pages <= 0:
            return
        with self._lock:
            self._pages[direction].append(int(pages))
            if nbytes > 0 and seconds > 0:
                self._rates[direction].append(nbytes / seconds / GIB)

    def take(self) -> dict[Direction, BatchFigures]:
        """Every batch noted since the last call, per direction; the log is then empty."""
        with self._lock:
            out = {d: BatchFigures(list(self._pages[d]), list(self._rates[d])) for d in Direction}
            for d in Direction:
                self._pages[d].clear()
                self._rates[d].clear()
        return out
