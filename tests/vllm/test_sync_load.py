"""A hit in the workers' memory loads inside the step that computes the rest of its prompt.

An asynchronous load costs a hit one more engine step (the request waits in
WAITING_FOR_REMOTE_KVS while a worker thread copies it, and is scheduled the step
after), and at concurrency that step is often another request's prefill. A hit whose
objects are all in the workers' memory and that is small (`SYNC_LOAD_MAX_BYTES`) is
loaded synchronously instead: the worker copies it in ``start_load_kv``, before the
forward; blocks that fail are recomputed by vLLM (its recompute policy for sync
loads). Disk, Mooncake, handoffs and hybrids keep asynchronous loads.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from kvpack.config.schema import KVPackConfig
from kvpack.identity.keys import StoreKey, chunk_hashes
from kvpack.identity.layout_spec import KVLayoutSpec
from kvpack.policy.groups import Coverage
from kvpack.tiers.host import drop

pytest.importorskip("vllm")

from vllm_helpers import (
    Run,
    bare_worker,
    close_llm,
    fake_request,
    kv_config,
    live_connectors,
    make_llm,
    metric,
    no_cache_run,
    prompt,
    run,
    same_output,
)  # noqa: E402

from kvpack.vllm_plugin.metadata import BlockRef, KVPackConnectorMetadata, StoredObject, TransferJob  # noqa: E402
from kvpack.vllm_plugin.scheduler import SchedulerSide  # noqa: E402
from kvpack.vllm_plugin.scopes import CacheGroup, Scope, member_name  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16
A, B = "a" * 64, "b" * 64


def _worker(tmp_path: Path, disk: bool = True):  # type: ignore[no-untyped-def]
    cfg = {"memory": {"capacity": "16MiB"}, "disk": {"path": str(tmp_path / "kv")} if disk else {"enabled": False}}
    worker = bare_worker(KVPackConfig.from_dict(cfg), BS)
    cache = torch.randn((8, 2, BS, 2 * 32))
    worker.register_kv_caches({"model.layers.0.attn": cache}, 8)
    return worker, cache


def test_a_sync_load_is_restored_when_start_load_kv_returns(tmp_path: Path) -> None:
    """The save queued in the step before (a prefix computed a step ago) is waited for; the
    load is done before the forward, and is not reported as an async receive."""
    worker, cache = _worker(tmp_path)
    try:
        worker.queue_saves(
            KVPackConnectorMetadata(saves=[TransferJob("w", "default", (BlockRef(A, (3,), BS),), capture=True)])
        )
        want = cache[3].clone()
        cache[5].zero_()
        load = TransferJob("r", "default", (BlockRef(A, (5,), BS, tiers=(("kv", "memory"),)),), sync=True)
        worker.start_step(KVPackConnectorMetadata(loads=[load]), has_forward=True)
        assert torch.equal(cache[5], want)  # no get_finished, no wait: already there
        _, recving, failed = worker.get_finished()
        assert "r" not in recving and not failed
        assert worker.take_load_errors() == set()
        assert worker.session.store.metrics.value("sync_loads", tenant="default") == 1
    finally:
        worker.close()


def test_a_sync_load_that_fails_reports_its_blocks_for_recompute(tmp_path: Path) -> None:
    worker, cache = _worker(tmp_path, disk=False)
    try:
        before = cache[6].clone()
        load = TransferJob(
            "r", "default", (BlockRef(B, (6,), BS, tiers=(("kv", "memory"),)),), sync=True
        )  # never stored
        worker.start_step(KVPackConnectorMetadata(loads=[load]), has_forward=True)
        assert worker.take_load_errors() == {6}
        assert torch.equal(cache[6], before)
        _, recving, failed = worker.get_finished()
        assert "r" not in recving and not failed
    finally:
        worker.close()


def _scheduler(sync_max: int, world: int = 1) -> SchedulerSide:
    groups = (CacheGroup(0, Coverage.ALL, 0, ("model.layers.0.attn",), "FullAttentionSpec"),)
    spec = KVLayoutSpec(engine="vllm:cpu", model="dense", dtype="float32", chunk_tokens=BS)
    members = tuple(member_name("kv", rank, world) for rank in range(world))
    scope = Scope(spec=spec, members=members, block_size=BS, draft="", groups=groups, world=world)
    cfg = KVPackConfig.from_dict({"disk": {"enabled": False}, "tail_reuse": False})
    return SchedulerSide(cfg, scope, can_load=True, can_save=False, sync_load_max_blocks=sync_max)


@pytest.mark.parametrize(
    "sync_max,world,want_async",
    [(4, 1, False), (2, 1, True), (0, 1, True), (4, 2, True)],
    ids=["fits", "too-large", "off", "two-workers"],
)
def test_the_scheduler_loads_a_memory_hit_in_step_only_when_it_fits(
    sync_max: int, world: int, want_async: bool
) -> None:
    """In step: a hit of at most `sync_max` blocks, all in the workers' memory, with one worker (a
    block one rank failed to load in step would feed every rank's next layers: two load async)."""
    side = _scheduler(sync_max, world)
    try:
        ids = list(range(500, 549))  # 3 whole chunks and one token
        chunks = chunk_hashes(ids, BS)
        keys = [StoreKey("default", side.scope.fingerprint, c, m) for c in chunks for m in side.scope.members]
        side.memory.index.apply([StoredObject(key.as_str(), BS, 64) for key in keys], [])  # every rank's member
        assert side.get_num_new_matched_tokens(fake_request(ids, "r"), 0) == (3 * BS, want_async)
    finally:
        side.close()


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path) -> Run:
    return no_cache_run(tiny_llama, P)


P = prompt(61, 301)


@pytest.mark.parametrize(
    "memory", ["process", "host", "off"], ids=["memory-hit-in-step", "host-hit-in-step", "disk-hit-async"]
)
def test_a_second_request_of_a_prompt_hits_in_step_with_the_same_output(
    tiny_llama: Path, tmp_path: Path, baseline: Run, memory: str
) -> None:
    """The host store is memory too: its hits load inside the step (the scheduler asks it).
    A hit from the per-process memory tier is converted into vLLM's CPU cache straight from the
    tier's slots: every byte it loaded is counted in ``loaded_in_place_bytes`` (a staging copy
    first would count none). A host-store load verifies its checksum (the default policy: other
    processes write that mapping) on a copy of its own, so none of it is in place."""
    name = f"sync-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    mem = {
        "enabled": memory != "off",
        "capacity": "256MiB",
        **({"mode": "host", "host_name": name} if memory == "host" else {}),
    }
    extra = {"memory": mem, "disk": {"path": str(tmp_path / "kv")}}
    llm = make_llm(tiny_llama, kv_config(extra))
    try:
        assert run(llm, P).cached == 0
        # what is asked is where a hit the memory holds is loaded: the first request's saves are
        # in it before the second looks (on a busy machine a host-store save can land after the
        # scheduler stopped counting it as landing, and that hit is loaded in the background)
        (worker,) = [c.worker for c in live_connectors() if c.role.name == "WORKER"]
        assert worker.flush_before_exit(10, "test")
        second = run(llm, P)
        assert second.cached == len(P) - 1
        assert same_output(second, baseline)
        assert metric("sync_loads") == (0 if memory == "off" else 1)
        tier = {"process": "memory", "host": "host"}.get(memory)
        from_memory = metric("loaded_bytes", tier=tier) if tier else 0.0
        assert (from_memory > 0) == (memory != "off")
        assert metric("loaded_in_place_bytes") == (from_memory if memory == "process" else 0.0)
    finally:
        close_llm(llm)
        drop(name)


def test_a_host_store_hit_whose_pages_another_writer_takes_mid_load_is_recomputed(
    tiny_llama: Path, baseline: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host-store hit is converted into vLLM's cache straight from the shared memory. If
    another process's writer takes those pages while the conversion reads them (the object
    evicted, its pages rewritten), the blocks are reported failed and vLLM recomputes them:
    the output is the no-cache run's. Here the second writer strikes right after the lend,
    before the conversion; without the check after it the engine would decode from the
    other writer's bytes. (Only loads that verify no checksum are lent: a verified one copies
    first and checks its copy, `HostTier.lend`; hence ``checksum: never`` here.)"""
    from kvpack.tiers.host import HostTier

    name = f"sync-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    lend = HostTier.lend
    struck: list[int] = []

    def lend_then_strike(self: HostTier, keys, expected, verify):  # type: ignore[no-untyped-def]
        got, held = lend(self, keys, expected, verify)
        other = HostTier(name, self.capacity_bytes)
        try:
            extents = [e for e in self._host_catalog.ready_extents(keys) if e is not None]
            assert other.remove_groups(list({k.group for k in keys})) > 0
            other._pages.begin_writes([e.runs for e in extents])
            for view in (v for _, v in filter(None, got)):
                view.obj[:] = 0xAB  # type: ignore[index]  # the mapping itself now holds another object's bytes
            struck.append(len(extents))
        finally:
            other.close()
        return got, held

    monkeypatch.setattr(HostTier, "lend", lend_then_strike)
    mem = {"capacity": "256MiB", "mode": "host", "host_name": name}
    llm = make_llm(tiny_llama, kv_config({"memory": mem, "disk": {"enabled": False}, "checksum": "never"}))
    try:
        assert run(llm, P).cached == 0
        second = run(llm, P)
        assert struck and struck[0] > 0
        assert same_output(second, baseline)
        assert metric("loaded_in_place_bytes") > 0 and metric("load_error_blocks") > 0
    finally:
        close_llm(llm)
        drop(name)
