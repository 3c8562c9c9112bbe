"""SGLang's own storage metrics (``--enable-metrics``) from kvpack: `KVPackStorage.get_stats`
returns SGLang's `StorageMetrics` with the pages and bandwidth of each get (prefetch) and set
(backup) since the last call, as its HiCache controller expects, and its collector takes it.
Real host pools, the real backend class, real files."""

from __future__ import annotations

from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector
from sglang_parts import alloc_pages, fill_random, kvpack_extra, make_backend, make_pool, page_keys


def test_get_stats_reports_each_batch_since_the_last_call(store_dir):
    pool = make_pool("mha", "page_first")
    backend = make_backend(pool, kvpack_extra(store_dir))
    try:
        fill_random(pool, seed=41)
        keys = page_keys(4, seed=42)
        assert backend.batch_set_v1(keys, alloc_pages(pool, 4)) == [True] * 4
        assert backend.flush(10)
        assert backend.batch_get_v1(keys[:3], alloc_pages(pool, 3)) == [True] * 3
        assert backend.batch_get_v1(page_keys(2, seed=43), alloc_pages(pool, 2)) == [False, False]  # moves nothing
        stats = backend.get_stats()
        assert isinstance(stats, StorageMetrics)
        assert (stats.backup_pgs, stats.prefetch_pgs) == ([4], [3])
        assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
        assert len(stats.prefetch_bandwidth) == 1 and stats.prefetch_bandwidth[0] > 0
        StorageMetricsCollector({"storage_backend": "dynamic"}).log_storage_metrics(stats)  # SGLang's own use
        again = backend.get_stats()  # what was handed over is not handed over twice
        assert (again.prefetch_pgs, again.backup_pgs, again.prefetch_bandwidth, again.backup_bandwidth) == (
            [],
            [],
            [],
            [],
        )
        assert backend.batch_get_v1(keys, alloc_pages(pool, 4)) == [True] * 4
        assert backend.get_stats().prefetch_pgs == [4]
    finally:
        backend.close()
