"""KVPackStorage: kvpack as an SGLang HiCache L3 storage backend.

Loaded by SGLang's ``--hicache-storage-backend dynamic`` as
``KVPackStorage(storage_config, {})``. It only translates: SGLang page hashes
become kvpack chunk ids, host pools become members of one group per page, and
every storage decision (tiers, eviction, tenants, checks, write-back) is the
core's `KVStore`.

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

Lifecycle (`kvpack.lifecycle`): a lookup remembers where it found each page;
the get that follows loads each page from that tier first (a page evicted in
between is counted as ``evicted_before_load``), and a set stores only what
`KVStore.prepare_store` says is not stored or being stored yet.

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
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from .. import Coverage, KVLayoutSpec, LoadItem, MemberObject, MemberRole, MemberSpec, Payload, Session
from .config import split_extra_config
from .legacy import LegacyPageInterface
from .pools import ParallelInfo, PoolBinding, canonical_group, checkpoint_kv_heads, pool_name, sglang_model_identity

try:  # SGLang is present wherever this backend is loaded; the import keeps kvpack importable without it.
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorage,
        HiCacheStorageConfig,
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolTransfer,
        PoolTransferResult,
    )
except ImportError as exc:  # pragma: no cover - exercised only without sglang
    raise ImportError(f"kvpack.sglang_plugin needs SGLang (pip install 'kvpack[sglang]'): {exc}") from exc

log = logging.getLogger("kvpack.sglang")

ADAPTER = "sglang"
"""`tier` label of metrics the adapter itself records (bad arguments, exceptions)."""


class KVPackStorage(LegacyPageInterface, HiCacheStorage):
    """See the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.config, self.engine_config = split_extra_config(getattr(storage_config, "extra_config", None))
        self.storage_config = storage_config
        self.par = ParallelInfo(
            model=sglang_model_identity(storage_config.model_name, self.config.model_id),
            tp_rank=int(storage_config.tp_rank),
            tp_size=int(storage_config.tp_size),
            pp_rank=int(storage_config.pp_rank),
            pp_size=int(storage_config.pp_size),
            dcp_rank=int(getattr(storage_config, "dcp_rank", 0) or 0),
            dcp_size=int(getattr(storage_config, "dcp_size", 1) or 1),
            is_mla_model=bool(storage_config.is_mla_model),
            is_storage_writer=bool(getattr(storage_config, "is_storage_writer", True)),
            kv_heads=checkpoint_kv_heads(storage_config.model_name),
        )
        self.tenant = self.config.tenant
        # A batch's copies and file I/O run on io_threads threads inside the tiers; the
        # backend makes one store call per SGLang call. The session's start-up builds the
        # copy kernels (memory-tier stores use the native region copy) and asks for AMX
        # (SGLang's CPU attention may use AMX tiles first in a short step over restored
        # pages). Write-through: SGLang calls batch_set from its own backup thread (never
        # its forward path) and takes True as stored, and at shutdown it SIGKILLs the
        # scheduler process (kill_process_tree), so nothing may be left queued once True
        # is returned.
        self.session = Session.start(self.config, copy_threads=max(1, self.config.io_threads), write_back=False)
        self.store = self.session.store
        self.metrics = self.store.metrics
        self.mem_pool_host: Any = None
        self.registered_pools: dict[str, Any] = {}
        self._bindings: dict[str, PoolBinding] = {}
        self._binding_errors: dict[str, str] = {}
        self._lock = threading.Lock()
        log.info(
            "kvpack: SGLang storage backend for tenant %s, tiers %s, tp %d/%d pp %d/%d mla=%s writer=%s",
            self.tenant,
            [t.name for t in self.store.tiers],
            self.par.tp_rank,
            self.par.tp_size,
            self.par.pp_rank,
            self.par.pp_size,
            self.par.is_mla_model,
            self.par.is_storage_writer,
        )

    # -- registration -----------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV (anchor) host pool; fixes the group fingerprint of every page."""
        self.mem_pool_host = mem_pool_host
        layout = str(getattr(mem_pool_host, "layout", "unknown"))
        dtype = str(getattr(mem_pool_host, "dtype", "unknown")).removeprefix("torch.")
        page_size = int(getattr(mem_pool_host, "page_size", 1) or 1)
        self._layout_name = layout
        # a KV pool kvpack stores canonically shares its group with vLLM (`kvpack.canonical`)
        shared = (
            canonical_group(mem_pool_host, self.par, layout)
            if getattr(mem_pool_host, "kv_buffer", None) is not None
            else None
        )
        group = shared or KVLayoutSpec(
            engine=f"sglang:{layout}",
            model=self.par.model,
            dtype=dtype,
            chunk_tokens=page_size,
            tp_size=self.par.tp_size,
            pp_size=self.par.pp_size,
        )
        self.session.bind_group(group.group_fingerprint)
        self.page_size = page_size
        if getattr(mem_pool_host, "kv_buffer", None) is not None:
            self._bind("kv", mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        name = pool_name(host_pool_name)
        self.registered_pools[name] = host_pool
        if name == "kv" and self.mem_pool_host is None:
            self.register_mem_pool_host(host_pool)
            return
        if name != "kv" or "kv" not in self._bindings:
            self._bind(name, host_pool)

    def _bind(self, name: str, host_pool: Any) -> None:
        if not self.group_fingerprint:
            raise RuntimeError("kvpack: register_mem_pool_host must come before other host pools")
        try:
            # one conversion thread: SGLang backs pages up while its forward pass runs on the same cores
            # (a CPU server on 2 cores: rounds >= 2 TTFT 21 s with 2 conversion threads, 3.1 s with 1)
            binding = PoolBinding(name, host_pool, self.par, self._layout_name, copy_threads=1)
        except Exception as exc:  # a pool kvpack cannot describe: its pages always miss
            self._binding_errors[name] = str(exc)
            log.warning("kvpack: SGLang pool %s (%s) cannot be stored: %s", name, type(host_pool).__name__, exc)
            return
        with self._lock:
            self._bindings[name] = binding
        log.info(
            "kvpack: pool %s -> member %s (%d B/page in %d regions, %s)",
            name,
            binding.member,
            binding.page_bytes,
            binding.parts,
            "replicated" if binding.replicated else "sharded",
        )

    def binding(self, name: Any) -> PoolBinding | None:
        return self._bindings.get(pool_name(name))

    # -- lookups ------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading pages with every required member: KV, plus every registered
        draft pool (a KV-only prefix while a draft pool exists is partial)."""
        try:
            kv = self._bindings.get("kv")
            if kv is None and getattr(self.mem_pool_host, "kv_buffer", None) is not None:
                return 0  # the KV pool could not be bound: nothing is restorable
            drafts = [b for n, b in self._bindings.items() if b.spec.role is MemberRole.DRAFT and n != "draft_swa"]
            all_pages = ([kv] if kv is not None else []) + drafts
            result = self._exists(list(keys), all_pages, [])
            return result.kv_hit_pages
        except Exception as exc:
            return self._data_path_error("batch_exists", exc, 0)

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        try:
            kv = self._bindings.get("kv")
            if kv is None and getattr(self.mem_pool_host, "kv_buffer", None) is not None:
                return PoolTransferResult(0, {}, [])
            all_pages: list[PoolBinding] = [kv] if kv is not None else []
            trailing: list[tuple[PoolBinding, int]] = []
            missing_pool = False
            for t in pool_transfers or []:
                b = self.binding(t.name)
                if b is None:
                    missing_pool = True
                    log.warning("kvpack: batch_exists_v2 for unregistered/unsupported pool %s", pool_name(t.name))
                    continue
                policy = getattr(t, "hit_policy", PoolHitPolicy.ALL_PAGES)
                if policy == PoolHitPolicy.TRAILING_PAGES:
                    trailing.append((b, max(1, len(t.keys) if t.keys else 1)))
                elif policy == PoolHitPolicy.ALL_PAGES:
                    if b is not kv:
                        all_pages.append(b)
                # BLOCK_GROUPS pools "never gate the KV hit" (SGLang); kvpack gives them no verdict.
            if missing_pool:
                return PoolTransferResult(0, {}, [])
            return self._exists(list(keys), all_pages, trailing)
        except Exception as exc:
            return self._data_path_error("batch_exists_v2", exc, PoolTransferResult(0, {}, []))

    def _exists(
        self, keys: list[str], all_pages: Sequence[PoolBinding], trailing: Sequence[tuple[PoolBinding, int]]
    ) -> PoolTransferResult:
        """One core `KVStore.lookup` over every pool as a member: ALL_PAGES pools cover
        every page, TRAILING_PAGES pools the last `window` pages before the hit's end
        (`Coverage.TRAILING`); the core applies the windows and the draft policy."""
        if not keys or not self._valid_chunks(keys):
            return PoolTransferResult(0, {}, [])
        self.store.wait_warm()  # at once unless a tier makes its first connect; HiCache's prefetch thread
        pools: dict[str, tuple[PoolBinding, MemberSpec]] = {}
        for b in all_pages:
            pools.setdefault(b.member, (b, b.spec))
        for b, window in trailing:
            pools.setdefault(b.member, (b, replace(b.spec, coverage=Coverage.TRAILING, window_chunks=window)))
        specs = [spec for _, spec in pools.values()]
        alternatives, names = self._other_splits(specs)
        lookup = self.session.lookup(self.tenant, keys, specs, self.page_size, alternatives=alternatives)
        hits: dict[str, int] = {}
        for m, c in lookup.member_hits.items():
            pool = pools[m][0].name if m in pools else names[m]
            hits[pool] = min(hits.get(pool, c), c)
        return PoolTransferResult(lookup.hit_chunks, {p: c for p, c in hits.items() if c}, list(lookup.restorable))

    def _other_splits(self, specs: list[MemberSpec]) -> tuple[list[list[MemberSpec]], dict[str, str]]:
        """Canonical KV pool: `specs` with the KV member replaced by each other head split's
        members (objects a writer at another TP size stored: `kvpack.heads`), and the pool
        each of those members restores."""
        kv = self._bindings.get("kv")
        if kv is None or kv.canonical is None:
            return [], {}
        out, names = [], {}
        for objects in kv.sources[1:]:
            members = [MemberSpec(obj.member, obj.fingerprint, MemberRole.TARGET) for obj in objects]
            names.update({m.name: kv.name for m in members})
            out.append([m for spec in specs for m in (members if spec.name == kv.member else [spec])])
        return out, names

    @property
    def group_fingerprint(self) -> str:
        """Every page's group fingerprint (fixed by `register_mem_pool_host`; "" before)."""
        return self.session.group_fingerprint

    def _valid_chunks(self, keys: Sequence[str]) -> bool:
        try:
            self.session.check_chunks(keys)
        except (ValueError, TypeError) as exc:
            self.metrics.inc("tier_errors", tier=ADAPTER, status="bad_key")
            log.warning("kvpack: SGLang page key refused: %s", exc)
            return False
        return True

    # -- zero-copy v1 -------------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        try:
            if self.mem_pool_host is not None and getattr(self.mem_pool_host, "kv_buffer", None) is None:
                return [True] * len(keys)  # logical anchor: v2 pools carry the data (as SGLang's own backends)
            return self._get(self._bindings.get("kv"), "kv", list(keys), host_indices)
        except Exception as exc:
            return self._data_path_error("batch_get_v1", exc, [False] * len(keys))

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        try:
            if self.mem_pool_host is not None and getattr(self.mem_pool_host, "kv_buffer", None) is None:
                return [True] * len(keys)
            return self._set(self._bindings.get("kv"), "kv", list(keys), host_indices)
        except Exception as exc:
            return self._data_path_error("batch_set_v1", exc, [False] * len(keys))

    # -- multi-pool v2 ------------------------------------------------------------

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._each_pool(transfers, self._get, "batch_get_v2")

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._each_pool(transfers, self._set, "batch_set_v2")

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

    # -- copies -------------------------------------------------------------------

    def _usable(self, binding: PoolBinding | None, name: str, keys: list[str], op: str) -> bool:
        """Whether the pool is bound and every page key is a valid chunk hash (a refusal is
        counted and logged)."""
        if binding is None:
            why = self._binding_errors.get(name, "not registered")
            self.metrics.inc("tier_errors", tier=ADAPTER, status="unknown_pool")
            log.warning("kvpack: %s on pool %s refused: %s", op, name, why)
            return False
        return self._valid_chunks(keys)

    def _get(self, binding: PoolBinding | None, name: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """One `Session.prepare_load` / `complete_load` for the whole batch, straight into
        the host pool's pages, each from the tier the lookup found it in."""
        n = len(keys)
        if n == 0:
            return []
        if not self._usable(binding, name, keys, "get"):
            return [False] * n
        assert binding is not None
        loads = self._page_loads(binding, keys, host_indices)
        items = [item for _, part, _ in loads for item in part]
        # the session takes the tier its lookup found each page in: a page gone from there is counted
        batch = self.session.prepare_load(items)
        if binding.canonical is not None:  # converted on the way in: read the memory tier's copies in place
            results, views = self.session.complete_load_lent(batch)
        else:  # in place: the tiers write straight into the pool's pages
            results, views = self.session.complete_load(batch), [None] * len(items)
        ok = [True] * n
        at = 0
        for pages, part, _ in loads:  # a page is restored only when every object of it loaded
            for p, res in zip(pages, results[at : at + len(part)]):
                ok[p] = res.ok and ok[p]
            at += len(part)
        at = 0
        for pages, part, finish in loads:
            finish([ok[p] for p in pages], views[at : at + len(part)])
            at += len(part)
        if name == "kv":  # tokens restored into the engine, once per page (not per pool of it)
            self.metrics.inc("loaded_tokens", sum(ok) * binding.page_size, tenant=self.tenant)
        if not all(ok):
            log.debug("kvpack: %s get: %d of %d pages", name, sum(ok), n)
        return ok

    def _page_loads(
        self, binding: PoolBinding, keys: list[str], host_indices: torch.Tensor
    ) -> list[tuple[list[int], list[LoadItem], Callable[[Sequence[bool], Sequence[memoryview | None]], None]]]:
        """Per object of the pages (the pages it covers, its load items, what to call with
        those pages' results): the pool's own member, or, for pages the lookup found as
        another TP size's head ranges (`_other_splits`), one object per range. Pages of one
        batch may come from several splits (`kvpack.split_lookup`)."""
        n = len(keys)
        splits = self._located_splits(binding, keys) if binding.canonical is not None else [0] * n
        out: list[tuple[list[int], list[LoadItem], Callable[[Sequence[bool], Sequence[memoryview | None]], None]]] = []
        for split in sorted(set(splits)):
            pages = [i for i, s in enumerate(splits) if s == split]
            idx = host_indices if len(pages) == n else host_indices.reshape(n, -1)[pages].reshape(-1)
            names = [keys[i] for i in pages]
            if split == 0:
                payloads, finish = binding.load_buffers(idx, len(pages))
                out.append((pages, self.session.page_reads(self.tenant, binding.obj, names, payloads), finish))
                continue
            for obj in binding.sources[split]:
                payloads, finish = binding.range_load_buffers(idx, len(pages), obj)
                member = MemberObject(obj.member, obj.fingerprint, binding.page_size)  # bytes: the range's buffers
                out.append((pages, self.session.page_reads(self.tenant, member, names, payloads), finish))
        return out

    def _located_splits(self, binding: PoolBinding, keys: list[str]) -> list[int]:
        """Per page, the head split the last lookup found it under (0: the pool's own member,
        and pages no lookup found). One batched look per split, only for pages not found yet."""
        out = [0] * len(keys)
        rest = [i for i, own in enumerate(self.session.were_located(self.tenant, keys, binding.member)) if not own]
        for split, objects in enumerate(binding.sources[1:], start=1):
            if not rest:
                break
            found = self.session.were_located(self.tenant, [keys[i] for i in rest], objects[0].member)
            for i, hit in zip(rest, found):
                if hit:
                    out[i] = split
            rest = [i for i, hit in zip(rest, found) if not hit]
        return out

    def _set(self, binding: PoolBinding | None, name: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """Pages the session's de-duplication says are still to store (`Session.save_pages`),
        read in place from the host pool."""
        n = len(keys)
        if n == 0:
            return []
        if not self._usable(binding, name, keys, "set"):
            return [False] * n
        assert binding is not None
        if not binding.writes:
            return [True] * n  # replicated pool: this DCP shard's storage writer stores it

        def pages(todo: Sequence[int]) -> torch.Tensor:
            return host_indices if len(todo) == n else host_indices.reshape(n, -1)[list(todo)].reshape(-1)

        if binding.canonical is not None and self.session.lends_slots:  # converted straight into the tier's slots

            def fill(todo: Sequence[int], dsts: list[np.ndarray]) -> None:
                binding.fill_objects(pages(todo), len(todo), dsts)

            return self.session.save_pages_lent(self.tenant, binding.obj, keys, fill)
        after: list[Callable[[], None]] = []

        def payloads_of(todo: Sequence[int]) -> list[Payload]:
            payloads, done = binding.store_payloads(pages(todo), len(todo))
            after.append(done)
            return payloads

        try:
            return self.session.save_pages(self.tenant, binding.obj, keys, payloads_of)
        finally:
            for done in after:
                done()

    def _data_path_error(self, op: str, exc: BaseException, fallback: Any) -> Any:
        self.metrics.inc("tier_errors", tier=ADAPTER, status="exception")
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
        return self.store.wait_ready(timeout_s)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait (bounded) until every accepted page reached every tier."""
        return self.store.flush(timeout_s)

    def clear(self) -> None:
        """Not supported: kvpack's tiers are shared by instances and tenants, so one
        SGLang instance may not wipe them. Use kvpack's own tools."""
        log.warning("kvpack: clear() ignored: the kvpack store is shared across instances and tenants")

    def get_stats(self) -> None:
        """SGLang storage metrics are its own; kvpack's are in `metrics_snapshot()` / Prometheus."""
        return None

    def metrics_snapshot(self) -> dict[str, dict[str, float]]:
        return self.metrics.snapshot()

    def close(self) -> None:
        self.store.close()
        for binding in list(self._bindings.values()):
            binding.close()


__all__ = ["KVPackStorage"]
