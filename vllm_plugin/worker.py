"""Worker side: restores and saves whole blocks of every layer, off the forward path.

Per step vLLM binds a `KVPackConnectorMetadata`. `start_load_kv` hands its
load jobs to a background thread (read from the store into staging rows, then
scatter into the blocks); `wait_for_save` hands its save jobs to another
(gather the finished request's blocks, then `KVStore.store`, which copies into
host memory and queues disk/Mooncake writes). Nothing waits on storage in the
forward; `get_finished` reports completed jobs, failed blocks are reported
through `get_block_ids_with_load_errors` so vLLM recomputes them.

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

from kvpack.config import KVPackConfig
from kvpack.keys import GroupKey, StoreKey
from kvpack.layout import KVLayoutSpec
from kvpack.objects import Expectation, ObjectHeader
from kvpack.store import KVStore, LoadItem
from kvpack.tiers.base import PutItem

from .blocks import BlockLayout
from .metadata import BlockRef, KVPackConnectorMetadata, KVPackWorkerMetadata, StoredObject, TransferJob
from .settings import Scope, member_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvpack.vllm")


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
        self.num_target_layers = _target_layers(vllm_config)
        self.store = store or KVStore.from_config(config)
        self.layout: BlockLayout | None = None
        self.fingerprint = ""
        self.slot_bytes = 0
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
        names = tuple(kv_caches)
        self.layout = BlockLayout.from_tensors([kv_caches[n] for n in names], num_blocks)
        self.slot_bytes = self.layout.slot_bytes
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
            extra=(("layers", ";".join(self.layout.description)),),
        )
        assert spec.group_fingerprint == self.scope.fingerprint
        self.fingerprint = spec.member_fingerprint
        draft = len(names) - self.num_target_layers if self.scope.draft else 0
        log.info(
            "kvpack: %d KV layers registered (%d draft, packed into each object), %d blocks, %d bytes per object, "
            "member %s",
            len(names),
            max(draft, 0),
            num_blocks,
            self.slot_bytes,
            self.member,
        )

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

    def _key(self, tenant: str, chunk: str) -> StoreKey:
        return StoreKey(tenant, self.scope.fingerprint, chunk, self.member)

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

    def _run_load(self, task: _LoadTask) -> None:
        assert self.layout is not None
        job = task.job
        n = len(job.blocks)
        staging = torch.empty((n, self.slot_bytes), dtype=torch.uint8)
        rows = staging.numpy()
        items = []
        for i, ref in enumerate(job.blocks):
            items.append(
                LoadItem(
                    self._key(job.tenant, ref.chunk),
                    memoryview(rows[i]),
                    Expectation(
                        fingerprint=self.fingerprint,
                        tenant=job.tenant,
                        chunk=ref.chunk,
                        member=self.member,
                        token_count=None if ref.token_ids is not None else ref.token_count,
                        payload_len=self.slot_bytes,
                        token_ids_prefix=ref.token_ids,
                    ),
                )
            )
        start = time.perf_counter()
        results = self.store.load(items)
        ok = [i for i, r in enumerate(results) if r.ok]
        failed = {job.blocks[i].block_id for i, r in enumerate(results) if not r.ok}
        with self._lock:
            if task.cancelled:
                return
            if ok:
                self.layout.scatter([job.blocks[i].block_id for i in ok], staging[ok] if len(ok) < n else staging)
            task.failed_blocks = failed
        tokens = sum(_tokens_used(job.blocks[i]) for i in ok)
        self.store.metrics.inc("loaded_tokens", tokens, tenant=job.tenant)
        self._count("loaded_blocks", len(ok))
        self._count("loaded_bytes", len(ok) * self.slot_bytes)
        self._count("load_seconds", time.perf_counter() - start)
        if failed:
            self._count("failed_blocks", len(failed))
            log.warning("kvpack: %d of %d blocks of %s could not be loaded; vLLM recomputes them", len(failed), n, job.req_id)

    def _save_loop(self) -> None:
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

    def _run_save(self, job: TransferJob) -> None:
        assert self.layout is not None
        n = len(job.blocks)
        staging = torch.empty((n, self.slot_bytes), dtype=torch.uint8)
        self.layout.gather([b.block_id for b in job.blocks], staging)
        rows = staging.numpy()
        items = []
        for i, ref in enumerate(job.blocks):
            key = self._key(job.tenant, ref.chunk)
            header = ObjectHeader(
                fingerprint=self.fingerprint,
                tenant=job.tenant,
                chunk=ref.chunk,
                member=self.member,
                token_count=ref.token_count,
                payload_len=self.slot_bytes,
                checksum=None,
                token_ids=ref.token_ids,
            )
            items.append(PutItem(key, header, memoryview(rows[i])))
        start = time.perf_counter()
        self.store.store(items)
        self._count("saved_blocks", n)
        self._count("saved_bytes", n * self.slot_bytes)
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


def _target_layers(vllm_config: VllmConfig) -> int:
    try:
        return int(vllm_config.model_config.get_num_layers(vllm_config.parallel_config))
    except Exception:
        return 0
