"""Test/bench-only timing probe on SGLang 0.5.23's L3 prefetch, for any storage backend. Never part of kvpack.

Installed by this folder's ``sitecustomize.py`` when ``KVPACK_SGLANG_PREFETCH_PROBE=1`` (the
multi-turn bench sets it). It wraps two methods of SGLang's HiCache controller and prints one
line per call to the server's stdout (its log), seconds from ``PrefetchOperation.start_time``
(monotonic, set when the scheduler submits the prefetch):

- the hit query (``_storage_hit_query``: the backend's ``batch_exists``/``batch_exists_v2``,
  on SGLang's prefetch thread)::

    kvpack-probe query rid=R queued_s=Q query_s=S asked=A found=F

  (`queued_s`: submit to the query's start; `asked`/`found`: tokens; an ``assume_stored``
  prefetch skips the backend and reports every page found);
- the page reads (the KV part of ``_page_transfer``: the backend's ``batch_get_v1`` or
  ``batch_get`` + SGLang's page copies, on its prefetch IO thread)::

    kvpack-probe transfer rid=R start_s=T transfer_s=S asked=A loaded=L terminated=0|1

  (`start_s`: submit to the first read, so it holds the query and the scheduler's host
  allocation; `start_s + transfer_s` is the prefetch's latency to its last page;
  `terminated`: the scheduler had cut it by the time the reads returned);
- each L3 backup (``_page_backup``: the backend's ``batch_set_v1`` or ``batch_set``, on SGLang's
  backup thread; SGLang holds the L2 pages it writes until it drains the write's ack, so a slow
  write keeps L2 pages from eviction and prefetched ones go first)::

    kvpack-probe backup queued_s=Q backup_s=S asked=A written=W cpu_s=C samples=F:N,...

  (`queued_s`: the write's creation (``write_storage``) to the backend's first call; `cpu_s`:
  the backup thread's CPU time in the call (``time.thread_time``: Python holding the GIL plus
  native code; the rest of `backup_s` is waiting: for the GIL, the disk, a lock, a core);
  `samples`, only with ``KVPACK_SGLANG_PROBE_SAMPLE=1``: where the backup thread's stack was,
  sampled every ~1 ms by a probe thread (``sys._current_frames``), innermost frame as
  file:line:function, most frequent first; the sampler competes for the GIL, so it slows a
  write that gives the GIL up often: never on in a run whose credited tokens are compared).

With ``KVPACK_SGLANG_READ_DELAY_S=S`` (a control of the multi-turn bench, `--read-delay`), every
prefetch's page reads start S seconds later (a sleep on SGLang's prefetch IO thread before the
reads): the same backend made slower, to ask whether SGLang credits a request more L3 tokens
when its prefetch ends later. With ``KVPACK_SGLANG_WRITE_DELAY_S=S`` (`--write-delay`), every L3
backup call starts S seconds later (a sleep on SGLang's backup thread; the probe's `backup_s`
leaves it out, `queued_s` holds it): to ask whether SGLang's schedule, and so its L3 credit,
moves with how long a backend's writes hold their L2 pages.

- each prefetch submission (``UnifiedRadixCache.prefetch_from_storage``, on the scheduler thread:
  a request's first lookup, a retry, or the re-query after its device prefix shrank), with what
  SGLang's own outcome counters (``_prefetch_outcome_stats``) counted for it (``issued``, or why
  it was declined) and the tokens then held by prefetches in flight::

    kvpack-probe submit rid=R outcome=issued|declined_rate_limited|...|none occupied=T

  (``none``: returned before counting anything, e.g. while the request's earlier prefetch is
  still in flight).

The lines are read by ``kvpack.tools.bench.sglang_prefetch_stats``. SGLang's own code is
never edited; each wrapper calls the original and returns its result.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from types import ModuleType
from typing import Any

PAGE_TRANSFER = "sglang.srt.managers.cache_controller"
HIT_QUERY = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"
SUBMIT = "sglang.srt.mem_cache.unified_radix_cache"


def _query_probe(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def storage_hit_query(self: Any, operation: Any) -> Any:
        began = time.monotonic()
        hashes, hit_tokens = original(self, operation)
        done = time.monotonic()
        asked = len(getattr(operation, "all_hash_values", None) or []) * int(self.page_size)
        print(
            f"kvpack-probe query rid={operation.request_id} queued_s={began - operation.start_time:.4f} "
            f"query_s={done - began:.4f} asked={asked} found={int(hit_tokens)}",
            flush=True,
        )
        return hashes, hit_tokens

    return storage_hit_query


def _transfer_probe(original: Callable[..., Any]) -> Callable[..., Any]:
    delay_s = float(os.environ.get("KVPACK_SGLANG_READ_DELAY_S") or 0.0)

    @functools.wraps(original)
    def page_transfer(self: Any, operation: Any) -> Any:
        if delay_s > 0:
            time.sleep(delay_s)
        began = time.monotonic()
        completed_pages = original(self, operation)
        done = time.monotonic()
        print(
            f"kvpack-probe transfer rid={operation.request_id} start_s={began - operation.start_time:.4f} "
            f"transfer_s={done - began:.4f} asked={len(operation.hash_value) * int(self.page_size)} "
            f"loaded={int(completed_pages or 0) * int(self.page_size)} "
            f"terminated={int(operation.is_terminated())}",
            flush=True,
        )
        return completed_pages

    return page_transfer


class _Sampler:
    """Samples one thread's innermost frame every ~1 ms while `watch` is set (bench-only)."""

    def __init__(self) -> None:
        self.target: int | None = None
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        threading.Thread(target=self._run, name="kvpack-probe-sampler", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(0.001)
            target = self.target
            if target is None:
                continue
            frame = sys._current_frames().get(target)
            if frame is not None:
                where = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}:{frame.f_code.co_name}"
                with self.lock:
                    self.counts[where] += 1

    def start(self) -> None:
        with self.lock:
            self.counts = Counter()
        self.target = threading.get_ident()

    def stop(self) -> str:
        self.target = None
        with self.lock:
            top = self.counts.most_common(6)
        return ",".join(f"{w}:{n}" for w, n in top)


def _backup_probe(original: Callable[..., Any]) -> Callable[..., Any]:
    sampler = _Sampler() if os.environ.get("KVPACK_SGLANG_PROBE_SAMPLE") == "1" else None
    delay_s = float(os.environ.get("KVPACK_SGLANG_WRITE_DELAY_S") or 0.0)

    @functools.wraps(original)
    def page_backup(self: Any, operation: Any) -> Any:
        if delay_s > 0:
            time.sleep(delay_s)
        if sampler is not None:
            sampler.start()
        cpu0 = time.thread_time()
        began = time.monotonic()
        out = original(self, operation)
        done = time.monotonic()
        cpu = time.thread_time() - cpu0
        samples = sampler.stop() if sampler is not None else "-"
        created = getattr(operation, "kvpack_probe_created", began)
        print(
            f"kvpack-probe backup queued_s={began - created:.4f} backup_s={done - began:.4f} "
            f"asked={len(operation.hash_value) * int(self.page_size)} written={int(operation.completed_tokens)} "
            f"cpu_s={cpu:.4f} samples={samples}",
            flush=True,
        )
        return out

    return page_backup


def _submit_probe(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prefetch_from_storage(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        stats = getattr(self, "_prefetch_outcome_stats", {})
        before = dict(stats)
        out = original(self, request, *args, **kwargs)
        counted = [k for k, v in stats.items() if v != before.get(k) and k not in ("attempts", "l3_demand_requests")]
        outcome = ",".join(sorted(counted)) or "none"
        occupied = getattr(getattr(self, "cache_controller", None), "prefetch_tokens_occupied", -1)
        print(f"kvpack-probe submit rid={request.rid} outcome={outcome} occupied={occupied}", flush=True)
        return out

    return prefetch_from_storage


def _stamped(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.kvpack_probe_created = time.monotonic()

    return init


def _wrap_page_transfer(module: ModuleType) -> None:
    cls = module.HiCacheController
    cls._page_transfer = _transfer_probe(cls._page_transfer)
    cls._page_backup = _backup_probe(cls._page_backup)
    module.StorageOperation.__init__ = _stamped(module.StorageOperation.__init__)


def _wrap_hit_query(module: ModuleType) -> None:
    cls = module.HybridCacheController
    cls._storage_hit_query = _query_probe(cls._storage_hit_query)


def _wrap_submit(module: ModuleType) -> None:
    cls = module.UnifiedRadixCache
    cls.prefetch_from_storage = _submit_probe(cls.prefetch_from_storage)


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    PAGE_TRANSFER: _wrap_page_transfer,
    HIT_QUERY: _wrap_hit_query,
    SUBMIT: _wrap_submit,
}


def install() -> None:
    """Add a post-import patcher for the probed modules (after the CPU patches)."""
    import sys

    from cpu_server_patches import PostImportPatcher

    sys.meta_path.insert(0, PostImportPatcher(PATCHES))
