"""KVPackConnector: vLLM's `KVConnectorBase_V1` over kvpack's store.

The class only routes vLLM's calls to the half that runs in this process
(`SchedulerSide` in the engine core, `WorkerSide` in each worker) and
translates between vLLM's and kvpack's types; policy and storage live in the
core (`kvpack.store`). Use it by name once the plugin is installed::

    --kv-transfer-config '{"kv_connector":"KVPackConnector","kv_role":"kv_both",
                           "kv_connector_extra_config":{...kvpack config...}}'

or with ``"kv_connector_module_path":"kvpack.vllm_plugin"``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .kv_events import router_events, tier_feed, worker_events
from .metadata import KVPackConnectorMetadata
from .prom import KVPackPromMetrics, cache_hit_sources
from .scheduler import SchedulerSide
from .scopes import load_config, make_scope
from .worker import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvpack import HitSources, Session

log = logging.getLogger("kvpack.vllm")


@dataclass
class KVPackConnectorStats(KVConnectorStats):
    """Counters of one interval (hit tokens, blocks loaded/saved, failures), summed over workers."""

    def reset(self) -> None:
        fresh: dict[str, Any] = {}
        self.data = fresh

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """Each counter's sum, for vLLM's log line (its label sets go to /metrics: `prom`)."""
        return {k: v for k, v in self.data.items() if "{" not in k}

    def is_empty(self) -> bool:
        return not self.data


class KVPackConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. Supports vLLM's hybrid allocator (several KV cache
    groups: sliding-window and Mamba hybrids), so vLLM keeps it on for those models."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.kvpack_config = load_config(vllm_config)  # ConfigError names the field: fails start-up
        # ValueError for KV cache groups kvpack cannot store: fails start-up with the reason
        self.scope = make_scope(vllm_config, self.kvpack_config, kv_cache_config)
        ktc = self._kv_transfer_config
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if ktc.kv_load_failure_policy != "recompute":
                # A cache must never fail a request: a load that fails is a recompute (principle 4).
                log.info("kvpack: setting kv_load_failure_policy='recompute' (was %r)", ktc.kv_load_failure_policy)
                ktc.kv_load_failure_policy = "recompute"
            self.scheduler = SchedulerSide(
                self.kvpack_config,
                self.scope,
                can_load=ktc.is_kv_consumer,
                can_save=ktc.is_kv_producer,
                sync_load_max_blocks=_sync_load_max_blocks(kv_cache_config),
            )
            _warn_if_killed_before_flush(vllm_config, self.kvpack_config.shutdown_flush_s)
            # names the fingerprint in the shared indexes (`kvpack usage`)
            self.scheduler.session.bind_group(
                self.scope.fingerprint, self.scope.spec.describe(vllm_config.model_config.model)
            )
        else:
            self.worker = WorkerSide(vllm_config, self.kvpack_config, self.scope)
        self._num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config is not None else 0
        # vLLM's KV events (--kv-events-config): the workers' tier events, published by the scheduler side
        self.router_events = (
            router_events(vllm_config, self.kvpack_config, self.scope, self.scheduler.session)
            if self.scheduler is not None
            else None
        )
        self._tier_feed = tier_feed(vllm_config, self.worker.session) if self.worker is not None else None
        self._hit_sources: dict[str, HitSources] = {}
        """Per running request whose hit the workers load: the hit by tier (dropped when it finishes)."""

    @property
    def session(self) -> Session:
        """This process's `kvpack.Session` (the scheduler's lookup view, or the worker's)."""
        side = self.scheduler or self.worker
        assert side is not None
        return side.session

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # -- worker side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches, self._num_blocks)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: object) -> bool:
        """vLLM 0.33's sleep mode: kvpack stops copying the cache while it is released."""
        return True

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33 calls this before sleep releases the KV cache's memory (`release_caches`)."""
        if self.worker is not None:
            self.worker.release_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33 calls this after wake-up mapped the KV cache again (`restore_caches`)."""
        if self.worker is not None:
            self.worker.restore_caches()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._connector_metadata
        if isinstance(meta, KVPackConnectorMetadata):
            # saves at request finish (blocks vLLM keeps, nothing this step computes) go first:
            # a load in this step (a follow-up turn hitting that tail) waits for them
            finished = [job for job in meta.saves if not job.capture]
            if finished:
                self.worker.queue_saves(KVPackConnectorMetadata([], finished))
            has_forward = getattr(forward_context, "attn_metadata", None) is not None
            self.worker.start_step(meta, has_forward)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # an async load completes before vLLM schedules the request, a sync one in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # saves are whole blocks of all layers, queued once per step in wait_for_save

    def wait_for_save(self) -> None:
        assert self.worker is not None
        meta = self._connector_metadata
        if isinstance(meta, KVPackConnectorMetadata):
            captures = [job for job in meta.saves if job.capture]  # the rest went in start_load_kv
            if captures:
                self.worker.queue_saves(KVPackConnectorMetadata([], captures))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        sending, recving, _ = self.worker.get_finished()
        return (sending or None), (recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Done saves and loads, and the requests whose load failed (vLLM recomputes them;
        with one KV cache group the failed blocks also go out through
        `get_block_ids_with_load_errors`, so vLLM recomputes from the first bad block)."""
        assert self.worker is not None
        sending, recving, failed = self.worker.get_finished()
        return KVConnectorTransferResults(sending, recving, failed if self.scope.hybrid else set())

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_report() if self.worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self.scheduler or self.worker
        stats = side.take_stats() if side is not None else {}
        return KVPackConnectorStats(data=stats) if stats else None

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return worker_events(self._tier_feed)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.router_events.take() if self.router_events is not None else ()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPackConnectorStats(data=dict(data or {}))

    def reset_cache(self) -> bool | None:
        """vLLM's reset of external caches (``reset_prefix_cache(reset_connector=True)``): kvpack's
        reset rule (`kvpack.policy.clearing`), applied by the scheduler side (`vllm_plugin.resets`)."""
        return self.scheduler.resets.apply() if self.scheduler is not None else False

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """kvpack's counters on the server's own /metrics (`prom.KVPackPromMetrics`)."""
        return KVPackPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for side in (self.worker, self.scheduler):
            if side is not None:
                side.close()

    # -- scheduler side ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        if self.router_events is not None:
            self.router_events.follow(request)
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        sources = self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        if sources is not None:
            self._hit_sources[request.request_id] = sources

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The accepted hit by vLLM's cache source: host memory, disk, remote (`prom`)."""
        return cache_hit_sources(self._hit_sources.get(request.request_id), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        meta = self.scheduler.build_connector_meta(scheduler_output)
        if self.router_events is not None:
            self.router_events.note_saves(meta)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(
            connector_output.finished_sending, connector_output.kv_connector_worker_meta
        )
        if self.router_events is not None:
            self.router_events.rescope(self.scheduler.scope.fingerprint)
            self.router_events.on_worker_events(connector_output.kv_cache_events)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        if self.router_events is not None:
            self.router_events.finished(request.request_id)
        self._hit_sources.pop(request.request_id, None)
        return self.scheduler.request_finished(request, block_ids)

    def register_finished_partial_tail(
        self, request: Request, block_ids: tuple[list[int], ...], partial_tail_offloads: list[tuple[int, int, int]]
    ) -> bool:
        assert self.scheduler is not None
        return self.scheduler.register_finished_partial_tail(request, block_ids, partial_tail_offloads)


def _warn_if_killed_before_flush(vllm_config: VllmConfig, flush_s: float) -> None:
    """vLLM's multi-process engine SIGKILLs its engine core and workers `shutdown_timeout`
    seconds after SIGTERM (the OpenAI server's default is 0: at once), before kvpack's exit
    flush can write what is still queued. Say so once, at start-up, with the fix."""
    from vllm import envs

    if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        return  # in-process: kvpack's exit flush runs in this very process
    grace = int(getattr(vllm_config, "shutdown_timeout", 0) or 0)
    if grace < flush_s:
        log.warning(
            "kvpack: vLLM stops this engine %d s after SIGTERM/Ctrl-C (--shutdown-timeout); stores still queued "
            "then are lost. Start vLLM with --shutdown-timeout %d to let kvpack write them (shutdown_flush_s).",
            grace,
            int(flush_s + 0.999),
        )


SYNC_LOAD_MAX_BYTES = 64 << 20
"""The largest hit (one worker's bytes) loaded inside the engine step that computes the rest
of its prompt: the forward waits for a host copy of at most this many bytes; larger hits load
in the background and cost the request one more step instead of stalling every other request."""


def _sync_load_max_blocks(kv_cache_config: KVCacheConfig | None) -> int:
    """`SYNC_LOAD_MAX_BYTES` in blocks of this engine's KV cache (all layers of one worker)."""
    if kv_cache_config is None or not int(kv_cache_config.num_blocks):
        return 0
    per_block = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors) // int(kv_cache_config.num_blocks)
    return SYNC_LOAD_MAX_BYTES // per_block if per_block > 0 else 0
