"""The vLLM adapter's translation of kvpack's figures into vLLM's own: `HitSources` ->
`CacheHitSource` (Mooncake is vLLM's remote store: external_unspecified), and the stats
payload's log line (plain sums) beside its /metrics label sets."""

from __future__ import annotations

import pytest
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpack import HitSources, Medium, series_key
from kvpack.vllm_plugin.connector import KVPackConnectorStats
from kvpack.vllm_plugin.prom import cache_hit_sources

pytestmark = pytest.mark.vllm


def test_each_medium_is_named_as_vllm_names_it_and_a_split_that_does_not_sum_is_unattributed() -> None:
    split = HitSources(
        {"memory": 128, "host": 64, "disk": 100, "mooncake": 8},
        {Medium.HOST: 192, Medium.DISK: 100, Medium.REMOTE: 8},
    )
    assert cache_hit_sources(split, 300) == {
        CacheHitSource.HOST: 192,
        CacheHitSource.DISK: 100,
        CacheHitSource.EXTERNAL_UNSPECIFIED: 8,
    }
    assert cache_hit_sources(split, 299) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 299}  # vLLM's own rule
    assert cache_hit_sources(None, 5) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 5}
    assert cache_hit_sources(split, 0) == {}


def test_workers_stats_sum_key_by_key_and_the_log_line_keeps_the_plain_sums() -> None:
    disk = series_key("loaded_bytes", {"tier": "disk"})
    a = KVPackConnectorStats(data={"loaded_bytes": 10, disk: 10})
    b = KVPackConnectorStats(data={"loaded_bytes": 5, disk: 5, "save_errors": 1})
    merged = a.aggregate(b)
    assert merged.data == {"loaded_bytes": 15, disk: 15, "save_errors": 1}
    assert merged.reduce() == {"loaded_bytes": 15, "save_errors": 1}
