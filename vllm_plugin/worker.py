"""Worker side: restores and saves whole blocks of every layer, off the forward path.

Per step vLLM binds a `KVPackConnectorMetadata`. `start_load_kv` hands its
load jobs to a background thread (read from the store into staging rows, then
scatter into the blocks). `wait_for_save` runs right after the step's forward:
it copies out the blocks that step computed (`TransferJob.capture`, the one
save path: see `captures`) and hands them to a save thread, which puts them
into the store (memory copy; disk and Mooncake through the write-back queue).
Nothing waits on storage in the forward; `get_finished` reports completed
jobs, failed blocks go out through `get_block_ids_with_load_errors` so vLLM
recomputes them. What this worker copies is fixed at registration
(`registration.WorkerLayout`).

Draft KV (speculative decoding): PACKED objects hold the draft layers after
the target's; SIDECAR stores them as the ``draft`` member of the same group.
A load marked ``with_draft=False`` (target_only policy, the draft member was
missing) restores the target member and zeroes those blocks' draft layers:
the drafter never recomputes KV for tokens it was not scheduled, so the
request runs with empty draft state there (a counted partial hit). Saves run
once per step (in `wait_for_save`, which vLLM defers until the drafter ran),
however often the drafter's layers call `save_kv_layer`.

Ordering: a load waits (bounded) for the saves queued before it, because
the scheduler counts a chunk as stored as soon as it asked for its save, so
a request can hit a prefix that another request computed one step earlier.

Every wait is bounded by ``io_timeout_ms``: a load still running after it is
cancelled (its blocks are reported as load errors and will never be written
by the late thread), so a hung tier can never hold a request forever. In a
step without a forward (the engine is only waiting for loads) the worker
waits, bounded, for this step's loads so they finish within the same step.
Before the process exits, queued saves reach the store and the store its
tiers (`flush_before_exit`, bounded by ``shutdown_flush_s``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvpack import (
    ChunkFacts,
    DraftPlacement,
    GroupKey,
    HeadRange,
    KVPackConfig,
    KVStore,
    LoadItem,
    MemberObject,
    MetricsInterval,
    ObjectIO,
    Session,
    TierStatus,
    start_engine_process,
)
from kvpack.ops import CpuDevice, Lane, Staged, Staging

from .canonical_blocks import CanonicalBlocks
from .metadata import NO_BLOCK, BlockRef, KVPackConnectorMetadata, KVPackWorkerMetadata, StoredObject, TransferJob
from .registration import MemberLayout, RankPosition, WorkerLayout, register_layout
from .saves import Captured, gather_members, save_objects
from .settings import Scope

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvpack.vllm")

IDLE_STEP_PAUSE_S = 0.02
"""Longest a step with no forward waits for a load started in an earlier step (it returns
as soon as that load is done); bounds the engine's spin while loads are in flight."""


def keep_draft_on_save() -> bool:
    """Whether saves write the sidecar ``draft`` member. Always True.

    A test seam, not a setting (there is no config field or environment variable
    for it): the speculative-decoding tests patch it to return False in an
    in-process engine to reproduce the failure of the field (target KV stored,
    draft state lost) and check that kvpack reports a partial hit."""
    return True


def keep_draft_on_load() -> bool:
    """Whether loads restore the draft KV (PACKED: the draft layers' bytes of each
    object; SIDECAR: the ``draft`` member). Always True.

    A test seam like `keep_draft_on_save`: patched to return False, a hit
    restores the target only and leaves the draft layers as they were, which is
    exactly the silent failure kvpack exists to prevent (tests show that the
    accept rate falls, so the suite can see it)."""
    return True


SYNC_SAVE_WAIT_S = 0.05
"""How long a synchronous load (on the forward path) waits for the saves queued before it:
the memory copies of the steps just before, which take milliseconds."""


@dataclass
class _LoadTask:
    job: TransferJob
    started: float
    after_saves: int = 0
    """Saves queued before this load (a load may read what they store: it waits for them)."""
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    failed_blocks: set[int] = field(default_factory=set)


class WorkerSide:
    def __init__(
        self, vllm_config: VllmConfig, config: KVPackConfig, scope: Scope, store: KVStore | None = None
    ) -> None:
        self.config = config
        self.scope = scope
        self.vllm_config = vllm_config
        self.position = RankPosition.of_this_process(vllm_config)
        # the session builds every key, header and expectation; its store copies into the
        # memory tier with kvpack's native region copy once the kernels are loaded
        self.session = (
            Session(store, scope.fingerprint) if store is not None else Session.start(config, scope.fingerprint)
        )
        self.store = self.session.store
        self.layout: WorkerLayout | None = None
        """What this worker copies; fixed by `register_kv_caches` (None before)."""
        self.staging = Staging(CpuDevice())
        """Staging rows and copy streams (`kvpack.staging`) for the cache's device, set at registration."""
        self._lock = threading.Lock()
        self._loads: dict[str, _LoadTask] = {}
        self._done_recving: set[str] = set()
        self._done_sending: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        self._reported_stored: list[StoredObject] = []
        self._reported_evicted: list[str] = []
        self._failed_loads: list[str] = []
        self._interval = MetricsInterval(self.store.metrics)
        """The connector's per-interval stats: what the store's metrics counted since the last take."""
        self._idle_step = False
        self._step_loads: list[_LoadTask] = []
        self._saves_cv = threading.Condition()
        self._saves_queued = 0
        self._saves_done = 0
        self._load_q: queue.Queue[_LoadTask | None] = queue.Queue()
        self._save_q: queue.Queue[tuple[TransferJob, list[Captured] | None] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._load_loop, name="kvpack-vllm-load", daemon=True),
            threading.Thread(target=self._save_loop, name="kvpack-vllm-save", daemon=True),
        ]
        for t in self._threads:
            t.start()

        def on_evict(tier: str, group: GroupKey, nbytes: int) -> None:
            if tier == "memory":
                self._reported_evicted.append(group.as_str())  # list.append is atomic

        self.store.add_evict_listener(on_evict)
        # saves queued here (not yet handed to the store) must reach it before exit too
        self.session.flush_at_exit(self, config.shutdown_flush_s)

    # -- registration -----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Fix this worker's `WorkerLayout` (raises LayoutError at start-up for a cache kvpack
        cannot copy)."""
        # before the first forward: AMX permission (a 1-token step over a restored prefix may
        # be this process's first AMX use) and the copy kernels, not in the first load's bound
        start_engine_process()
        first = next(iter(kv_caches.values()), None)
        if first is not None:  # on the model runner's thread: its current stream is the compute stream
            self.staging = Staging.for_tensor(first)
        self.layout = register_layout(self.vllm_config, self.scope, self.position, kv_caches, num_blocks)

    # -- per step ---------------------------------------------------------------

    def start_step(self, meta: KVPackConnectorMetadata, has_forward: bool) -> None:
        """Queue this step's loads (called from start_load_kv)."""
        self._idle_step = not has_forward
        self._step_loads = []
        if self.layout is None:
            return
        for job in meta.loads:
            task = _LoadTask(job, time.monotonic(), after_saves=self._saves_queued)
            if job.sync:
                self._load_in_step(task)
                continue
            with self._lock:
                self._loads[job.req_id] = task
            self._step_loads.append(task)
            self._load_q.put(task)

    def _load_in_step(self, task: _LoadTask) -> None:
        """A synchronous load (`TransferJob.sync`), here, before this step's forward: its
        wait for earlier saves is bounded by `SYNC_SAVE_WAIT_S`; blocks that did not load
        go to `take_load_errors` (vLLM recomputes them) and nothing is reported as received."""
        try:
            self._run_load(task, save_wait_s=SYNC_SAVE_WAIT_S)
        except Exception as exc:  # a failed load is a recompute, never an engine error
            log.warning("kvpack: load for %s failed: %s", task.job.req_id, exc)
            task.failed_blocks = {b for ref in task.job.blocks for b in ref.blocks}
        self.store.metrics.inc("sync_loads", tenant=task.job.tenant)
        if task.failed_blocks:
            self._count("sync_load_failures")
            with self._lock:
                self._load_errors |= task.failed_blocks

    def queue_saves(self, meta: KVPackConnectorMetadata) -> None:
        """Queue this step's saves (called from wait_for_save: once per step, after every forward).

        Capture jobs are copied out here, before vLLM can free their blocks."""
        if self.layout is None:
            return
        for job in meta.saves:
            items: list[Captured] | None = None
            if job.capture:
                try:
                    items = self._gather(job)
                except Exception as exc:  # a failed capture is a future miss, never an engine error
                    log.warning("kvpack: capture for %s failed: %s", job.req_id, exc)
                    self._count("save_errors")
                    continue  # nothing queued: no load or exit flush waits for it
            with self._saves_cv:
                self._saves_queued += 1
            self._save_q.put((job, items))

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(saves done, loads done, loads failed): a failed load is also a done load."""
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
        now = time.monotonic()
        with self._lock:
            for req_id, task in list(self._loads.items()):
                if task.done.is_set():
                    del self._loads[req_id]
                    if not task.cancelled:
                        self._done_recving.add(req_id)
                        self._load_errors |= task.failed_blocks
                        if task.failed_blocks:
                            self._failed_loads.append(req_id)
                            self._failed_recving.add(req_id)
                elif now - task.started > timeout + task.job.handoff_wait_s:
                    task.cancelled = True  # the load thread will not write these blocks any more
                    del self._loads[req_id]
                    self._done_recving.add(req_id)
                    self._load_errors |= {b for ref in task.job.blocks for b in ref.blocks}
                    self._failed_loads.append(req_id)
                    self._failed_recving.add(req_id)
                    self._count("load_timeouts")
                    log.warning(
                        "kvpack: load for %s exceeded io_timeout_ms=%d; recomputing", req_id, self.config.io_timeout_ms
                    )
            recving, self._done_recving = self._done_recving, set()
            sending, self._done_sending = self._done_sending, set()
            failed, self._failed_recving = self._failed_recving, set()
        return sending, recving, failed

    def take_load_errors(self) -> set[int]:
        """Blocks whose load failed (vLLM recomputes from the first). Empty for hybrid models:
        block ids are not unique across KV cache groups there, so vLLM takes failures per
        request (`get_finished`'s third set) and recomputes the whole request."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        if errors:
            self._count("load_error_blocks", len(errors))
        return set() if self.scope.hybrid else errors

    def take_report(self) -> KVPackWorkerMetadata | None:
        with self._lock:
            stored, self._reported_stored = self._reported_stored, []
            failed, self._failed_loads = self._failed_loads, []
        evicted, self._reported_evicted = self._reported_evicted, []
        if not stored and not evicted and not failed:
            return None
        return KVPackWorkerMetadata(stored, evicted, failed)

    def take_stats(self) -> dict[str, float]:
        """What this worker's store counted since the last call (`kvpack_*` metrics' increases)."""
        return self._interval.take()

    def _count(self, name: str, amount: float = 1) -> None:
        self.store.metrics.inc(name, amount)

    # -- background work --------------------------------------------------------

    def _load_loop(self) -> None:
        while True:
            task = self._load_q.get()
            if task is None:
                return
            try:
                self._run_load(task)
            except Exception as exc:  # never let a load kill the thread: report the blocks
                log.warning("kvpack: load for %s failed: %s", task.job.req_id, exc)
                task.failed_blocks = {b for ref in task.job.blocks for b in ref.blocks}
            finally:
                task.done.set()

    def _wait_for_earlier_saves(self, task: _LoadTask, bound_s: float) -> None:
        """Wait (at most `bound_s` from the load's start) until the saves queued before this
        load reached the store: the scheduler counts a chunk as stored once it asked a worker
        to save it, so a request can hit a prefix another request computed a step ago."""
        deadline = task.started + bound_s
        with self._saves_cv:
            while self._saves_done < task.after_saves:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._count("load_waits_for_saves_timed_out")
                    return
                self._saves_cv.wait(left)

    def _wait_for_handoff(self, task: _LoadTask, items: list[LoadItem]) -> None:
        """A prefill instance's objects may still be landing: wait (`Session.wait_until_stored`)
        until every one is there, the load was cancelled, or `handoff_wait_s` has passed."""
        keys = [it.key for it in items]
        missing = self.session.wait_until_stored(keys, task.started + task.job.handoff_wait_s, lambda: task.cancelled)
        waited = time.monotonic() - task.started
        self.store.metrics.observe("handoff_wait_seconds", waited, tenant=task.job.tenant)
        self.store.metrics.inc("handoff_loads", tenant=task.job.tenant)
        if missing:
            self.store.metrics.inc("handoff_missing", len(missing), tenant=task.job.tenant)
            log.warning(
                "kvpack: %d of %d objects of %s had not landed after handoff_wait_ms; vLLM recomputes from the first",
                len(missing),
                len(keys),
                task.job.req_id,
            )

    def _run_load(self, task: _LoadTask, save_wait_s: float | None = None) -> None:
        """`KVStore.prepare_load` with the tiers the scheduler's lookup found each object in
        (`BlockRef.tiers`; what is still in this worker's memory stays pinned while the load
        waits for earlier saves), then `complete_load`: an object gone from its tier since
        the lookup is counted as ``evicted_before_load`` and read from another tier if one has it."""
        job = task.job
        n = len(job.blocks)
        restore_draft = keep_draft_on_load()
        layout = self.layout
        assert layout is not None  # loads are queued only after registration
        plans: list[_MemberLoad] = []
        objects: list[ObjectIO] = []
        facts = [ChunkFacts(b.chunk, b.token_count, b.token_ids) for b in job.blocks]
        for slot in layout.members:
            wanted = [
                i
                for i, ref in enumerate(job.blocks)
                if ref.block_ids[slot.group] != NO_BLOCK and (not slot.draft or (restore_draft and ref.with_draft))
            ]
            for source in sorted({job.blocks[i].source for i in wanted}):  # a request may mix head splits
                of_split = [i for i in wanted if job.blocks[i].source == source]
                for part in self._member_loads(slot, of_split, source):
                    rows, obj = part.staging.numpy(), MemberObject(part.member, part.fingerprint)
                    objects += [ObjectIO(facts[i], obj, memoryview(rows[j])) for j, i in enumerate(of_split)]
                    plans.append(part)
        items = self.session.reads(job.tenant, objects)
        hints = {self.session.key(job.tenant, ref.chunk, m): t for ref in job.blocks for m, t in ref.tiers}
        batch = self.session.prepare_load(items, hints)
        try:
            self._wait_for_earlier_saves(
                task, self.config.io_timeout_ms / 1000.0 if save_wait_s is None else save_wait_s
            )
            if job.handoff_wait_s > 0:
                self._wait_for_handoff(task, items)
        except BaseException:
            self.session.release(batch)
            raise
        results = self.session.complete_load(batch)  # counts loaded_bytes and load_seconds per tier
        good = [True] * n
        pos = 0
        for part in plans:
            for i in part.wanted:  # a chunk is a hit only when every member it copies loaded
                good[i] = good[i] and results[pos].ok
                pos += 1
        ok = [i for i in range(n) if good[i]]
        failed = {b for i in range(n) if not good[i] for b in job.blocks[i].blocks}
        gone = sum(1 for r in results if r.status is TierStatus.MISS)
        if gone:  # the scheduler's lookup found these: evicted (or never landed) before the load
            self._count("missing_at_load", gone)
        staged: Staged | None = None
        with self._lock:
            if task.cancelled:
                return
            if ok:
                staged = self.staging.scatter(
                    plans[0].staging, lambda _rows, lane: self._scatter(lane, job, good, plans, restore_draft)
                )
            task.failed_blocks = failed
        if staged is not None:
            staged.release()  # the scatter completed: only now may the load be reported done
        tokens = sum(_tokens_used(job.blocks[i]) for i in ok)
        self.store.metrics.inc("loaded_tokens", tokens, tenant=job.tenant)
        self._count("loaded_blocks", len(ok))
        if layout.draft is not None:
            drafted = sum(1 for i in ok if job.blocks[i].with_draft) if restore_draft else 0
            self._count("loaded_draft_blocks", drafted)
            if len(ok) > drafted:
                self._count("loaded_without_draft_blocks", len(ok) - drafted)
        if failed:
            self._count("failed_blocks", len(failed))
            log.warning(
                "kvpack: %d of %d blocks of %s could not be loaded; vLLM recomputes them", len(failed), n, job.req_id
            )

    def _save_loop(self) -> None:
        # normal priority: later loads wait for these saves (a memory-tier copy each; the
        # disk and Mooncake writes run on the store's write-back threads, at lower priority)
        while True:
            entry = self._save_q.get()
            if entry is None:
                return
            job, captured = entry
            try:
                captured = captured if captured is not None else self._gather(job)
                self._put(job, save_objects(captured, job))
                for c in captured:
                    c.staged.release()
            except Exception as exc:  # a failed save is a future miss, never an engine error
                log.warning("kvpack: save for %s failed: %s", job.req_id, exc)
                self._count("save_errors")
            finally:
                if not job.capture:
                    with self._lock:
                        self._done_sending.add(job.req_id)
                with self._saves_cv:
                    self._saves_done += 1
                    self._saves_cv.notify_all()
                self._save_q.task_done()

    def _member_loads(self, slot: MemberLayout, wanted: list[int], source: int) -> list[_MemberLoad]:
        """The objects to read for `slot`'s chunks `wanted`: its own member, or (canonical
        objects stored at another TP size: `BlockRef.source`) every stored head range
        that overlaps this rank's heads, each with the part of it this rank keeps."""
        blocks = slot.layout
        if source == 0 or not slot.sources:
            staging = self.staging.rows(len(wanted), blocks.slot_bytes)
            return [_MemberLoad(slot, wanted, staging, slot.member, slot.fingerprint)]
        assert isinstance(blocks, CanonicalBlocks)
        out = []
        for obj in slot.sources[source]:
            staging = self.staging.rows(len(wanted), blocks.object_bytes(obj.heads))
            out.append(_MemberLoad(slot, wanted, staging, obj.member, obj.fingerprint, (obj.heads, obj.part)))
        return out

    def _scatter(
        self, lane: Lane, job: TransferJob, good: list[bool], plans: list[_MemberLoad], restore_draft: bool
    ) -> None:
        """Loaded rows -> blocks, member by member, launched on the load `lane` (called under
        the lock, never after a cancel; the caller waits for the lane's event before done)."""
        layout = self.layout
        assert layout is not None
        packed_target_only = (
            self.scope.draft_placement is DraftPlacement.PACKED and not restore_draft and not self.scope.hybrid
        )
        for plan in plans:
            slot, wanted, staging = plan.slot, plan.wanted, plan.staging
            sel = [j for j, i in enumerate(wanted) if good[i]]
            if not sel:
                continue
            ids = [job.blocks[wanted[j]].block_ids[slot.group] for j in sel]
            rows = self.staging.copy_rows(staging[sel]) if len(sel) < len(wanted) else staging
            if plan.heads is not None:
                assert isinstance(slot.layout, CanonicalBlocks)
                slot.layout.scatter_from(ids, rows, *plan.heads, lane=lane)
            elif packed_target_only and slot.group == 0 and not slot.draft:
                layout.target.scatter(ids, self.staging.copy_rows(rows[:, : layout.target.slot_bytes]), lane)
            else:
                slot.layout.scatter(ids, rows, lane)
        if layout.draft_member is None or layout.draft is None:
            return
        # target_only: chunks loaded without their draft member get empty draft state
        empty = [
            ref.block_ids[0]
            for ref, ok in zip(job.blocks, good)
            if ok and not ref.with_draft and ref.block_ids[0] != NO_BLOCK
        ]
        if empty:
            layout.draft.scatter(empty, self.staging.zeros(len(empty), layout.draft.slot_bytes), lane)

    def _gather(self, job: TransferJob) -> list[Captured]:
        """Launch the copy of the job's blocks into fresh staging rows (`saves.gather_members`;
        sidecar draft members first, so a chunk's ``kv`` never lands without them)."""
        assert self.layout is not None
        slots = [s for s in self.layout.members if s.writes and (not s.draft or keep_draft_on_save())]
        slots.sort(key=lambda s: not s.draft)
        return gather_members(self.staging, slots, job)

    def _put(self, job: TransferJob, objects: list[ObjectIO]) -> None:
        """Store the objects as given: the scheduler decided what to save (one capture per
        chunk, `captures`) and a tail slot is rewritten in place, so no de-duplication here.
        What this worker's memory tier now holds is reported to the scheduler's view."""
        saved = self.session.save(job.tenant, objects, dedupe=False)  # counts stored_bytes, store_seconds
        self._count("saved_blocks", len(job.blocks))
        stored = [
            StoredObject(it.key.as_str(), it.header.token_count, it.header.payload_len, it.header.token_ids)
            for it, held in zip(saved.items, saved.in_memory)
            if held
        ]
        if stored:
            with self._lock:
                self._reported_stored.extend(stored)

    def flush_before_exit(self, timeout_s: float, reason: str) -> bool:
        """Wait (bounded) until queued saves reached the store and every tier; what the
        bound cuts off is counted and logged (`kvpack.exit_flush` calls this at exit)."""
        deadline = time.monotonic() + timeout_s
        with self._saves_cv:
            while self._saves_done < self._saves_queued:
                left = deadline - time.monotonic()
                if left <= 0:
                    lost = self._saves_queued - self._saves_done
                    self._count("save_dropped_at_exit", lost)
                    log.warning(
                        "kvpack: %d saves still queued after %.1f s (%s); they are lost", lost, timeout_s, reason
                    )
                    return False
                self._saves_cv.wait(left)
        return self.store.flush_before_exit(max(0.0, deadline - time.monotonic()), reason)

    # -- shutdown ---------------------------------------------------------------

    def close(self) -> None:
        """Finish the queued saves and flush the store, within ``shutdown_flush_s`` in all."""
        deadline = time.monotonic() + self.config.shutdown_flush_s
        self._load_q.put(None)
        self._save_q.put(None)  # after every queued save: the save thread stores them first
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self.session.forget_at_exit(self)
        self.store.close(flush_timeout_s=max(0.0, deadline - time.monotonic()))


@dataclass(frozen=True, eq=False)
class _MemberLoad:
    """One object per chunk `wanted` of a load, read into `staging` rows: `member` (with
    `fingerprint`) restores `slot`; `heads` (stored range, the part this rank keeps) when
    the object is a canonical head range other than this rank's own."""

    slot: MemberLayout
    wanted: list[int]
    staging: torch.Tensor
    member: str
    fingerprint: str
    heads: tuple[HeadRange, HeadRange] | None = None


def _tokens_used(ref: BlockRef) -> int:
    """Tokens a loaded block contributes: a whole block, or a tail's matched prefix."""
    return ref.token_count if ref.token_ids is None else len(ref.token_ids)
