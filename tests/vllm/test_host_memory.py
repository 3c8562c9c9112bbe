"""Two vLLM engines on one host share kvpack's host memory tier (``memory.mode: host``, disk off).

Each engine runs in a process of its own (`vllm_helpers.start_engine_process`, as a user's
script: it computes its prompts and ends). The first computes a prompt; the second
process's first request for it loads n - 1 tokens from the host store in /dev/shm (the
disk tier is off, so nothing else could hold them) and answers as a no-cache run does
(fp32: tokens equal, logprobs within LOGPROB_TOL). The second runs in vLLM's default
multi-process mode (scheduler and worker in the engine core, the API in another
process), whose scheduler looks the prefix up in the host store directly.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import pytest
from vllm_helpers import (
    close_llm,
    engine_process,
    kv_config,
    make_llm,
    prompt,
    run,
    same_output,
    start_engine_process,
)

from kvpack.tiers.host import host_root

pytestmark = pytest.mark.vllm

P = prompt(73, 301)


def test_a_second_engine_loads_what_the_first_computed_from_host_memory(tiny_llama: Path, tmp_path: Path) -> None:
    name = f"vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    extra = {"disk": {"enabled": False}, "memory": {"mode": "host", "host_name": name, "capacity": "256MiB"}}
    try:
        writer = start_engine_process(tiny_llama, extra, {"P": P}, tmp_path / "writer.log")
        try:  # the no-cache run here while the writer runs in its own process
            baseline_llm = make_llm(tiny_llama)
            try:
                baseline = run(baseline_llm, P)
            finally:
                close_llm(baseline_llm)
        finally:
            written = writer.result()
        assert written["P"].cached == 0
        second = engine_process(tiny_llama, extra, {"P": P}, tmp_path / "reader.log", multiprocess=True)
        assert second["P"].cached == len(P) - 1
        assert same_output(second["P"], baseline)
        assert same_output(written["P"], baseline)
    finally:
        shutil.rmtree(host_root(name), ignore_errors=True)


def test_a_prompt_repeated_before_its_save_landed_in_host_memory_hits(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One engine on a host store, a script's two ``generate`` calls of one prompt, the first
    ending right after its prefill: the second is planned before the worker's save reached
    the host store (here each host-store write takes 0.2 s, as on a loaded host). The scheduler
    counts its own planned saves as held for ``io_timeout_ms`` (as it does with a per-process
    tier), so the second request hits; its load waits for the save before it and answers as a
    no-cache run does. Before, the scheduler asked the host store alone and found nothing."""
    from kvpack.tiers.host import HostTier, drop

    name = f"vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    put_from = HostTier.put_from

    def slow_put(self: HostTier, items):  # type: ignore[no-untyped-def]
        time.sleep(0.2)
        return put_from(self, items)

    baseline_llm = make_llm(tiny_llama)
    try:
        baseline = run(baseline_llm, P)
    finally:
        close_llm(baseline_llm)
    monkeypatch.setattr(HostTier, "put_from", slow_put)
    extra = {"disk": {"enabled": False}, "memory": {"mode": "host", "host_name": name, "capacity": "256MiB"}}
    llm = make_llm(tiny_llama, kv_config(extra))
    try:
        assert run(llm, P, max_tokens=1).cached == 0
        second = run(llm, P)
        assert second.cached == len(P) - 1
        assert same_output(second, baseline)
    finally:
        close_llm(llm)
        drop(name)


@pytest.mark.parametrize("mode", ["host", "process"])
def test_planned_saves_count_as_held_until_they_must_have_landed_in_the_host_store(mode: str) -> None:
    """The scheduler's view of its planned saves: with a host store each counts for
    ``io_timeout_ms`` from the end of the step that planned it (its forward may take longer
    than that; the save runs after it), then the host store alone answers (an object lost
    since is a miss, not a stale hit); with per-process tiers it stays until a worker reports
    it evicted."""
    from kvpack import KVPackConfig, StoreKey
    from kvpack.identity.layout_spec import KVLayoutSpec
    from kvpack.policy.groups import Coverage
    from kvpack.vllm_plugin.metadata import BlockRef, TransferJob
    from kvpack.vllm_plugin.scopes import CacheGroup, Scope
    from kvpack.vllm_plugin.workers_memory import WorkersMemory

    groups = (CacheGroup(0, Coverage.ALL, 0, ("model.layers.0.attn",), "FullAttentionSpec"),)
    spec = KVLayoutSpec(engine="vllm:cpu", model="dense", dtype="float32", chunk_tokens=16)
    scope = Scope(spec=spec, members=("kv",), block_size=16, draft="", groups=groups, world=1)
    config = KVPackConfig.from_dict({"io_timeout_ms": 500, "memory": {"mode": mode}, "disk": {"enabled": False}})
    now = [100.0]
    memory = WorkersMemory(config, scope, clock=lambda: now[0])
    key = lambda tenant, chunk, member: StoreKey(tenant, scope.fingerprint, chunk, member)  # noqa: E731
    memory.expect(TransferJob("w", "default", (BlockRef("a" * 64, (3,), 16),), capture=True), key)
    wanted = [key("default", "a" * 64, "kv")]
    assert memory.tiers == [memory.index] and memory.index.contains(wanted) == [True]
    memory.step_ended()  # the step that planned the save
    now[0] += 2.0  # its forward: longer than io_timeout_ms
    memory.step_ended()  # the next step: the save's time starts
    assert memory.index.contains(wanted) == [True]
    now[0] += 0.4
    memory.step_ended()
    assert memory.index.contains(wanted) == [True]
    now[0] += 0.2
    memory.step_ended()
    assert memory.index.contains(wanted) == [mode == "process"]


@pytest.mark.parametrize(
    ("registered", "checksum"),
    [(True, "never"), (False, "never"), (True, "boundary")],
    ids=["registered", "refused", "verified"],
)
def test_a_gpu_rank_loads_from_the_host_stores_mapping_in_place_only_where_registered(
    tiny_llama: Path, registered: bool, checksum: str
) -> None:
    """A vLLM engine on a host store whose worker copies through a GPU's staging (the recording
    device stands in for the GPU: its launches run at their events; the engine's cache stays
    on the CPU). Setting the staging registers the store's mapping with the device, as a CUDA
    worker's registration does. Registered: a repeat of the prompt loads n - 1 tokens copied
    once, from the mapping into device rows on the load lane (every byte the host store loaded
    is counted in ``loaded_in_place_bytes``). Refused, as CUDA may refuse it: the same load
    goes through pinned staging rows, none counted in place. Verified (the default checksum
    policy): a checksum must cover the bytes the engine reads, so the load copies into pinned
    rows and checks them there, none in place. All answer as the run that computed the prompt;
    the engine's close unregisters the mapping."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm_helpers import metric

    from fixtures.recording_device import RecordingDevice
    from kvpack.tiers.host import drop
    from kvpack.transfers import Staging

    name = f"vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    extra = {
        "disk": {"enabled": False},
        "memory": {"mode": "host", "host_name": name, "capacity": "256MiB"},
        "checksum": checksum,
    }
    device = RecordingDevice(refuse_registration=not registered)
    in_place = registered and checksum == "never"
    llm = make_llm(tiny_llama, kv_config(extra))
    try:
        worker = get_kv_transfer_group().worker
        worker.staging = Staging(device)
        mapping = worker.runner.session.store.reads.lent_host_mapping()
        assert mapping is not None and device.registered.covers(*mapping) is registered
        first = run(llm, P)
        assert first.cached == 0
        second = run(llm, P)
        assert second.cached == len(P) - 1
        assert same_output(second, first)
        from_host = metric("loaded_bytes", tier="host")
        assert from_host > 0
        assert metric("loaded_in_place_bytes") == (from_host if in_place else 0)
        uploads = [op for op in device.ops if op[0] == "device_rows"]
        assert bool(uploads) is in_place  # the mapping's objects copied to device rows
        assert device.violations == [] and device.unlaunched() == 0
    finally:
        close_llm(llm)
        drop(name)
    assert ("unregister_host",) in device.ops and not device.registered
