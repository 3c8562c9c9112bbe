"""kvpack in vLLM's own metrics: cached tokens by source, and kvpack's counters on /metrics.

Sources (``vllm:prompt_tokens_cached_by_source``): the core splits each accepted hit by
the `kvpack.Medium` of the tier that holds it (`Session.accept_hit`); this module names
those as vLLM does. Host memory (a process's memory tier, the host store) is ``host``, a
disk folder ``disk``. Mooncake is a remote store, which vLLM 0.32 counts as
``external_unspecified`` ("uninstrumented connector or remote store", its
`CacheHitSource` says; its own Mooncake store connector reports that); ``p2p`` is what
its peer-to-peer transfers report (NIXL, the Mooncake transfer connector): KV read from
another engine's memory, which a store is not.

Counters (`KVPackPromMetrics`): every kvpack counter (`kvpack.exported_counters`) as
``vllm:kvpack_<name>_total``, summed over tenants (kvpack's own port keeps the tenant
label), with vLLM's ``model_name`` and ``engine`` labels. vLLM hands each engine core's
stats (its scheduler side's and its workers', summed by `KVPackConnectorStats.aggregate`)
to `observe` with that engine's index, so every engine core and data-parallel rank has its
series and a sum over ``engine`` is the whole server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpack import EngineCounters, HitSources, Medium

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

PREFIX = "vllm:kvpack_"
"""kvpack's counters on vLLM's /metrics: ``vllm:kvpack_<name>_total``."""

SOURCE_OF: dict[Medium | None, CacheHitSource] = {
    Medium.HOST: CacheHitSource.HOST,
    Medium.DISK: CacheHitSource.DISK,
    Medium.REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED,
    None: CacheHitSource.EXTERNAL_UNSPECIFIED,
}
"""vLLM's source of each medium (see the module docstring)."""


def cache_hit_sources(sources: HitSources | None, external_tokens: int) -> dict[CacheHitSource, int]:
    """vLLM's split of `external_tokens` from the core's (`external_unspecified` for all of
    them when the core's does not sum to exactly that: vLLM's rule for a bad split)."""
    if external_tokens <= 0:
        return {}
    if sources is None or sources.tokens != external_tokens:
        return {CacheHitSource.EXTERNAL_UNSPECIFIED: external_tokens}
    out: dict[CacheHitSource, int] = {}
    for medium, n in sources.by_medium.items():
        if n:
            source = SOURCE_OF[medium]
            out[source] = out.get(source, 0) + n
    return out


class KVPackPromMetrics(KVConnectorPromMetrics):
    """kvpack's counters on vLLM's Prometheus registry (`kvpack.EngineCounters`; see the
    module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = EngineCounters(self._counter_cls, PREFIX, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """One interval of engine core `engine_idx` (`KVPackConnectorStats.data`)."""
        self._counters.add(transfer_stats_data or {}, engine_idx)
