"""KVPackStorage: kvpack as an SGLang HiCache L3 storage backend.

Loaded by SGLang's ``--hicache-storage-backend dynamic`` as
``KVPackStorage(storage_config, {})``. It only translates: SGLang page hashes
become kvpack chunk ids, host pools become members of one group per page, and
every storage decision (tiers, eviction, tenants, checks, write-back) is the
core's, reached through one `kvpack.Session`.

Interfaces:

- zero-copy v1 (``"interface_v1": 1``): ``batch_exists``, ``batch_get_v1``,
  ``batch_set_v1`` on the KV host pool given to ``register_mem_pool_host``;
- multi-pool v2: ``batch_exists_v2``, ``batch_get_v2``, ``batch_set_v2`` for
  the pools given to ``register_mem_host_pool_v2`` (``draft``,
  ``draft_indexer``, ``draft_swa``, ``mamba``, ``swa``, ``indexer``...);
- the legacy ``get``/``set``/``batch_get``/``batch_set``/``exists`` (SGLang's
  generic path without ``interface_v1``), stored as a separate ``kvflat``
  member because SGLang's flat page order is not the zero-copy order.

Hits (principle 1): a page prefix is reported only where every required pool
is present. ALL_PAGES pools must cover the whole prefix, TRAILING_PAGES pools
the last ``len(keys)`` pages before its end (SGLang's sidecar semantics). A
draft pool missing where the target is stored is a partial hit, counted by
member name, and not reported as restorable under the default ``recompute``
draft policy (``target_only`` reports the target's prefix; SGLang then clamps
the hit to what the draft pool actually loads). Every pool is a member of the
page's group (`Coverage.ALL` or `TRAILING`), so the core's lookup decides all of
this; the adapter only translates its answer.

Lifecycle (`kvpack.store.lifecycle`): a lookup remembers where it found each page;
the get that follows loads each page from that tier first (a page evicted in
between is counted as ``evicted_before_load``), and a set stores only what
`KVStore.prepare_store` says is not stored or being stored yet.

Modules: this one translates SGLang's calls (lookups, v1 and v2 gets and sets, the
bounded waits); `registry` binds host pools to members; `pages` turns a batch's keys
and host indices into session loads and saves; `legacy` is the by-value interface.

Keys: ``StoreKey(tenant, group fingerprint, page hash, member)``. The group
fingerprint covers engine + host layout, the model's identity (a digest of the
checkpoint, `sglang_model_identity`, not its path), dtype, page size and TP/PP
sizes; each object's header carries its member's full layout fingerprint
(rank, pool geometry), so a page from another layout is a counted miss, never
a load. MLA (replicated) pools are keyed by DCP shard and written only by the
storage writer of that shard (``is_storage_writer``); TP-sharded pools are
keyed by TP rank. A canonical KV pool (`kvpack.canonical`, shared with vLLM)
replaces both: its group has no engine or TP size, each rank's member is its
KV-head range (`pools.rank_heads`), and a replicated head is stored by its
first rank only. With TP > 1 each rank checks its own shard and SGLang's MIN
all-reduce of the hit turns that into "every rank's shard is present".

Failure behaviour: no method on the data path raises or returns None
(SGLang's controller threads die on it). A broken tier, a corrupt object or a
bad argument is a per-key False (or a shorter hit), counted in the store's
metrics and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from kvpack import AdapterRefusal, Coverage, Direction, MemberSpec, Session, with_weights

from .config import split_extra_config
from .legacy import FlatMember, LegacyPageInterface
from .pages import ENGINE, PageCopies
from .pools import ParallelInfo, PoolBinding, pool_name, sglang_kv_heads, sglang_model_identity
from .registry import PoolRegistry
from .weights import WeightUpdates

try:  # SGLang is present wherever this backend is loaded; the import keeps kvpack importable without it.
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolTransfer,
        PoolTransferResult,
    )
    from sglang.srt.observability.metrics_collector import StorageMetrics
except ImportError as exc:  # pragma: no cover - exercised only without sglang
    raise ImportError(f"kvpack.sglang_plugin needs SGLang (pip install 'kvpack[sglang]'): {exc}") from exc

log = logging.getLogger("kvpack.sglang")


def parallel_info(storage_config: HiCacheStorageConfig, model_id: str) -> ParallelInfo:
    """SGLang's storage config as kvpack's `ParallelInfo` (model identity, ranks, MLA, writer)."""
    return ParallelInfo(
        model=sglang_model_identity(storage_config.model_name, model_id),
        tp_rank=int(storage_config.tp_rank),
        tp_size=int(storage_config.tp_size),
        pp_rank=int(storage_config.pp_rank),
        pp_size=int(storage_config.pp_size),
        dcp_rank=int(getattr(storage_config, "dcp_rank", 0) or 0),
        dcp_size=int(getattr(storage_config, "dcp_size", 1) or 1),
        is_mla_model=bool(storage_config.is_mla_model),
        is_storage_writer=bool(getattr(storage_config, "is_storage_writer", True)),
        kv_heads=sglang_kv_heads(storage_config.model_name),
        model_name=str(storage_config.model_name or ""),
    )


class KVPackStorage(LegacyPageInterface, HiCacheStorage):
    """See the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.config, self.engine_config = split_extra_config(getattr(storage_config, "extra_config", None))
        self.storage_config = storage_config
        par = parallel_info(storage_config, self.config.model_id)
        self.tenant = self.config.tenant
        self.zero_copy = bool(self.engine_config.get("interface_v1", 0))
        """Whether SGLang reads and writes KV pages through `batch_get_v1`/`batch_set_v1` (its
        test for a dynamic backend); otherwise through the legacy by-value `batch_get`/`batch_set`."""
        # A batch's copies and file I/O run on io_threads threads inside the tiers; one store
        # call per SGLang call. Write-through: SGLang calls batch_set from its backup thread
        # (never its forward path) and takes True as stored, and at shutdown it SIGKILLs the
        # scheduler process (kill_process_tree), so nothing is left queued once True is returned.
        self.session = Session.start(self.config, copy_threads=max(1, self.config.io_threads), write_back=False)
        self.pools = PoolRegistry(self.session, par, self.config.io_threads)
        self.pages = PageCopies(self.session, self.tenant, self.pools)
        self.weights = WeightUpdates.find(
            lambda state: self.pools.rescope(with_weights(par.model, state.identity)), self.session.report.metrics
        )
        """In-place weight updates (`kvpack.sglang_plugin.weights`): a change rescopes every key and
        member fingerprint from the start-up model identity; None outside a scheduler."""
        log.info(
            "kvpack: SGLang storage backend for tenant %s, tiers %s, %s, tp %d/%d pp %d/%d mla=%s writer=%s",
            self.tenant,
            self.session.tiers.names,
            "zero-copy pages (interface_v1)"
            if self.zero_copy
            else "pages copied by SGLang's generic path (no interface_v1: not shared with vLLM or zero-copy servers)",
            par.tp_rank,
            par.tp_size,
            par.pp_rank,
            par.pp_size,
            par.is_mla_model,
            par.is_storage_writer,
        )

    def _poll_weights(self, what: str, pages: int = 0) -> bool:
        """`WeightUpdates.saves_dropped` at the start of a call (`pages`: a save's); an error in
        it is a data-path error (nothing dropped: the call that follows answers)."""
        try:
            return self.weights is not None and self.weights.saves_dropped(pages)
        except Exception as exc:
            return bool(self._data_path_error(what, exc, False))

    # -- registration (`PoolRegistry`) ---------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV (anchor) host pool; fixes the group fingerprint of every page."""
        self.pools.register_anchor(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        self.pools.register(host_pool, host_pool_name)

    def binding(self, name: Any) -> PoolBinding | None:
        return self.pools.binding(name)

    @property
    def mem_pool_host(self) -> Any:
        return self.pools.mem_pool_host

    @property
    def group_fingerprint(self) -> str:
        """Every page's group fingerprint (fixed by `register_mem_pool_host`; "" before)."""
        return self.session.group_fingerprint

    # -- lookups ------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading pages with every required member: the KV member SGLang's gets read (the
        zero-copy ``kv`` object with ``interface_v1``, the legacy flat page without), plus
        every registered draft pool (a KV-only prefix while a draft pool exists is partial)."""
        try:
            self._poll_weights("batch_exists")
            if self.pools.kv_refused:
                return 0
            kv = self._kv_read_by_gets()
            members: list[PoolBinding | FlatMember] = [kv] if kv is not None else []
            members.extend(self.pools.drafts())
            return self._exists(list(keys), members, []).kv_hit_pages
        except Exception as exc:
            return self._data_path_error("batch_exists", exc, 0)

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        try:
            self._poll_weights("batch_exists_v2")
            if self.pools.kv_refused:
                return PoolTransferResult(0, {}, [])
            kv, read = self.pools.kv, self._kv_read_by_gets()
            all_pages: list[PoolBinding | FlatMember] = [read] if read is not None else []
            trailing: list[tuple[PoolBinding, int]] = []
            for t in pool_transfers or []:
                b = self.binding(t.name)
                if b is None:
                    log.warning("kvpack: batch_exists_v2 for unregistered/unsupported pool %s", pool_name(t.name))
                    return PoolTransferResult(0, {}, [])
                policy = getattr(t, "hit_policy", PoolHitPolicy.ALL_PAGES)
                if policy == PoolHitPolicy.TRAILING_PAGES:
                    trailing.append((b, max(1, len(t.keys) if t.keys else 1)))
                elif policy == PoolHitPolicy.ALL_PAGES and b is not kv:
                    all_pages.append(b)
                # BLOCK_GROUPS pools "never gate the KV hit" (SGLang); kvpack gives them no verdict.
            return self._exists(list(keys), all_pages, trailing)
        except Exception as exc:
            return self._data_path_error("batch_exists_v2", exc, PoolTransferResult(0, {}, []))

    def _kv_read_by_gets(self) -> PoolBinding | FlatMember | None:
        """The KV member SGLang's page gets read: the zero-copy ``kv`` object with
        ``interface_v1``, the legacy flat page without (`zero_copy`)."""
        return self.pools.kv if self.zero_copy else self._flat_binding()

    def _exists(
        self,
        keys: list[str],
        all_pages: Sequence[PoolBinding | FlatMember],
        trailing: Sequence[tuple[PoolBinding, int]],
    ) -> PoolTransferResult:
        """One core lookup over every pool as a member: ALL_PAGES pools cover every page,
        TRAILING_PAGES pools the last `window` pages before the hit's end
        (`Coverage.TRAILING`); the core applies the windows and the draft policy."""
        if not keys or not self._valid_chunks(keys):
            return PoolTransferResult(0, {}, [])
        self.session.wait_ready()  # at once unless a tier makes its first connect; HiCache's prefetch thread
        pools: dict[str, tuple[PoolBinding | FlatMember, MemberSpec]] = {}
        for b in all_pages:
            pools.setdefault(b.member, (b, b.spec))
        for b, window in trailing:
            pools.setdefault(b.member, (b, replace(b.spec, coverage=Coverage.TRAILING, window_chunks=window)))
        specs = [spec for _, spec in pools.values()]
        alternatives, names = self.pools.other_splits(specs)
        lookup = self.session.lookup(self.tenant, keys, specs, self.pools.page_size, alternatives=alternatives)
        hits: dict[str, int] = {}
        for m, c in lookup.member_hits.items():
            pool = pools[m][0].name if m in pools else names[m]
            hits[pool] = min(hits.get(pool, c), c)
        return PoolTransferResult(lookup.hit_chunks, {p: c for p, c in hits.items() if c}, list(lookup.restorable))

    def _valid_chunks(self, keys: Sequence[str]) -> bool:
        return self.pages.valid(keys)

    # -- zero-copy v1 -------------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        try:
            self._poll_weights("batch_get_v1")
            if self.pools.anchor_only:
                return [True] * len(keys)  # logical anchor: v2 pools carry the data (as SGLang's own backends)
            return self.pages.get(self.pools.kv, "kv", list(keys), host_indices)
        except Exception as exc:
            return self._data_path_error("batch_get_v1", exc, [False] * len(keys))

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        try:
            if self._poll_weights("batch_set_v1", len(keys)) or self.pools.anchor_only:
                return [True] * len(keys)  # held: dropped, reported done (the pages are of other weights)
            return self.pages.set(self.pools.kv, "kv", list(keys), host_indices)
        except Exception as exc:
            return self._data_path_error("batch_set_v1", exc, [False] * len(keys))

    # -- multi-pool v2 ------------------------------------------------------------

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        self._poll_weights("batch_get_v2")
        return self._each_pool(transfers, self.pages.get, "batch_get_v2")

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        if self._poll_weights("batch_set_v2", sum(len(t.keys or []) for t in transfers or [])):
            return {t.name: [True] * len(t.keys or []) for t in transfers or []}
        return self._each_pool(transfers, self.pages.set, "batch_set_v2")

    def _each_pool(
        self,
        transfers: list[PoolTransfer],
        op: Callable[[PoolBinding | None, str, list[str], torch.Tensor], list[bool]],
        what: str,
    ) -> dict[str, list[bool]]:
        """Run `op` per pool transfer; a pool that fails answers False per key."""
        out: dict[Any, list[bool]] = {}
        for t in transfers or []:
            keys = list(t.keys or [])
            try:
                out[t.name] = op(self.binding(t.name), pool_name(t.name), keys, t.host_indices)
            except Exception as exc:
                out[t.name] = self._data_path_error(what, exc, [False] * len(keys))
        return out

    def _data_path_error(self, op: str, exc: BaseException, fallback: Any) -> Any:
        """`fallback` (a miss) for a call that raised, counted and logged: SGLang's controller
        threads die on an exception or a None."""
        self.session.report.refused(ENGINE, AdapterRefusal.EXCEPTION)
        log.warning(
            "kvpack: %s failed, answering a miss: %s: %s",
            op,
            type(exc).__name__,
            exc,
            exc_info=log.isEnabledFor(logging.DEBUG),
        )
        return fallback

    # -- lifecycle ------------------------------------------------------------------

    def wait_ready(self, timeout_s: float = 10.0) -> bool:
        """Wait (bounded) until tiers that connect in the background (Mooncake) are up."""
        return self.session.wait_ready(timeout_s)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait (bounded) until every accepted page reached every tier."""
        return self.session.flush(timeout_s)

    def clear(self) -> None:
        """SGLang's ``/hicache/storage-backend/clear``: kvpack's reset rule (`kvpack.policy.clearing`):
        by default this instance's model's objects, every tenant, every tier it reaches; the
        config's ``reset`` section narrows, widens or turns it off. Logged in one line."""
        self.session.reset("SGLang storage clear")

    def get_stats(self) -> StorageMetrics:
        """SGLang's own storage metrics (``--enable-metrics``): pages and GiB/s of each get
        (prefetch) and set (backup) call since the last call; SGLang records each in its
        histograms. kvpack's own counters: `metrics_snapshot()`, ``metrics_port``."""
        figures = self.pages.batches.take()
        loads, saves = figures[Direction.LOAD], figures[Direction.STORE]
        return StorageMetrics(
            prefetch_pgs=loads.pages,
            backup_pgs=saves.pages,
            prefetch_bandwidth=loads.gb_per_s,
            backup_bandwidth=saves.gb_per_s,
        )

    def metrics_snapshot(self) -> dict[str, dict[str, float]]:
        return self.session.report.snapshot()

    def close(self) -> None:
        self.session.close()


__all__ = ["KVPackStorage"]
