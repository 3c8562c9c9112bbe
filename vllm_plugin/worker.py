"""Worker side: restores and saves whole blocks of every layer, off the forward path.

Per step vLLM binds a `KVPackConnectorMetadata`. `start_load_kv` hands its
load jobs to a background thread (read from the store into staging rows, then
scatter into the blocks); `wait_for_save` hands its save jobs to another
(gather the finished request's blocks, then `KVStore.store`, which copies into
host memory and queues disk/Mooncake writes). Nothing waits on storage in the
forward; `get_finished` reports completed jobs, failed blocks are reported
through `get_block_ids_with_load_errors` so vLLM recomputes them.

Draft KV (speculative decoding; `Scope.draft_placement`): PACKED copies the
draft layers into each ``kv`` object after the target's, so the two cannot be
separated; SIDECAR stores them as a second object per block, member ``draft``
(own layout fingerprint over the draft layers), in the same group. A load
marked ``with_draft=False`` (target_only policy, the draft member was
missing) restores the target member and zeroes those blocks' draft layers:
the drafter never recomputes KV for tokens it was not scheduled, so the
request runs with empty draft state there (a counted partial hit). Saves run
once per step (in `wait_for_save`, which vLLM defers until the drafter ran),
however often the drafter's layers call `save_kv_layer`.

Every wait is bounded by ``io_timeout_ms``: a load still running after it is
cancelled (its blocks are reported as load errors and will never be written
by the late thread), so a hung tier can never hold a request forever. In a
step without a forward (the engine is only waiting for loads) the worker
waits, bounded, for this step's loads so they finish within the same step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvpack.background import lower_current_thread_priority
from kvpack.config import KVPackConfig
from kvpack.errors import LayoutError
from kvpack.groups import DraftPlacement
from kvpack.keys import GroupKey, StoreKey
from kvpack.layout import KVLayoutSpec
from kvpack.objects import Expectation, ObjectHeader
from kvpack.store import KVStore, LoadItem
from kvpack.tiers.base import PutItem

from .blocks import BlockLayout
from .metadata import BlockRef, KVPackConnectorMetadata, KVPackWorkerMetadata, StoredObject, TransferJob
from .settings import DRAFT_MEMBER, Scope, member_name, split_draft_layers

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvpack.vllm")


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


@dataclass
class _LoadTask:
    job: TransferJob
    started: float
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    failed_blocks: set[int] = field(default_factory=set)


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig, config: KVPackConfig, scope: Scope, store: KVStore | None = None) -> None:
        self.config = config
        self.scope = scope
        parallel = vllm_config.parallel_config
        self.tp_rank = _tp_rank()
        self.pp_rank = _pp_rank()
        world = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
        self.member = member_name(self.pp_rank * int(parallel.tensor_parallel_size) + self.tp_rank, world)
        self.vllm_config = vllm_config
        self.draft_member = (
            member_name(self.pp_rank * int(parallel.tensor_parallel_size) + self.tp_rank, world, DRAFT_MEMBER)
            if scope.draft_placement is DraftPlacement.SIDECAR
            else None
        )
        self.store = store or KVStore.from_config(config)
        self.layout: BlockLayout | None = None
        """Layers of the ``kv`` object (PACKED: target then draft layers)."""
        self.target_layout: BlockLayout | None = None
        """Target layers only; its rows are the leading `target_bytes` of a ``kv`` row."""
        self.draft_layout: BlockLayout | None = None
        """Draft layers only (PACKED: the trailing bytes of a ``kv`` row; SIDECAR: the ``draft`` object)."""
        self.fingerprint = ""
        self.draft_fingerprint = ""
        self.slot_bytes = 0
        self.target_bytes = 0
        self.draft_bytes = 0
        self._lock = threading.Lock()
        self._loads: dict[str, _LoadTask] = {}
        self._done_recving: set[str] = set()
        self._done_sending: set[str] = set()
        self._load_errors: set[int] = set()
        self._reported_stored: list[StoredObject] = []
        self._reported_evicted: list[str] = []
        self._failed_loads: list[str] = []
        self._stats: dict[str, float] = {}
        self._idle_step = False
        self._step_loads: list[_LoadTask] = []
        self._load_q: queue.Queue[_LoadTask | None] = queue.Queue()
        self._save_q: queue.Queue[TransferJob | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._load_loop, name="kvpack-vllm-load", daemon=True),
            threading.Thread(target=self._save_loop, name="kvpack-vllm-save", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._memory = next((t for t in self.store.tiers if t.name == "memory"), None)

        def on_evict(tier: str, group: GroupKey, nbytes: int) -> None:
            if tier == "memory":
                self._reported_evicted.append(group.as_str())  # list.append is atomic

        self.store.add_evict_listener(on_evict)

    # -- registration -----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        placement = self.scope.draft_placement
        target, draft = split_draft_layers(self.vllm_config, tuple(kv_caches))
        if placement is DraftPlacement.SIDECAR and not draft:
            raise LayoutError(
                "kvpack: draft_placement 'sidecar' needs the drafter's KV layers, but none of the registered "
                f"layers {sorted(kv_caches)} is one (expected 'draft_model.*', or a layer index at or past the "
                "target's layer count); use draft_placement 'packed'"
            )
        if placement is DraftPlacement.PACKED and not draft:
            log.warning("kvpack: no drafter KV layer told apart; every registered layer is packed into each object")

        def layout(names: tuple[str, ...]) -> BlockLayout:
            return BlockLayout.from_tensors([kv_caches[n] for n in names], num_blocks)

        kv_names = target + draft if placement is DraftPlacement.PACKED else target
        self.layout = layout(kv_names)
        self.slot_bytes = self.layout.slot_bytes
        self.fingerprint = self._member_fingerprint(kv_caches, kv_names, self.layout, "kv")
        self.target_layout = layout(target) if kv_names != target else self.layout
        self.target_bytes = self.target_layout.slot_bytes
        if draft:
            self.draft_layout = layout(draft)
            self.draft_bytes = self.draft_layout.slot_bytes
            if placement is DraftPlacement.SIDECAR:
                self.draft_fingerprint = self._member_fingerprint(kv_caches, draft, self.draft_layout, DRAFT_MEMBER)
        log.info(
            "kvpack: %d KV layers registered (%d draft, %s), %d blocks, %d bytes per object, member %s%s",
            len(kv_caches),
            len(draft),
            placement.value,
            num_blocks,
            self.slot_bytes,
            self.member,
            f" + {self.draft_member} ({self.draft_bytes} bytes)" if self.draft_member else "",
        )

    def _member_fingerprint(
        self, kv_caches: dict[str, torch.Tensor], names: tuple[str, ...], layout: BlockLayout, role: str
    ) -> str:
        extra: tuple[tuple[str, str], ...] = (("layers", ";".join(layout.description)),)
        if role != "kv":
            extra += (("member", role),)
        spec = KVLayoutSpec(
            engine=self.scope.spec.engine,
            model=self.scope.spec.model,
            dtype=self.scope.spec.dtype,
            chunk_tokens=self.scope.block_size,
            tp_size=self.scope.spec.tp_size,
            pp_size=self.scope.spec.pp_size,
            tp_rank=self.tp_rank,
            pp_rank=self.pp_rank,
            layer_names=names,
            layer_shape=tuple(kv_caches[names[0]].shape[1:]) if names else (),
            extra=extra,
        )
        assert spec.group_fingerprint == self.scope.fingerprint
        return spec.member_fingerprint

    # -- per step ---------------------------------------------------------------

    def start_step(self, meta: KVPackConnectorMetadata, has_forward: bool) -> None:
        """Queue this step's loads (called from start_load_kv)."""
        self._idle_step = not has_forward
        self._step_loads = []
        if self.layout is None:
            return
        for job in meta.loads:
            task = _LoadTask(job, time.monotonic())
            with self._lock:
                self._loads[job.req_id] = task
            self._step_loads.append(task)
            self._load_q.put(task)

    def queue_saves(self, meta: KVPackConnectorMetadata) -> None:
        """Queue this step's saves (called from wait_for_save: once per step, after every forward)."""
        if self.layout is None:
            return
        for job in meta.saves:
            self._save_q.put(job)

    def get_finished(self) -> tuple[set[str], set[str]]:
        timeout = self.config.io_timeout_ms / 1000.0
        if self._idle_step and self._step_loads:
            deadline = time.monotonic() + timeout
            for task in self._step_loads:
                task.done.wait(max(0.0, deadline - time.monotonic()))
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
                elif now - task.started > timeout:
                    task.cancelled = True  # the load thread will not write these blocks any more
                    del self._loads[req_id]
                    self._done_recving.add(req_id)
                    self._load_errors |= {b.block_id for b in task.job.blocks}
                    self._failed_loads.append(req_id)
                    self._count("load_timeouts")
                    log.warning("kvpack: load for %s exceeded io_timeout_ms=%d; recomputing", req_id, self.config.io_timeout_ms)
            recving, self._done_recving = self._done_recving, set()
            sending, self._done_sending = self._done_sending, set()
        return sending, recving

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        if errors:
            self._count("load_error_blocks", len(errors))
        return errors

    def take_report(self) -> KVPackWorkerMetadata | None:
        with self._lock:
            stored, self._reported_stored = self._reported_stored, []
            failed, self._failed_loads = self._failed_loads, []
        evicted, self._reported_evicted = self._reported_evicted, []
        if not stored and not evicted and not failed:
            return None
        return KVPackWorkerMetadata(stored, evicted, failed)

    def take_stats(self) -> dict[str, float]:
        with self._lock:
            stats, self._stats = self._stats, {}
        return stats

    def _count(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._stats[name] = self._stats.get(name, 0) + amount

    # -- background work --------------------------------------------------------

    def _key(self, tenant: str, chunk: str, member: str | None = None) -> StoreKey:
        return StoreKey(tenant, self.scope.fingerprint, chunk, member or self.member)

    def _load_loop(self) -> None:
        while True:
            task = self._load_q.get()
            if task is None:
                return
            try:
                self._run_load(task)
            except Exception as exc:  # never let a load kill the thread: report the blocks
                log.warning("kvpack: load for %s failed: %s", task.job.req_id, exc)
                task.failed_blocks = {b.block_id for b in task.job.blocks}
            finally:
                task.done.set()

    def _load_item(self, tenant: str, ref: BlockRef, member: str, fingerprint: str, dst: memoryview) -> LoadItem:
        return LoadItem(
            self._key(tenant, ref.chunk, member),
            dst,
            Expectation(
                fingerprint=fingerprint,
                tenant=tenant,
                chunk=ref.chunk,
                member=member,
                token_count=None if ref.token_ids is not None else ref.token_count,
                payload_len=len(dst),
                token_ids_prefix=ref.token_ids,
            ),
        )

    def _run_load(self, task: _LoadTask) -> None:
        assert self.layout is not None and self.target_layout is not None
        job = task.job
        n = len(job.blocks)
        staging = torch.empty((n, self.slot_bytes), dtype=torch.uint8)
        rows = staging.numpy()
        items = [
            self._load_item(job.tenant, ref, self.member, self.fingerprint, memoryview(rows[i]))
            for i, ref in enumerate(job.blocks)
        ]
        restore_draft = keep_draft_on_load()
        # SIDECAR: the draft member of every block that has one (with_draft), one batch with the target's
        with_draft = [i for i, ref in enumerate(job.blocks) if ref.with_draft] if self.draft_member else []
        dstaging = torch.empty((len(with_draft), self.draft_bytes), dtype=torch.uint8)
        if restore_draft and with_draft:
            drows = dstaging.numpy()
            assert self.draft_member is not None
            member, fingerprint = self.draft_member, self.draft_fingerprint
            items += [
                self._load_item(job.tenant, job.blocks[i], member, fingerprint, memoryview(drows[j]))
                for j, i in enumerate(with_draft)
            ]
        start = time.perf_counter()
        results = self.store.load(items)
        good = [r.ok for r in results[:n]]
        if restore_draft and with_draft:
            for j, i in enumerate(with_draft):
                good[i] = good[i] and results[n + j].ok  # a block whose draft is missing is not a hit
        ok = [i for i in range(n) if good[i]]
        failed = {job.blocks[i].block_id for i in range(n) if not good[i]}
        with self._lock:
            if task.cancelled:
                return
            if ok:
                self._scatter(job, ok, staging, with_draft, dstaging, restore_draft)
            task.failed_blocks = failed
        tokens = sum(_tokens_used(job.blocks[i]) for i in ok)
        self.store.metrics.inc("loaded_tokens", tokens, tenant=job.tenant)
        self._count("loaded_blocks", len(ok))
        self._count("loaded_bytes", len(ok) * self.slot_bytes)
        if self.draft_layout is not None:
            drafted = sum(1 for i in ok if job.blocks[i].with_draft) if restore_draft else 0
            self._count("loaded_draft_blocks", drafted)
            if len(ok) > drafted:
                self._count("loaded_without_draft_blocks", len(ok) - drafted)
        self._count("load_seconds", time.perf_counter() - start)
        if failed:
            self._count("failed_blocks", len(failed))
            log.warning("kvpack: %d of %d blocks of %s could not be loaded; vLLM recomputes them", len(failed), n, job.req_id)

    def _save_loop(self) -> None:
        lower_current_thread_priority()  # saves must not slow the engine's next steps
        while True:
            job = self._save_q.get()
            if job is None:
                return
            try:
                self._run_save(job)
            except Exception as exc:  # a failed save is a future miss, never an engine error
                log.warning("kvpack: save for %s failed: %s", job.req_id, exc)
                self._count("save_errors")
            finally:
                with self._lock:
                    self._done_sending.add(job.req_id)
                self._save_q.task_done()

    def _scatter(
        self,
        job: TransferJob,
        ok: list[int],
        staging: torch.Tensor,
        with_draft: list[int],
        dstaging: torch.Tensor,
        restore_draft: bool,
    ) -> None:
        """Loaded rows -> blocks (called under the lock, never after a cancel)."""
        assert self.layout is not None and self.target_layout is not None
        ids = [job.blocks[i].block_id for i in ok]
        rows = staging[ok] if len(ok) < len(job.blocks) else staging
        if self.scope.draft_placement is DraftPlacement.PACKED and not restore_draft:
            self.target_layout.scatter(ids, rows[:, : self.target_bytes].contiguous())
        else:
            self.layout.scatter(ids, rows)
        if self.draft_member is None or self.draft_layout is None:
            return
        pos = {i: j for j, i in enumerate(with_draft)}
        if restore_draft:
            drafted = [i for i in ok if i in pos]
            if drafted:
                self.draft_layout.scatter([job.blocks[i].block_id for i in drafted], dstaging[[pos[i] for i in drafted]])
        empty = [job.blocks[i].block_id for i in ok if i not in pos]  # target_only: no stored draft state
        if empty:
            self.draft_layout.scatter(empty, torch.zeros((len(empty), self.draft_bytes), dtype=torch.uint8))

    def _run_save(self, job: TransferJob) -> None:
        assert self.layout is not None
        n = len(job.blocks)
        block_ids = [b.block_id for b in job.blocks]
        staging = torch.empty((n, self.slot_bytes), dtype=torch.uint8)
        self.layout.gather(block_ids, staging)
        rows = staging.numpy()
        members = [(self.member, self.fingerprint, rows)]
        if self.draft_member is not None and self.draft_layout is not None and keep_draft_on_save():
            dstaging = torch.empty((n, self.draft_bytes), dtype=torch.uint8)
            self.draft_layout.gather(block_ids, dstaging)
            members.insert(0, (self.draft_member, self.draft_fingerprint, dstaging.numpy()))  # draft first: no kv without it
        items = []
        for member, fingerprint, member_rows in members:
            for i, ref in enumerate(job.blocks):
                header = ObjectHeader(
                    fingerprint=fingerprint,
                    tenant=job.tenant,
                    chunk=ref.chunk,
                    member=member,
                    token_count=ref.token_count,
                    payload_len=member_rows.shape[1],
                    checksum=None,
                    token_ids=ref.token_ids,
                )
                items.append(PutItem(self._key(job.tenant, ref.chunk, member), header, memoryview(member_rows[i])))
        start = time.perf_counter()
        self.store.store(items)
        self._count("saved_blocks", n)
        self._count("saved_bytes", sum(it.header.payload_len for it in items))
        self._count("save_seconds", time.perf_counter() - start)
        if self._memory is not None:
            present = self._memory.contains([it.key for it in items])
            stored = [
                StoredObject(it.key.as_str(), it.header.token_count, it.header.payload_len, it.header.token_ids)
                for it, ok in zip(items, present)
                if ok
            ]
            with self._lock:
                self._reported_stored.extend(stored)

    def flush(self, timeout_s: float) -> bool:
        """Wait (bounded) until queued saves are copied and reached every tier."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._save_q.unfinished_tasks == 0:  # put() counts up, task_done() down
                break
            time.sleep(0.005)
        else:
            return False
        return self.store.flush(max(0.0, deadline - time.monotonic()))

    # -- shutdown ---------------------------------------------------------------

    def close(self) -> None:
        self._load_q.put(None)
        self._save_q.put(None)
        for t in self._threads:
            t.join(timeout=self.config.io_timeout_ms / 1000.0 + 5.0)
        self.store.close()


def _tokens_used(ref: BlockRef) -> int:
    """Tokens a loaded block contributes: a whole block, or a tail's matched prefix."""
    return ref.token_count if ref.token_ids is None else len(ref.token_ids)


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


def _pp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except Exception:
        return 0
