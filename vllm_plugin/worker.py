"""Worker side: translates vLLM's per-step metadata into the core's transfer jobs and their
results back (`kvpack.TransferRunner` runs them: threads, ordering, bounds, counts).

Per step vLLM binds a `KVPackConnectorMetadata`. `start_step` (from ``start_load_kv``)
turns its loads into `LoadJob`s: read from the store into staging rows, then scatter
into the blocks; a synchronous load (`TransferJob.sync`) runs before this step's forward.
`queue_saves` (from ``wait_for_save``, right after the forward) turns the blocks that step
computed into capture `SaveJob`s (see `captures`), gathered before vLLM can free the
blocks. `get_finished` reports completed jobs; failed blocks go out through
`take_load_errors` so vLLM recomputes them. What this worker copies is fixed at
registration (`registration.WorkerLayout`); a load's staging rows and scatter are
`loads.BlockLoads`. A cache registration refuses disables the runner
(`TransferRunner.disable`): every load fails, so vLLM recomputes it, nothing is saved.

Draft KV (speculative decoding): PACKED objects hold the draft layers after
the target's; SIDECAR stores them as the ``draft`` member of the same group.
A load marked ``with_draft=False`` (target_only policy, the draft member was
missing) restores the target member and zeroes those blocks' draft layers:
the drafter never recomputes KV for tokens it was not scheduled, so the
request runs with empty draft state there (a counted partial hit). Saves run
once per step (in `wait_for_save`, which vLLM defers until the drafter ran),
however often the drafter's layers call `save_kv_layer`.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import torch

from kvpack import (
    ClearScope,
    KVPackConfig,
    LayoutError,
    LoadChunk,
    LoadJob,
    SaveJob,
    Session,
    TransferRunner,
    WeightsState,
    start_engine_process,
)
from kvpack.transfers import Staging

from .loads import BlockLoads, refused_plan, tokens_used
from .metadata import KVPackConnectorMetadata, KVPackWorkerMetadata, TransferJob
from .registration import RankPosition, WorkerLayout, register_layout
from .saves import gather_members, save_bytes
from .scopes import Scope
from .weights import EngineWeights, watch_weights

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvpack.vllm")


class WorkerSide:
    """One vLLM worker's connector side (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: KVPackConfig,
        scope: Scope,
        session: Session | None = None,
    ) -> None:
        self._caches: tuple[dict[str, torch.Tensor], int] | None = None
        """The registered KV caches and block count (a layout is registered again under new weights)."""
        self.config = config
        self.scope = scope
        self.vllm_config = vllm_config
        self.position = RankPosition.of_this_process(vllm_config)
        # the session builds every key, header and expectation; its store copies into the
        # memory tier with kvpack's native region copy once the kernels are loaded
        self.session = session if session is not None else Session.start(config, scope.fingerprint)
        self.layout: WorkerLayout | None = None
        """What this worker copies; fixed by `register_kv_caches` (None before, or refused)."""
        self.runner = TransferRunner(self.session, config)
        self.weights: EngineWeights | None = None
        """Watches this worker's model for in-place weight changes (set at registration)."""
        self.weights_now = WeightsState()
        """The weights this worker computes with: jobs planned under others are refused."""
        self._weights_news = False

    @property
    def staging(self) -> Staging:
        """Staging rows and copy streams (`kvpack.transfers.staging`) for the cache's device, set at registration."""
        return self.runner.staging

    @staging.setter
    def staging(self, staging: Staging) -> None:
        self.runner.use_staging(staging)

    # -- registration -----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Fix this worker's `WorkerLayout`. A cache kvpack cannot copy exactly never fails the
        engine's start: the error is logged once, counted (``kvpack_workers_disabled``), and
        the worker runs disabled (every load is a recompute, nothing is saved)."""
        # before the first forward: AMX permission (a 1-token step over a restored prefix may
        # be this process's first AMX use) and the copy kernels, not in the first load's bound
        start_engine_process()
        self.weights = watch_weights(self.vllm_config, self.config, self.session.report.metrics)
        self._caches = (kv_caches, num_blocks)
        first = next(iter(kv_caches.values()), None)
        if first is not None:  # on the model runner's thread: its current stream is the compute stream
            self.runner.use_device_of(first)
        self._register(self.scope)

    def _register(self, scope: Scope) -> None:
        """Fix what this worker copies and the fingerprints its objects carry under `scope`."""
        assert self._caches is not None
        kv_caches, num_blocks = self._caches
        try:
            self.layout = register_layout(self.vllm_config, scope, self.position, kv_caches, num_blocks)
        except LayoutError as exc:
            self.layout = None
            self.runner.disable(str(exc))

    # -- per step ---------------------------------------------------------------

    def start_step(self, meta: KVPackConnectorMetadata, has_forward: bool) -> None:
        """Hand this step's loads to the runner (called from start_load_kv); a synchronous
        one is loaded here, before the forward."""
        self.runner.begin_step(has_forward)
        if meta.clear is not None:
            self._clear(meta.clear)
        if meta.loads or meta.saves:  # a change between steps is seen before any job acts on it
            self.poll_weights()
        for job in meta.loads:  # a disabled runner (refused cache) fails each load: vLLM recomputes it
            if job.weights != self.weights_now.identity:  # planned under weights replaced since
                self.runner.refuse_load(self._load_job(job), sync=job.sync)
            elif job.sync:
                self.runner.load_now(self._load_job(job))
            else:
                self.runner.submit_load(self._load_job(job))

    def _clear(self, scope: ClearScope) -> None:
        """A reset the scheduler applied (`vllm_plugin.resets`), before this step's loads: the saves
        queued before it reach the store (bounded by ``io_timeout_ms``), then this process's tiers
        drop what it names (its memory tier; the shared ones again, for stores that landed since),
        and the scheduler's index of the workers' memory hears of the groups dropped."""
        self.runner.settle_saves(self.config.io_timeout_ms / 1000.0)
        report = self.session.reset("vLLM reset_cache (worker)", scope)
        memory = report.removed.get("memory")
        if memory is not None:
            self.runner.report_removed(memory.groups)

    def queue_saves(self, meta: KVPackConnectorMetadata) -> None:
        """Hand this step's saves to the runner (from wait_for_save: once per step, after
        every forward; finished requests' saves from start_load_kv). Capture jobs are
        gathered here, before vLLM can free their blocks."""
        if self.layout is None:
            return
        slots = [s for s in self.layout.members if s.writes]
        slots.sort(key=lambda s: not s.draft)  # sidecar draft members first: a chunk's kv never lands without them
        for job in meta.saves:
            blocks = len(job.blocks)
            gather = partial(gather_members, slots=slots, job=job)
            save = SaveJob(job.req_id, job.tenant, blocks, save_bytes(slots, job), gather, capture=job.capture)
            if blocks and job.weights != self.weights_now.identity:
                # computed (at least in part) by weights replaced since: never stored under either
                self.runner.drop_save(save)
            else:
                self.runner.submit_save(save)

    def poll_weights(self) -> None:
        """Notice an in-place weight change before this step's loads and saves (`kvpack.WeightsWatch`);
        the scheduler learns it from the next report."""
        if self.weights is None:
            return
        now = self.weights.poll()
        if now is self.weights_now:
            return
        self.weights_now = now
        self._weights_news = True
        # saves gathered earlier carry the old member fingerprints in their objects; the keys
        # and headers of everything gathered from here on name the new weights
        self.scope = self.scope.with_weights(now.identity)
        self.session.bind_group(self.scope.fingerprint, self.scope.spec.describe())
        self._register(self.scope)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(saves done, loads done, loads failed): a failed load is also a done load."""
        done = self.runner.finished()
        return done.saves, done.loads, done.failed

    def take_load_errors(self) -> set[int]:
        """Blocks whose load failed (vLLM recomputes from the first). Empty for hybrid models:
        block ids are not unique across KV cache groups there, so vLLM takes failures per
        request (`get_finished`'s third set) and recomputes the whole request."""
        errors = self.runner.take_failed_blocks()
        return set() if self.scope.hybrid else errors

    def take_report(self) -> KVPackWorkerMetadata | None:
        stored, evicted, failed = self.runner.take_report()
        weights = self.weights_now if self._weights_news else None
        self._weights_news = False
        if not stored and not evicted and not failed and weights is None:
            return None
        return KVPackWorkerMetadata(stored, evicted, failed, weights)

    def take_stats(self) -> dict[str, float]:
        """What this worker's store counted since the last call (`kvpack_*` metrics' increases)."""
        return self.runner.take_stats()

    # -- vLLM sleep mode (0.33+: unregister_kv_caches / restore_kv_caches) ----------

    def release_caches(self) -> None:
        """vLLM is about to release the KV cache's memory (sleep, discard): from here on
        nothing reads or writes it (`TransferRunner.suspend`; copies already launched are
        waited for, at most ``io_timeout_ms``). Saves already gathered are still stored;
        loads not yet copied are reported failed, so vLLM recomputes them. Idempotent."""
        if self.layout is not None:
            self.runner.suspend(self.config.io_timeout_ms / 1000.0)

    def restore_caches(self) -> None:
        """The KV cache is mapped again. vLLM's sleep allocator remaps it at the same virtual
        addresses, so the registered layout (its block addresses and the device's copy of
        them) is still right and copies simply resume. Idempotent."""
        self.runner.resume()

    def flush_before_exit(self, timeout_s: float, reason: str) -> bool:
        """Wait (bounded) until queued saves reached the store and every tier (`TransferRunner`)."""
        return self.runner.flush_before_exit(timeout_s, reason)

    def close(self) -> None:
        """Finish the queued saves and flush the store, within ``shutdown_flush_s`` in all."""
        self.runner.close()

    # -- translation ------------------------------------------------------------

    def _load_job(self, job: TransferJob) -> LoadJob:
        """`job` as the runner's load: per chunk its blocks, tokens and draft state; where
        the scheduler's lookup found each object (`BlockRef.tiers`: what is still in this
        worker's memory stays pinned while the load waits for earlier saves; an object gone
        from its tier since is counted as ``evicted_before_load``)."""
        layout = self.layout
        has_draft = layout is not None and layout.draft is not None
        chunks = tuple(
            LoadChunk(frozenset(ref.blocks), tokens_used(ref), ref.with_draft if has_draft else None)
            for ref in job.blocks
        )
        if layout is None:  # registration refused the cache: the disabled runner fails it
            return LoadJob(job.req_id, job.tenant, chunks, 0, refused_plan)
        # bytes of this rank's own objects (NO_BLOCK < 0; a head range of another TP size reads about as much)
        nbytes = sum(m.layout.slot_bytes for m in layout.members for r in job.blocks if r.block_ids[m.group] >= 0)
        hints = tuple((ref.chunk, member, tier) for ref in job.blocks for member, tier in ref.tiers)
        plan = partial(BlockLoads(layout, self.scope).plan, job)
        return LoadJob(job.req_id, job.tenant, chunks, nbytes, plan, hints, job.handoff_wait_s)
