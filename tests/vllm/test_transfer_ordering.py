"""Device order the CPU cannot see, shown with the recording device (its launches run only
when their event completes, the forward only when the compute stream runs) behind the real
`WorkerSide` and its `kvpack.TransferRunner`:

- a block a save still reads is not rewritten by a forward queued after the save (vLLM
  may free the block right after the step: a finished or preempted request), because the
  compute stream waits on the save's gather event;
- a load whose scatter is launched is not cancelled and reported at ``io_timeout_ms``
  while its copy still runs: it is reported once the copy's event completed.

Without `StagingDevice.order_compute` the first stores the rewritten bytes; with the
cancel path as it was (any load past its bound reported at once) the second reports the
load while its copy has not landed.
"""

from __future__ import annotations

import time

import pytest
import torch

from fixtures.recording_device import RecordingDevice
from kvpack.config.schema import KVPackConfig
from kvpack.transfers.staging import CpuDevice, Direction, Staging

pytest.importorskip("vllm")

from vllm_helpers import bare_worker, finished_load  # noqa: E402

from kvpack.vllm_plugin.metadata import BlockRef, KVPackConnectorMetadata, TransferJob  # noqa: E402
from kvpack.vllm_plugin.worker import WorkerSide  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16
CHUNK = "d" * 64


def _worker(io_timeout_ms: int = 500) -> tuple[WorkerSide, torch.Tensor]:
    config = KVPackConfig.from_dict(
        {"memory": {"capacity": "16MiB"}, "disk": {"enabled": False}, "io_timeout_ms": io_timeout_ms}
    )
    worker = bare_worker(config, BS)
    cache = torch.randn((8, 2, BS, 2 * 32))
    worker.register_kv_caches({"model.layers.0.attn": cache}, 8)
    return worker, cache


def _save(worker: WorkerSide, block: int) -> None:
    job = TransferJob("w", "default", (BlockRef(CHUNK, (block,), BS),), capture=True)
    worker.queue_saves(KVPackConnectorMetadata(saves=[job]))


def _load(worker: WorkerSide, block: int) -> None:
    job = TransferJob("r", "default", (BlockRef(CHUNK, (block,), BS, tiers=(("kv", "memory"),)),))
    worker.start_step(KVPackConnectorMetadata(loads=[job]), has_forward=True)


def test_a_forward_after_a_save_does_not_rewrite_the_block_the_save_still_reads() -> None:
    worker, cache = _worker()
    try:
        dev = RecordingDevice()
        worker.staging = Staging(dev)
        want = cache[3].clone()
        dev.hold(Direction.SAVE)  # the save thread reaches the gather's event late
        _save(worker, 3)
        # vLLM freed block 3 after the step; the next forward writes another request's KV into it
        dev.queue_compute(lambda: cache[3].fill_(7.0))
        dev.run_compute()
        assert torch.equal(cache[3], torch.full_like(cache[3], 7.0))  # the forward did run
        dev.unhold(Direction.SAVE)
        assert worker.flush_before_exit(10, "test")
        worker.staging = Staging(CpuDevice())
        _load(worker, 5)
        assert finished_load(worker, "r") == set()
        assert torch.equal(cache[5], want)  # what the save's step computed, not the next forward's bytes
        ops = [op[0] for op in dev.ops]
        assert ops.index("order_compute") < ops.index("run") < ops.index("forward")
        assert dev.violations == []
    finally:
        worker.close()


def test_a_load_whose_copy_is_launched_is_reported_only_after_its_event() -> None:
    worker, cache = _worker(io_timeout_ms=50)
    try:
        _save(worker, 3)
        assert worker.flush_before_exit(10, "test")
        dev = RecordingDevice()
        worker.staging = Staging(dev)
        dev.hold(Direction.LOAD)  # the copy into the cache is slow to land
        _load(worker, 5)
        dev.wait_op(("launch", Direction.LOAD))
        worker.runner.clock = lambda: time.monotonic() + 60.0  # the load is now far past io_timeout_ms
        _, recving, failed = worker.get_finished()
        assert "r" not in recving and not failed  # not reported while the copy runs
        assert worker.take_load_errors() == set()
        assert not torch.equal(cache[5], cache[3])
        dev.unhold(Direction.LOAD)
        assert finished_load(worker, "r") == set()
        assert torch.equal(cache[5], cache[3])  # reported done: the copy landed
        assert dev.violations == [] and worker.take_stats().get("load_timeouts") is None
    finally:
        worker.close()
