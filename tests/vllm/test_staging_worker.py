"""The vLLM worker's saves and loads through `kvpack.transfers.staging`, with the recording device
standing in for a GPU (`kvpack.staging_record`): its launches run only when their event is
waited on, and the step's forward runs only when a side stream waits on the compute stream.

On the code before `kvpack.transfers.staging` (plain ``torch.empty`` rows, copies inline on the
current stream, rows read right after the gather, a load reported done right after its
scatter) each of these fails: on a GPU the rows would be pageable (refused by the CUDA
kernel), read before the copy landed, or released while it still ran.
"""

from __future__ import annotations

from pathlib import Path

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
CHUNK = "c" * 64


def _worker(tmp_path: Path) -> tuple[WorkerSide, torch.Tensor]:
    config = KVPackConfig.from_dict({"memory": {"capacity": "16MiB"}, "disk": {"enabled": False}})
    worker = bare_worker(config, BS)
    cache = torch.zeros((8, 2, BS, 2 * 32))
    worker.register_kv_caches({"model.layers.0.attn": cache}, 8)
    return worker, cache


def _ops(dev: RecordingDevice, direction: Direction) -> list[str]:
    return [str(op[0]) for op in dev.ops if len(op) > 1 and op[1] == direction]


def _save(worker: WorkerSide, block: int) -> None:
    job = TransferJob("w", "default", (BlockRef(CHUNK, (block,), BS),), capture=True)
    worker.queue_saves(KVPackConnectorMetadata(saves=[job]))
    assert worker.flush_before_exit(10, "test")


def _load(worker: WorkerSide, block: int) -> set[str]:
    job = TransferJob("r", "default", (BlockRef(CHUNK, (block,), BS, tiers=(("kv", "memory"),)),))
    worker.start_step(KVPackConnectorMetadata(loads=[job]), has_forward=True)
    return finished_load(worker, "r")


def test_a_save_gathers_after_the_forward_and_stores_rows_only_after_the_gather_event(tmp_path: Path) -> None:
    worker, cache = _worker(tmp_path)
    try:
        dev = RecordingDevice()
        worker.staging = Staging(dev)
        want = torch.randn(cache[3].shape)
        dev.queue_compute(lambda: cache[3].copy_(want))  # this step's forward, still on the compute stream
        _save(worker, 3)
        assert ("host_rows", 1, cache[3].numel() * 4) in dev.ops  # staging from the device (pinned on a GPU)
        ops = _ops(dev, Direction.SAVE)
        assert ops.index("wait_compute") < ops.index("launch") < ops.index("record") < ops.index("sync")
        assert ops.index("sync") < ops.index("run") < ops.index("release")
        assert dev.violations == [] and dev.unlaunched() == 0
        worker.staging = Staging(CpuDevice())
        assert _load(worker, 5) == set()
        assert torch.equal(cache[5], want)  # the stored bytes are the forward's, not the poison or zeros
    finally:
        worker.close()


def test_a_load_is_reported_done_only_after_its_scatter_event(tmp_path: Path) -> None:
    worker, cache = _worker(tmp_path)
    try:
        cache[3].copy_(torch.randn(cache[3].shape))
        _save(worker, 3)
        dev = RecordingDevice()
        worker.staging = Staging(dev)
        assert _load(worker, 5) == set()
        assert torch.equal(cache[5], cache[3])  # done means the scatter ran
        assert ("host_rows", 1, cache[3].numel() * 4) in dev.ops
        ops = _ops(dev, Direction.LOAD)
        assert ops.index("wait_compute") < ops.index("launch") < ops.index("record") < ops.index("sync")
        assert ops.index("run") < ops.index("release")
        assert dev.violations == [] and dev.unlaunched() == 0
    finally:
        worker.close()


def test_registration_picks_the_staging_device_of_the_cache(tmp_path: Path) -> None:
    worker, _ = _worker(tmp_path)
    try:
        assert worker.staging.device.kind == "cpu"  # zero-copy, inline: the CPU path as before
    finally:
        worker.close()
