"""An object the scheduler's lookup found and that is gone when the worker loads it.

The scheduler runs apart from the workers (another process in vLLM's default
mode): it sees their memory through reports (`ReportedMemoryIndex`), cannot pin
it, and hands the workers the tier each hit object was found in
(`BlockRef.tiers`). A worker whose memory dropped the object since then counts
it as ``evicted_before_load{tier="memory"}`` (before, it was only a
``load_failures{status="miss"}``), reads it from disk when disk has it, and
otherwise reports the blocks so vLLM recomputes them.

The removal is made deterministic by dropping the objects from the worker's
memory tier between two requests: memory no longer holds them, the scheduler's
index still says it does, exactly the state an eviction leaves until the
worker's next report arrives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpack.config.schema import KVPackConfig
from kvpack.identity.keys import GroupKey, chunk_hashes

pytest.importorskip("vllm")

from vllm_helpers import (
    BLOCK,
    Run,
    bare_worker,
    close_llm,
    finished_load,
    kv_config,
    live_connectors,
    make_llm,
    metric,
    no_cache_run,
    prompt,
    run,
    same_output,
)  # noqa: E402

from kvpack.vllm_plugin.metadata import BlockRef, KVPackConnectorMetadata, TransferJob  # noqa: E402
from kvpack.vllm_plugin.worker import WorkerSide  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16
CHUNK = "c" * 64


def _worker(tmp_path: Path) -> WorkerSide:
    config = KVPackConfig.from_dict({"memory": {"capacity": "16MiB"}, "disk": {"path": str(tmp_path / "kv")}})
    return bare_worker(config, BS)


def test_worker_counts_an_object_gone_from_the_tier_the_lookup_named(tmp_path: Path) -> None:
    worker = _worker(tmp_path)
    cache = torch.randn((8, 2, BS, 2 * 32))
    worker.register_kv_caches({"model.layers.0.attn": cache}, 8)
    try:
        saved = TransferJob("w", "default", (BlockRef(CHUNK, (3,), BS),), capture=True)
        worker.queue_saves(KVPackConnectorMetadata(saves=[saved]))
        assert worker.flush_before_exit(10, "test")  # in memory and on disk
        want = cache[3].clone()
        memory = worker.session.store.tiers[0]
        assert memory.name == "memory"
        assert memory.remove_groups([GroupKey("default", worker.scope.fingerprint, CHUNK)]) == 1
        cache[5].zero_()
        load = TransferJob("r", "default", (BlockRef(CHUNK, (5,), BS, tiers=(("kv", "memory"),)),))
        worker.start_step(KVPackConnectorMetadata(loads=[load]), has_forward=True)
        assert finished_load(worker, "r") == set()
        assert torch.equal(cache[5], want)  # read from disk instead
        assert worker.session.store.metrics.value("evicted_before_load", tier="memory") == 1
        assert worker.session.store.metrics.value("load_failures") == 0
    finally:
        worker.close()


P = prompt(11, 301)  # 2 whole blocks + a 45-token tail


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path) -> Run:
    return no_cache_run(tiny_llama, P)


def _worker_store():  # type: ignore[no-untyped-def]
    (conn,) = [c for c in live_connectors() if c.role.name == "WORKER"]
    return conn.worker


@pytest.mark.parametrize("disk", [True, False], ids=["fallback-to-disk", "memory-only"])
def test_engine_output_is_unchanged_when_memory_lost_a_hit_before_the_load(
    tiny_llama: Path, tmp_path: Path, baseline: Run, disk: bool
) -> None:
    extra = {"memory": {"capacity": "256MiB"}, "disk": {"path": str(tmp_path / "kv")} if disk else {"enabled": False}}
    llm = make_llm(tiny_llama, kv_config(extra))
    try:
        first = run(llm, P)
        assert first.cached == 0 and same_output(first, baseline)
        worker = _worker_store()
        assert worker.flush_before_exit(10, "test")
        chunks = chunk_hashes(P, BLOCK)
        removed = worker.session.store.tiers[0].remove_groups(
            [GroupKey("default", worker.scope.fingerprint, c) for c in chunks]
        )
        assert removed == len(chunks)  # the two whole blocks' kv objects
        second = run(llm, P)
        assert same_output(second, baseline)
        assert metric("evicted_before_load", tier="memory") == len(chunks)
        if disk:
            assert second.cached == len(P) - 1  # every block found on disk instead: still a full hit
            assert metric("load_failures") == 0
        else:
            assert metric("load_failures", status="miss") >= len(chunks)  # recomputed
    finally:
        close_llm(llm)


P2 = P + prompt(12, 100)
"""P and 100 more tokens: a third whole block (P's tail and 83 tokens) and a 17-token tail."""


@pytest.fixture(scope="module")
def baseline2(tiny_llama: Path) -> Run:
    return no_cache_run(tiny_llama, P2)


def test_a_step_whose_load_failed_stores_nothing_it_computed(tiny_llama: Path, baseline2: Run) -> None:
    """A hit loaded inside the step (vLLM's synchronous load) that the worker's memory lost in
    part since the lookup: vLLM runs that step's forward anyway, over the block the load never
    wrote, then recomputes the request from that block. What the forward computed is not the
    prompt's KV, and stored it was the next request's hit: the soak found wrong answers under
    load this way. Here P's tail is gone from the worker's memory when P2 (P and more) loads
    P's two blocks and that tail inside its step, computes its third block and its own tail
    over the block the tail never reached, and would store both."""
    from kvpack.policy.tails import tail_chunk

    extra = {"memory": {"capacity": "256MiB"}, "disk": {"enabled": False}}
    llm = make_llm(tiny_llama, kv_config(extra))
    try:
        assert run(llm, P).cached == 0
        worker = _worker_store()
        assert worker.flush_before_exit(10, "test")
        tail = GroupKey("default", worker.scope.fingerprint, tail_chunk(chunk_hashes(P, BLOCK)[-1]))
        assert worker.session.store.tiers[0].remove_groups([tail]) == 1
        second = run(llm, P2)
        assert metric("sync_load_failures") == 1  # loaded in the step, and failed there
        assert same_output(second, baseline2)  # vLLM recomputed the request from the tail's block
        third = run(llm, P2)
        assert third.cached == len(P2) - 1
        assert same_output(third, baseline2)  # nothing the failed step computed was stored
        assert metric("captures_dropped_failed_load", tenant="default") >= 1  # counted
    finally:
        close_llm(llm)
