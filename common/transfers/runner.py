"""The transfer runner: every load into and save out of an engine's cache runs here, off
the forward path (after vLLM's ``OffloadingWorker``: jobs are submitted, `finished` is
polled). An adapter translates its engine's per-step facts into `LoadJob`s and `SaveJob`s
and the results back; the runner owns the threads, the ordering, the bounds and the counts.

Guarantees:

- Saves before loads: a load waits (bounded) for the saves queued before it, because a
  scheduler counts a chunk as stored once it asked for its save, so a request can hit a
  prefix another request computed a step earlier.
- Device order (`kvpack.transfers.staging`): a save's gather is launched on the save side stream
  after the compute stream, and the compute stream waits on the gather's event, so no
  later forward rewrites a block the save still reads; a load is reported, done or
  failed, only after its scatter's event completed.
- A load inside the step (`load_now`) that failed leaves blocks the step's forward reads
  anyway (the engine recomputes them next step): that step's captures of the same job are
  not stored (``captures_dropped_failed_load``), or every later hit would load what the
  failed load left.
- Every wait is bounded by ``io_timeout_ms`` (plus a handoff's ``handoff_wait_ms``): a
  load still reading after it is cancelled and reported failed (the engine recomputes),
  and its blocks are never written by the late thread. A load whose scatter is already
  launched is not cancelled: it is reported once its event completed.
- A handoff waits for its objects on a thread of its own (`kvpack.transfers.handoffs`),
  with every other handoff: one whose objects never land holds up no other load.
- Host memory is bounded (`kvpack.config.schema.TransferConfig`): saves queued and loads in
  flight are admitted up to their byte bounds, pinned staging comes from the process's
  pool (`kvpack.transfers.staging_pool`); what a bound turns away is counted
  (``transfers_turned_away``) and never makes the caller wait.
- Before the process exits, queued saves reach the store and the store its tiers
  (`flush_before_exit`, bounded by ``shutdown_flush_s``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from ..config.schema import KVPackConfig
from ..exit_flush import flush_on_exit, forget
from ..identity.keys import GroupKey
from ..observe.metrics import MetricsInterval
from ..session import ObjectIO, Session
from ..store import LentLoad
from ..tiers.base import TierStatus
from ..tiers.reported import ReportedObject
from .cache_gate import CacheGate
from .handoffs import HandoffWaits
from .jobs import ByteBound, Finished, Gathered, LoadJob, LoadTask, PlannedLoad, SaveJob
from .staging import CpuDevice, Lane, Staged, Staging
from .staging_pool import PinnedPool, StagingFull

log = logging.getLogger("kvpack.transfers")

IDLE_STEP_PAUSE_S = 0.02
"""Longest a step with no forward waits for a load started in an earlier step (it returns
as soon as that load is done); bounds the engine's spin while loads are in flight."""

SYNC_SAVE_WAIT_S = 0.05
"""How long a load inside the step (`load_now`) waits for the saves queued before it:
the memory copies of the steps just before, which take milliseconds."""


class TransferRunner:
    """See the module docstring. `clock` (monotonic seconds) decides when a load timed out."""

    def __init__(self, session: Session, config: KVPackConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.session = session
        self.config = config
        self.clock = clock
        self._metrics = session.store.metrics
        self.staging = Staging(CpuDevice())
        """Staging rows and copy streams of the cache's device (`use_device_of`)."""
        self.pool = PinnedPool.shared(config.transfer.staging_bytes)
        self._metrics.gauge("pinned_bytes", self.pool.pinned_bytes)
        self._save_bytes = ByteBound(config.transfer.max_queued_save_bytes)
        self._load_bytes = ByteBound(config.transfer.max_inflight_load_bytes)
        self.gate = CacheGate()
        """Whether the engine's cache may be copied now (`suspend` / `resume`)."""
        self._lock = threading.Lock()
        self._loads: dict[str, LoadTask] = {}
        self._done_loads: set[str] = set()
        self._done_saves: set[str] = set()
        self._failed_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._reported_failed: list[str] = []
        self._stored: list[ReportedObject] = []
        self._evicted: list[str] = []
        self._interval = MetricsInterval(self._metrics, series=True)
        self._idle_step = False
        self._disabled = False
        self._step_loads: list[LoadTask] = []
        self._step_failed_sync: set[str] = set()
        """Jobs whose load inside this step failed, in part or whole (`load_now`, `refuse_load`)."""
        self._saves_cv = threading.Condition()
        self._saves_queued = 0
        self._saves_done = 0
        self._load_q: queue.Queue[LoadTask | None] = queue.Queue()
        self._save_q: queue.Queue[tuple[SaveJob, list[Gathered] | None] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._load_loop, name="kvpack-load", daemon=True),
            threading.Thread(target=self._save_loop, name="kvpack-save", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._handoffs = HandoffWaits(
            session, self._metrics, plan=self._plan, ready=self._load_q.put, ended=self._handoff_ended
        ).start()

        def on_evict(tier: str, group: GroupKey, nbytes: int) -> None:
            if tier == "memory":
                self._evicted.append(group.as_str())  # list.append is atomic

        session.store.add_evict_listener(on_evict)
        # saves queued here (not yet handed to the store) must reach it before exit too
        flush_on_exit(self, config.shutdown_flush_s)

    def use_device_of(self, tensor: torch.Tensor) -> None:
        """Stage through `tensor`'s device. Call on the thread whose current stream is the
        engine's compute stream (the model runner's, at registration)."""
        self.use_staging(Staging.for_tensor(tensor))

    def use_staging(self, staging: Staging) -> None:
        """Copy through `staging` from now on, and let its device read the host store's mapping
        in place (`StagingDevice.register_host`: on a GPU, registered with CUDA once per
        process; its bytes are gauged as ``host_registered_bytes``)."""
        self.staging = staging
        mapping = self.session.store.reads.lent_host_mapping()
        if mapping is None:
            return
        started = time.monotonic()
        if staging.device.register_host(*mapping):
            self._metrics.gauge("host_registered_bytes", lambda: mapping[1])
            log.info(
                "kvpack: %d MiB of the host store registered with the %s device in %.2f s: its loads copy once",
                mapping[1] >> 20,
                staging.device.kind,
                time.monotonic() - started,
            )

    def disable(self, reason: str) -> None:
        """The engine's cache cannot be copied (refused at registration): from now on every load
        fails, so the engine recomputes it, and no save is taken. Counted as
        ``workers_disabled`` and logged with `reason`, once per call."""
        self._disabled = True
        self._metrics.inc("workers_disabled")
        log.error("kvpack: disabled on this worker (every load recomputes, nothing is saved): %s", reason)

    # -- loads --------------------------------------------------------------------

    def begin_step(self, has_forward: bool) -> None:
        """A new engine step: `finished` waits (bounded) for this step's loads when it has no forward."""
        self._idle_step = not has_forward
        self._step_loads = []
        self._step_failed_sync = set()

    def submit_load(self, job: LoadJob) -> None:
        """Run `job` on the load thread; `finished` reports it (failed if turned away)."""
        task = LoadTask(job, time.monotonic(), after_saves=self._saves_queued)
        with self._lock:
            self._loads[job.job_id] = task
        if self._disabled or not self._admit(self._load_bytes, "load", "max_inflight_load_bytes", job.nbytes):
            task.failed_blocks = job.blocks
            task.done.set()
            return
        self._step_loads.append(task)
        if job.handoff_wait_s > 0:  # its objects may still be landing: it waits with the other handoffs
            self._handoffs.add(task)
        else:
            self._load_q.put(task)

    def refuse_load(self, job: LoadJob, sync: bool) -> None:
        """Fail `job` without reading anything: the engine recomputes its blocks. For a load the
        adapter knows to be wrong (planned under weights since replaced); `sync` as for
        `load_now` (the blocks go to `take_failed_blocks`), else reported by `finished`."""
        self._metrics.inc("stale_weights_transfers", kind="load")
        if sync:
            with self._lock:
                self._failed_blocks |= job.blocks
            self._step_failed_sync.add(job.job_id)
            return
        task = LoadTask(job, time.monotonic(), after_saves=self._saves_queued)
        task.failed_blocks = job.blocks
        task.done.set()
        with self._lock:
            self._loads[job.job_id] = task

    def load_now(self, job: LoadJob) -> None:
        """Run `job` here, before the caller's forward (its wait for earlier saves is bounded by
        `SYNC_SAVE_WAIT_S`; it reads host memory and disk only, never a remote tier); blocks
        that did not load go to `take_failed_blocks` and nothing is reported in `finished`."""
        task = LoadTask(job, time.monotonic(), after_saves=self._saves_queued)
        if not self._disabled and self._admit(self._load_bytes, "load", "max_inflight_load_bytes", job.nbytes):
            try:
                self._run_load(task, save_wait_s=SYNC_SAVE_WAIT_S, local_only=True)
            except Exception as exc:  # a failed load is a recompute, never an engine error
                log.warning("kvpack: load for %s failed: %s", job.job_id, exc)
                task.failed_blocks = job.blocks
            finally:
                self._load_bytes.release(job.nbytes)
        else:
            task.failed_blocks = job.blocks
        self._metrics.inc("sync_loads", tenant=job.tenant)
        if task.failed_blocks:
            self._metrics.inc("sync_load_failures")
            self._step_failed_sync.add(job.job_id)
            with self._lock:
                self._failed_blocks |= task.failed_blocks

    def finished(self) -> Finished:
        """Saves done, loads done and loads failed since the last call. A load past
        ``io_timeout_ms`` (plus its handoff wait) is cancelled and reported failed, unless
        its scatter is launched: that one is reported once its event completed."""
        timeout = self.config.io_timeout_ms / 1000.0
        if self._idle_step and self._step_loads:
            deadline = time.monotonic() + timeout
            for task in self._step_loads:
                task.done.wait(max(0.0, deadline - time.monotonic()))
        elif self._idle_step:
            # nothing to compute, only earlier loads in flight (a handoff waiting for its
            # objects): pause briefly instead of letting the engine spin through empty steps,
            # which on a small machine starves the very prefill instance it waits for
            with self._lock:
                inflight = next((t for t in self._loads.values() if not t.done.is_set()), None)
            if inflight is not None:
                inflight.done.wait(IDLE_STEP_PAUSE_S)
        self._step_loads = []
        now = self.clock()
        with self._lock:
            for job_id, task in list(self._loads.items()):
                if task.done.is_set():
                    del self._loads[job_id]
                    if not task.cancelled:
                        self._report_load(task, task.failed_blocks)
                elif task.staged is None and now - task.started > timeout + task.job.handoff_wait_s:
                    task.cancelled = True  # the load thread will not write these blocks any more
                    del self._loads[job_id]
                    self._report_load(task, task.job.blocks)
                    self._metrics.inc("load_timeouts")
                    log.warning(
                        "kvpack: load for %s exceeded io_timeout_ms=%d; recomputing", job_id, self.config.io_timeout_ms
                    )
            out = Finished(self._done_saves, self._done_loads, self._failed_loads)
            self._done_saves, self._done_loads, self._failed_loads = set(), set(), set()
        return out

    def _report_load(self, task: LoadTask, failed_blocks: set[int]) -> None:
        """(under the lock) `task` is done; `failed_blocks` go to the engine's recompute."""
        self._done_loads.add(task.job.job_id)
        if failed_blocks:
            self._failed_blocks |= failed_blocks
            self._failed_loads.add(task.job.job_id)
            self._reported_failed.append(task.job.job_id)

    def take_failed_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call (the engine recomputes them)."""
        with self._lock:
            errors, self._failed_blocks = self._failed_blocks, set()
        self._metrics.inc("load_error_blocks", len(errors))
        return errors

    def _load_loop(self) -> None:
        while True:
            task = self._load_q.get()
            if task is None:
                return
            try:
                self._run_load(task)
            except Exception as exc:  # never let a load kill the thread: report the blocks
                self._load_failed(task, exc)
            finally:
                self._load_ended(task)

    def _load_failed(self, task: LoadTask, exc: Exception) -> None:
        log.warning("kvpack: load for %s failed: %s", task.job.job_id, exc)
        task.failed_blocks = task.job.blocks

    def _load_ended(self, task: LoadTask) -> None:
        self._load_bytes.release(task.job.nbytes)
        task.done.set()

    def _handoff_ended(self, task: LoadTask, error: Exception | None) -> None:
        """A handoff's load that ends before the load thread: failed with `error`, or, with
        None, cancelled (already reported)."""
        if task.plan is not None:
            self.staging.give_back(task.plan.rows)
        if error is not None:
            self._load_failed(task, error)
        self._load_ended(task)

    def _plan(self, task: LoadTask) -> PlannedLoad:
        """The load's staging rows and scatter (`LoadJob.plan`); a plan made while it waited is kept."""
        if task.plan is not None:
            return task.plan
        try:
            return task.job.plan(self.staging)
        except StagingFull as exc:
            self._turned_away("load", "staging_bytes", exc.nbytes)
            raise

    def _run_load(self, task: LoadTask, save_wait_s: float | None = None, local_only: bool = False) -> None:
        """Read the job's objects (`Session.prepare_load` with the lookup's tiers, then the
        waits, then `complete_load`; `local_only`: no remote tier, for a load inside the step)
        and scatter the chunks whose every object loaded. Its staging rows go back after the
        scatter's event, or at once when nothing is scattered."""
        job = task.job
        plan = self._plan(task)
        staged: Staged | None = None
        launched = False  # from the scatter on, its rows go back through its Staged only
        try:
            wait_s = self.config.io_timeout_ms / 1000.0 if save_wait_s is None else save_wait_s
            good, load = self._read(task, plan, wait_s, local_only)
            lent = load.views
            in_place: list[int] = []
            ok = [i for i, g in enumerate(good) if g]
            failed = {b for c, g in zip(job.chunks, good) if not g for b in c.blocks}
            with self.gate.access() as allowed:
                with self._lock:
                    if task.cancelled:
                        return
                    if not allowed:  # the engine released its cache (sleep): recompute after wake-up
                        self._metrics.inc("transfers_skipped_cache_released", tenant=job.tenant)
                        ok, failed = [], set(job.blocks)
                    if ok:
                        launched = True
                        staged = task.staged = self.staging.scatter(
                            plan.rows[0], _scatter_all(plan, good, lent, in_place)
                        )
                    task.failed_blocks = failed
                if staged is not None:
                    staged.release()  # the scatter completed: only now may the load be reported done
                    ok, failed = self._still_held(task, plan, load, ok, failed)
        finally:
            if not launched:
                self.staging.give_back(plan.rows)
        if in_place and in_place[0]:
            self._metrics.inc("loaded_in_place_bytes", in_place[0], tenant=job.tenant)
        self._count_load(job, ok, failed)

    def _still_held(
        self, task: LoadTask, plan: PlannedLoad, load: LentLoad, ok: list[int], failed: set[int]
    ) -> tuple[list[int], set[int]]:
        """After the scatter: the chunks read from a lent view that changed during it
        (`LentLoad.lost`: a host-store object whose pages another process took) join the failed
        ones, so the engine recomputes their blocks (the scatter wrote them with bytes that are
        not the object). Returns the chunks restored and the blocks failed."""
        lost = load.lost()
        if not lost:
            return ok, failed
        changed = {plan.chunk_of[i] for i in lost}
        chunks = task.job.chunks
        failed = failed | {b for c in changed for b in chunks[c].blocks}
        with self._lock:
            task.failed_blocks = failed
        self._metrics.inc("missing_at_load", len(lost))  # objects, as `_read` counts them
        return [i for i in ok if i not in changed], failed

    def _read(
        self, task: LoadTask, plan: PlannedLoad, save_wait_s: float, local_only: bool
    ) -> tuple[list[bool], LentLoad]:
        """Per chunk of the job: did every one of its objects load (into its staging row, or
        lent where it lies: `PlannedLoad.lends`)? And the load: per read, its lent payload or
        None, and the re-check to run once the lent payloads were copied (`LentLoad.lost`)."""
        job = task.job
        items = self.session.reads(job.tenant, plan.reads)
        hints = {self.session.key(job.tenant, chunk, member): tier for chunk, member, tier in job.hints}
        batch = self.session.prepare_load(items, hints)
        try:
            self._wait_for_earlier_saves(task, save_wait_s)
        except BaseException:
            self.session.release(batch)
            raise
        load = self.session.complete_load(batch, local_only, lend=plan.lends)
        good = [True] * len(job.chunks)
        for r, chunk in zip(load.results, plan.chunk_of):  # a chunk is a hit only when all its objects loaded
            good[chunk] = good[chunk] and r.ok
        gone = sum(1 for r in load.results if r.status is TierStatus.MISS)
        if gone:  # the scheduler's lookup found these: evicted (or never landed) before the load
            self._metrics.inc("missing_at_load", gone)
        return good, load

    def _count_load(self, job: LoadJob, ok: list[int], failed: set[int]) -> None:
        self._metrics.inc("loaded_tokens", sum(job.chunks[i].tokens for i in ok), tenant=job.tenant)
        self._metrics.inc("loaded_blocks", len(ok))
        if any(c.draft is not None for c in job.chunks):
            drafted = sum(1 for i in ok if job.chunks[i].draft)
            self._metrics.inc("loaded_draft_blocks", drafted)
            self._metrics.inc("loaded_without_draft_blocks", len(ok) - drafted)
        if failed:
            self._metrics.inc("failed_blocks", len(failed))
            log.warning(
                "kvpack: %d of %d chunks of %s could not be loaded; the engine recomputes them",
                len(job.chunks) - len(ok),
                len(job.chunks),
                job.job_id,
            )

    def _wait_for_earlier_saves(self, task: LoadTask, bound_s: float) -> None:
        """Wait (at most `bound_s` from the load's start) until the saves queued before it reached the store."""
        deadline = task.started + bound_s
        with self._saves_cv:
            while self._saves_done < task.after_saves:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._metrics.inc("load_waits_for_saves_timed_out")
                    return
                self._saves_cv.wait(left)

    # -- saves --------------------------------------------------------------------

    def submit_save(self, job: SaveJob) -> bool:
        """Queue `job` (a capture is gathered here first); False when it was turned away or
        its gather failed (counted: a future miss), or the runner is disabled. Never waits
        for storage."""
        if self._disabled:
            return False
        if job.capture and job.job_id in self._step_failed_sync:
            # this step's forward ran over blocks whose load failed: what it computed is not the
            # prompt's KV (the engine recomputes it next step); stored, it would be every later hit's
            self._metrics.inc("captures_dropped_failed_load", tenant=job.tenant)
            self._save_ended(job)
            return False
        if not self._admit(self._save_bytes, "save", "max_queued_save_bytes", job.nbytes):
            self._save_ended(job)
            return False
        gathered: list[Gathered] | None = None
        if job.capture:
            try:
                gathered = self._gather(job)
            except StagingFull as exc:
                self._turned_away("save", "staging_bytes", exc.nbytes)
                self._save_bytes.release(job.nbytes)
                return False
            except Exception as exc:  # a failed capture is a future miss, never an engine error
                log.warning("kvpack: capture for %s failed: %s", job.job_id, exc)
                self._metrics.inc("save_errors")
                self._save_bytes.release(job.nbytes)
                return False  # nothing queued: no load or exit flush waits for it
            if gathered is None:  # the engine released its cache (counted by `_gather`)
                self._save_bytes.release(job.nbytes)
                return False
        with self._saves_cv:
            self._saves_queued += 1
        self._save_q.put((job, gathered))
        return True

    def drop_save(self, job: SaveJob) -> None:
        """Store nothing of `job` (a future miss) but report it done, so the engine frees blocks
        it kept for it: for a save the adapter knows to be wrong (planned under weights since
        replaced)."""
        self._metrics.inc("stale_weights_transfers", kind="save")
        self._save_ended(job)

    def _gather(self, job: SaveJob) -> list[Gathered] | None:
        """Launch `job`'s gather through the cache gate; None (counted) while the cache is released."""
        with self.gate.access() as allowed:
            if not allowed:
                self._metrics.inc("transfers_skipped_cache_released", tenant=job.tenant)
                return None
            gathered = job.gather(self.staging)
            self.gate.launched(g.staged for g in gathered)
            return gathered

    # -- the engine's cache released and restored (vLLM's sleep mode) ---------------

    def suspend(self, timeout_s: float) -> bool:
        """The engine is about to release its cache's memory: from now on no copy reads or
        writes it (loads not yet copying fail, saves not yet gathered are dropped, both
        counted); copies already launched are waited for, at most `timeout_s`. False when
        one still ran at the bound. What was gathered before is still stored."""
        drained = self.gate.close(timeout_s)
        if not drained:
            log.warning("kvpack: a copy of the KV cache still ran %.1f s after the engine released it", timeout_s)
        return drained

    def resume(self) -> None:
        """The engine's cache is mapped again: copies run as before."""
        self.gate.open()

    def _save_ended(self, job: SaveJob) -> None:
        if not job.capture:  # the engine keeps its blocks until this save is reported
            with self._lock:
                self._done_saves.add(job.job_id)

    def _save_loop(self) -> None:
        # normal priority: later loads wait for these saves (a memory-tier copy each; the
        # disk and Mooncake writes run on the store's write-back threads, at lower priority)
        while True:
            entry = self._save_q.get()
            if entry is None:
                return
            job, gathered = entry
            try:
                gathered = gathered if gathered is not None else self._gather(job)
                if gathered is None:  # the engine released its cache before this save's gather
                    continue
                try:
                    self._put(job, [o for g in gathered for o in g.objects()])
                finally:
                    for g in gathered:
                        g.staged.release()
                    self.gate.settled(g.staged for g in gathered)
            except StagingFull as exc:
                self._turned_away("save", "staging_bytes", exc.nbytes)
            except Exception as exc:  # a failed save is a future miss, never an engine error
                log.warning("kvpack: save for %s failed: %s", job.job_id, exc)
                self._metrics.inc("save_errors")
            finally:
                self._save_bytes.release(job.nbytes)
                self._save_ended(job)
                with self._saves_cv:
                    self._saves_done += 1
                    self._saves_cv.notify_all()

    def _put(self, job: SaveJob, objects: list[ObjectIO]) -> None:
        """Store the objects as given (the adapter decided what to save; a tail slot is
        rewritten in place, so no de-duplication); what this process's memory tier now
        holds goes to `take_report`."""
        saved = self.session.save(job.tenant, objects, dedupe=False)  # counts stored_bytes, store_seconds
        self._metrics.inc("saved_blocks", job.blocks)
        stored = [
            ReportedObject(it.key.as_str(), it.header.token_count, it.header.payload_len, it.header.token_ids)
            for it, held in zip(saved.items, saved.in_memory)
            if held
        ]
        if stored:
            with self._lock:
                self._stored.extend(stored)

    # -- reports, bounds, exit ----------------------------------------------------

    def take_report(self) -> tuple[list[ReportedObject], list[str], list[str]]:
        """(objects put into this process's memory tier, group keys evicted from it, loads
        that failed) since the last call: what a scheduler elsewhere must learn."""
        with self._lock:
            stored, self._stored = self._stored, []
            failed, self._reported_failed = self._reported_failed, []
        evicted, self._evicted = self._evicted, []
        return stored, evicted, failed

    def take_stats(self) -> dict[str, float]:
        """What this process's store counted since the last call (`kvpack_*` increases, and their
        label sets without the tenant: `Metrics.series_totals`)."""
        return self._interval.take()

    def _admit(self, bound: ByteBound, direction: str, name: str, nbytes: int) -> bool:
        if bound.admit(nbytes):
            return True
        self._turned_away(direction, name, nbytes)
        return False

    def _turned_away(self, direction: str, bound: str, nbytes: int) -> None:
        self._metrics.inc("transfers_turned_away", direction=direction, bound=bound)
        self._metrics.inc("transfer_bytes_turned_away", nbytes, direction=direction, bound=bound)

    def settle_saves(self, timeout_s: float) -> bool:
        """Wait, at most `timeout_s`, until every save submitted so far reached the store; False at the bound."""
        deadline = time.monotonic() + timeout_s
        with self._saves_cv:
            while self._saves_done < self._saves_queued:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._saves_cv.wait(left)
        return True

    def report_removed(self, groups: Sequence[str]) -> None:
        """Groups (``GroupKey.as_str()``) this process's memory tier dropped outside eviction (a
        reset): `take_report` hands them out with the evicted ones."""
        self._evicted.extend(groups)

    def flush_before_exit(self, timeout_s: float, reason: str) -> bool:
        """Wait (bounded) until queued saves reached the store and every tier; what the
        bound cuts off is counted and logged (`kvpack.exit_flush` calls this at exit)."""
        deadline = time.monotonic() + timeout_s
        with self._saves_cv:
            while self._saves_done < self._saves_queued:
                left = deadline - time.monotonic()
                if left <= 0:
                    lost = self._saves_queued - self._saves_done
                    self._metrics.inc("save_dropped_at_exit", lost)
                    log.warning(
                        "kvpack: %d saves still queued after %.1f s (%s); they are lost", lost, timeout_s, reason
                    )
                    return False
                self._saves_cv.wait(left)
        return self.session.store.flush_before_exit(max(0.0, deadline - time.monotonic()), reason)

    def close(self) -> None:
        """Finish the queued saves and flush the store, within ``shutdown_flush_s`` in all."""
        deadline = time.monotonic() + self.config.shutdown_flush_s
        self._handoffs.close(self.config.io_timeout_ms / 1000.0)
        self._load_q.put(None)
        self._save_q.put(None)  # after every queued save: the save thread stores them first
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        forget(self)
        self.staging.device.unregister_host()  # before the store unmaps what it registered
        self.session.store.close(flush_timeout_s=max(0.0, deadline - time.monotonic()))


def _scatter_all(
    plan: PlannedLoad, good: list[bool], lent: list[memoryview | None], in_place: list[int]
) -> Callable[[torch.Tensor, Lane], None]:
    """The lane function of a load: keep every staging tensor until the event, then scatter
    (the lent payloads are held by the caller until the event); appends to `in_place` the
    lent bytes the scatter read where they lie."""

    def run(_rows: torch.Tensor, lane: Lane) -> None:
        for rows in plan.rows[1:]:
            lane.keep(rows)
        in_place.append(plan.scatter(good, lent, lane))

    return run
