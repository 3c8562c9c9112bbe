"""The transfer runner's host-memory bounds behind the real `WorkerSide`: a save queued
beyond ``transfer.max_queued_save_bytes`` and a load beyond ``transfer.max_inflight_load_bytes``
are turned away and counted (the save is a future miss, the load is recomputed); the
caller never waits. The recording device holds the first transfer's copy so the second
finds the bound full."""

from __future__ import annotations

import pytest
import torch

from fixtures.recording_device import RecordingDevice
from kvpack.config.schema import KVPackConfig
from kvpack.transfers.staging import CpuDevice, Direction, Staging

pytest.importorskip("vllm")

from vllm_helpers import bare_worker, finished_load  # noqa: E402

from kvpack.vllm_plugin.metadata import BlockRef, KVPackConnectorMetadata, TransferJob  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16
BLOCKS = 140
"""8 KiB a block: 140 blocks are more than the 1 MiB bounds below."""


def test_saves_and_loads_past_their_byte_bounds_are_turned_away_and_counted() -> None:
    config = KVPackConfig.from_dict(
        {
            "memory": {"capacity": "64MiB"},
            "disk": {"enabled": False},
            "transfer": {"max_queued_save_bytes": "1MiB", "max_inflight_load_bytes": "1MiB"},
        }
    )
    worker = bare_worker(config, BS)
    cache = torch.randn((2 * BLOCKS + 2, 2, BS, 2 * 32))
    worker.register_kv_caches({"model.layers.0.attn": cache}, 2 * BLOCKS + 2)
    metrics = worker.session.store.metrics
    chunks = [f"{i:064x}" for i in range(BLOCKS)]
    try:
        dev = RecordingDevice()
        worker.staging = Staging(dev)
        dev.hold(Direction.SAVE)
        big = TransferJob("w", "default", tuple(BlockRef(c, (i,), BS) for i, c in enumerate(chunks)), capture=True)
        small = TransferJob("x", "default", (BlockRef("e" * 64, (BLOCKS,), BS),), capture=True)
        worker.queue_saves(KVPackConnectorMetadata(saves=[big, small]))  # returns: nothing waits for the bound
        assert metrics.value("transfers_turned_away", direction="save", bound="max_queued_save_bytes") == 1
        assert metrics.value("transfer_bytes_turned_away", direction="save") == cache[0].numel() * 4
        dev.unhold(Direction.SAVE)
        assert worker.flush_before_exit(10, "test")

        dev = RecordingDevice()
        worker.staging = Staging(dev)
        dev.hold(Direction.LOAD)
        refs = tuple(BlockRef(c, (BLOCKS + 1 + i,), BS, tiers=(("kv", "memory"),)) for i, c in enumerate(chunks))
        first = TransferJob("r1", "default", refs)
        second = TransferJob("r2", "default", (BlockRef(chunks[0], (2 * BLOCKS + 1,), BS),))
        worker.start_step(KVPackConnectorMetadata(loads=[first, second]), has_forward=True)
        assert finished_load(worker, "r2") == {"r2"}  # recomputed, reported at once
        assert worker.take_load_errors() == {2 * BLOCKS + 1}
        assert metrics.value("transfers_turned_away", direction="load", bound="max_inflight_load_bytes") == 1
        dev.unhold(Direction.LOAD)
        assert finished_load(worker, "r1") == set()
        assert torch.equal(cache[BLOCKS + 1 : 2 * BLOCKS + 1], cache[:BLOCKS])
        worker.staging = Staging(CpuDevice())
        assert metrics.value("pinned_bytes") == worker.runner.pool.pinned_bytes()
    finally:
        worker.close()
