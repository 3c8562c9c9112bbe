"""Spreading a batch's copies and file I/O over a few threads.

A tier's bookkeeping for a batch (capacity, eviction, slots) runs once, in the
calling thread; the byte moving that follows (``np.copyto`` of whole regions,
``preadv``/``writev`` of whole files) releases the GIL, so `threads` threads
move bytes at once: the caller takes the first share and `threads - 1` worker
threads (started on first use) the others: where one thread does not saturate
the memory channels, a second one copies faster.

The split is by bytes (copies) or by item count (I/O, with their bytes as a
floor), in order; results keep the items' order. Batches too small to be worth a
hand-off (`min_bytes_per_thread`, `min_items_per_thread`) stay on the caller's thread.
A worker's exception is re-raised in the caller (callers turn it into per-item
statuses: tiers never raise on the data path).

Thread-safe: concurrent calls share the workers (a second call's shares queue
behind the first's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import numpy as np

from ..ops.natives import CopyPair, RegionCopier

T = TypeVar("T")


MIN_BYTES_PER_THREAD = 4 << 20
MIN_ITEMS_PER_THREAD = 8
CHUNKS_PER_THREAD = 4


def conversion_threads(io_threads: int, engine_on_host_cpu: bool) -> int:
    """Threads (the caller's included) that convert one call's pages between an engine's host
    pool and canonical objects: `io_threads` when the engine computes on an accelerator, whose
    forward pass leaves the host's cores to kvpack (a large call converts faster on two
    threads); 1 when it computes on the host's CPU, where a second thread takes a core its
    forward pass runs on, and costs the engine far more than it saves (both:
    benchmarks/RESULTS.md, "why the conversion stays on one thread" and the
    eighth session of 2026-12-05). Calls under the
    per-thread floor stay on one thread either way."""
    return 1 if engine_on_host_cpu else max(1, io_threads)


def copy_pairs(pairs: Sequence[CopyPair]) -> None:
    """Copy each source into its destination, in order, on this thread."""
    copyto = np.copyto
    for dst, src in pairs:
        copyto(dst, src)


def _copy_native(native: RegionCopier, streaming: bool, run: Sequence[CopyPair]) -> None:
    """`native` over `run`; a run it refuses (it checks every pair before copying) goes to numpy."""
    try:
        native(run, streaming)
    except (ValueError, BufferError, TypeError):
        copy_pairs(run)


def _runs(pairs: Sequence[CopyPair], total: int, count: int) -> list[Sequence[CopyPair]]:
    """`pairs` cut, in order, into `count` consecutive runs of about equal bytes."""
    bounds = [0]
    acc = 0
    for i, (dst, _) in enumerate(pairs):
        acc += dst.nbytes
        if acc * count >= total * len(bounds) and len(bounds) < count:
            bounds.append(i + 1)
    bounds.append(len(pairs))
    return [pairs[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


class IOThreads:
    """See the module docstring. `threads` counts the caller: 1 means no workers."""

    def __init__(
        self,
        threads: int = 1,
        min_bytes_per_thread: int = MIN_BYTES_PER_THREAD,
        min_items_per_thread: int = MIN_ITEMS_PER_THREAD,
        name: str = "kvpack-io",
        region_copier: Callable[[], RegionCopier | None] | None = None,
    ) -> None:
        """`region_copier`, if given, is asked at each `copy` for a native copier (None:
        not available yet, e.g. still being built); without one, copies use numpy."""
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self.threads = threads
        self._min_bytes = max(1, min_bytes_per_thread)
        self._min_items = max(1, min_items_per_thread)
        self._name = name
        self._region_copier = region_copier
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    def _pool(self) -> ThreadPoolExecutor | None:
        if self.threads == 1:
            return None
        with self._lock:
            if self._executor is None and not self._closed:
                self._executor = ThreadPoolExecutor(self.threads - 1, thread_name_prefix=self._name)
            return self._executor

    def copy(self, pairs: Sequence[CopyPair], nbytes: int | None = None, streaming: bool = False) -> None:
        """Run every copy of `pairs`; `nbytes` (their total, if known) saves a pass.

        `streaming`: the destinations are written now and read much later (a tier's
        stored objects): with a native copier, long regions skip the cache
        (non-temporal stores: they neither read the lines first nor evict what the
        engine has in cache).

        The batch is cut into `CHUNKS_PER_THREAD` runs per thread of about equal
        bytes, which the caller and the workers take in turn from one shared
        iterator: a worker that wakes late, or a core busy with something else,
        just takes fewer runs."""
        total = sum(d.nbytes for d, _ in pairs) if nbytes is None else nbytes
        native = self._region_copier() if self._region_copier is not None else None
        copy_run = copy_pairs if native is None else partial(_copy_native, native, streaming)
        k = min(self.threads, total // self._min_bytes, len(pairs))
        pool = self._pool() if k > 1 else None
        if pool is None:
            copy_run(pairs)
            return
        runs = _runs(pairs, total, min(len(pairs), k * CHUNKS_PER_THREAD))
        shared = iter(runs)

        def drain() -> None:
            for run in shared:  # list_iterator.__next__ is atomic: each run is taken once
                copy_run(run)

        futures: list[Future[None]] = [pool.submit(drain) for _ in range(k - 1)]
        try:
            drain()
        finally:
            for f in futures:
                f.result()

    def split(self, n: int, part: Callable[[int, int], list[T]], nbytes: int | None = None) -> list[T]:
        """``part(lo, hi)`` over consecutive ranges covering [0, n); results in order. With
        `nbytes` (the bytes the n items move), each thread also gets `min_bytes_per_thread`
        of them at least: a batch of a few small files reads faster on one thread than
        handed off (the hand-off costs more than a second thread saves)."""
        k = min(self.threads, n // self._min_items)
        if nbytes is not None:
            k = min(k, nbytes // self._min_bytes)
        pool = self._pool() if k > 1 else None
        if pool is None:
            return part(0, n)
        bounds = [n * j // k for j in range(k + 1)]
        futures = [pool.submit(part, bounds[j], bounds[j + 1]) for j in range(1, k)]
        try:
            out = part(bounds[0], bounds[1])
        finally:
            rest = [f.result() for f in futures]
        for r in rest:
            out += r
        return out

    def close(self) -> None:
        """Stop the workers (after their queued shares); later calls run on the caller."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
