"""Write-back: stores reach the lower tiers (disk, Mooncake) from background threads.

The caller (`KVStore.store`) returns once the front tier (the memory tier or the
host store) holds a copy; each object is queued here and written by one of
`threads` threads. Invariants:

- Bounded: each thread's FIFO holds at most ``depth // threads`` objects; a
  full queue refuses (`enqueue` returns False) rather than blocking the
  engine, and the caller counts the drop (back-pressure).
- Ordered per key: a key always goes to the same thread, so two stores of
  one key reach the tiers in the order they were made (two of one key taken in
  one batch: only the newer is written, the state that order leaves). Stores of
  different keys may reach a tier in another order than they were made; each
  carries when the store accepted it (`PutItem.accepted_ns`), and a bounded tier
  ranks recency by that, so its eviction follows the order of the stores.
- Batched: a thread takes what its queue holds, up to `MAX_BATCH` objects and
  `MAX_BATCH_BYTES`, and writes them in one call (one index transaction per
  tier, not one per object).
- Counted: `pending` is every object accepted and not yet written (queued or
  being written); `flush` waits, bounded, until it is 0. With `max_bytes`, the
  payload bytes of those objects stay within it too (`has_room`): the queue
  behind the host store holds copies, which this bounds.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from ..background import lower_current_thread_priority
from ..tiers.base import PutItem

MAX_BATCH = 64
"""Objects a write-back thread writes in one call at most."""

MAX_BATCH_BYTES = 16 << 20
"""Payload bytes a write-back thread writes in one call at most (one object larger than it goes
alone): a remote tier's put of one batch has one deadline (Mooncake: `timeout_ms` for the whole
job), so a batch stays the size of one of its calls (Mooncake's `STEP_MAX_BYTES`)."""


class WriteBack:
    """See the module docstring. `write(items)` runs on the threads and must not raise."""

    def __init__(
        self, threads: int, depth: int, write: Callable[[list[PutItem]], object], max_bytes: int | None = None
    ) -> None:
        self._write = write
        self._max_bytes = max_bytes
        self._bytes = 0
        per_thread = max(1, depth // max(1, threads))
        self._queues: list[queue.Queue[PutItem | None]] = [queue.Queue(maxsize=per_thread) for _ in range(threads)]
        self._pending = 0
        self._cv = threading.Condition()
        self._threads = [
            threading.Thread(target=self._loop, args=(q,), name=f"kvpack-writeback-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()

    def __bool__(self) -> bool:
        """True when there are threads (a store with no lower tier, or read-only, has none)."""
        return bool(self._threads)

    @property
    def pending(self) -> int:
        """Objects accepted and not yet written."""
        with self._cv:
            return self._pending

    def has_room(self, nbytes: int) -> bool:
        """Would an object of `nbytes` payload bytes fit under `max_bytes` now? (Always, without
        it; and when nothing is queued: one object larger than the bound still goes.)"""
        with self._cv:
            return self._fits(nbytes)

    def _fits(self, nbytes: int) -> bool:
        """`has_room`'s rule, with `_cv` held."""
        return self._max_bytes is None or not self._bytes or self._bytes + nbytes <= self._max_bytes

    def enqueue(self, item: PutItem) -> bool:
        """Queue `item` for the lower tiers; False (nothing queued) when its queue is full or
        its bytes would pass `max_bytes`."""
        nbytes = item.nbytes
        with self._cv:
            if not self._fits(nbytes):
                return False
            self._pending += 1
            self._bytes += nbytes
        try:
            self._queues[hash(item.key) % len(self._queues)].put_nowait(item)
            return True
        except queue.Full:
            self._done_one(nbytes)
            return False

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until every accepted object was written. True if so."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, join_s: float = 2.0) -> None:
        """Stop the threads after what is queued (callers flush first)."""
        for jobs in self._queues:
            try:
                jobs.put(None, timeout=1.0)
            except queue.Full:
                pass
        for t in self._threads:
            t.join(timeout=join_s)

    def _done_one(self, nbytes: int) -> None:
        with self._cv:
            self._pending -= 1
            self._bytes -= nbytes
            if self._pending == 0:
                self._cv.notify_all()

    def _loop(self, jobs: queue.Queue[PutItem | None]) -> None:
        lower_current_thread_priority()
        while True:
            item = jobs.get()
            if item is None:
                return
            stop = False
            while item is not None and not stop:
                batch, nbytes, item = [item], item.nbytes, None
                while len(batch) < MAX_BATCH:
                    try:
                        more = jobs.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:  # `close`: write what came before it, then stop
                        stop = True
                        break
                    if nbytes + more.nbytes > MAX_BATCH_BYTES:
                        item = more  # the first of the next batch
                        break
                    batch.append(more)
                    nbytes += more.nbytes
                try:
                    self._write(list({it.key: it for it in batch}.values()))  # the newest store of each key
                finally:
                    for it in batch:
                        self._done_one(it.nbytes)
            if stop:
                return
