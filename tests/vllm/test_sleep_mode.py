"""vLLM 0.33's sleep mode: between ``unregister_kv_caches`` (called by the GPU worker's
``sleep`` before it releases the KV cache's memory) and ``restore_kv_caches`` (after
``wake_up`` mapped it again) kvpack neither reads nor writes the cache.

Driven the way vLLM 0.33 calls the hooks (on the connector, by those names), over the real
`WorkerSide` and its `kvpack.TransferRunner`, with the recording device standing in for the
GPU's side streams (its copies run only when their event is waited on): a copy launched
before the sleep is waited for before the release returns; loads and saves asked for while
the cache is released never touch it (loads fail, so vLLM recomputes them; saves are a
counted future miss); after the restore both run again.
"""

from __future__ import annotations

import threading

import pytest
import torch

from fixtures.recording_device import RecordingDevice
from kvpack.config.schema import KVPackConfig
from kvpack.transfers.staging import CpuDevice, Direction, Staging

pytest.importorskip("vllm")

from vllm_helpers import bare_worker, finished_load  # noqa: E402

from kvpack.vllm_plugin.connector import KVPackConnector  # noqa: E402
from kvpack.vllm_plugin.metadata import BlockRef, KVPackConnectorMetadata, TransferJob  # noqa: E402
from kvpack.vllm_plugin.worker import WorkerSide  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 16
CHUNK = "e" * 64


class _Connector(KVPackConnector):
    """The real connector's hooks over a worker built without an engine around it."""

    def __init__(self, worker: WorkerSide) -> None:  # noqa: D107 - no vLLM config here
        self.worker = worker
        self.scheduler = None


def _worker() -> tuple[WorkerSide, torch.Tensor]:
    config = KVPackConfig.from_dict(
        {"memory": {"capacity": "16MiB"}, "disk": {"enabled": False}, "io_timeout_ms": 2000}
    )
    worker = bare_worker(config, BS)
    cache = torch.randn((8, 2, BS, 2 * 32))
    worker.register_kv_caches({"model.layers.0.attn": cache}, 8)
    return worker, cache


def _save(worker: WorkerSide, block: int, chunk: str = CHUNK) -> None:
    job = TransferJob("w", "default", (BlockRef(chunk, (block,), BS),), capture=True)
    worker.queue_saves(KVPackConnectorMetadata(saves=[job]))


def _load(worker: WorkerSide, block: int, req: str = "r") -> None:
    job = TransferJob(req, "default", (BlockRef(CHUNK, (block,), BS, tiers=(("kv", "memory"),)),))
    worker.start_step(KVPackConnectorMetadata(loads=[job]), has_forward=True)


def _released_in_background(connector: _Connector) -> threading.Thread:
    thread = threading.Thread(target=connector.unregister_kv_caches, daemon=True)
    thread.start()
    return thread


def test_the_connector_says_it_follows_sleep_mode() -> None:
    assert KVPackConnector.supports_sleep_mode(object()) is True


def test_nothing_touches_the_cache_between_unregister_and_restore() -> None:
    worker, cache = _worker()
    connector = _Connector(worker)
    try:
        _save(worker, 3)
        assert worker.flush_before_exit(10, "test")
        connector.unregister_kv_caches()
        connector.unregister_kv_caches()  # idempotent, as vLLM may call it from sleep and discard
        before = cache.clone()
        _load(worker, 5, "asleep")
        assert finished_load(worker, "asleep") == {"asleep"}  # failed: vLLM recomputes it after wake-up
        assert worker.take_load_errors() == {5}
        _save(worker, 6, "f" * 64)
        assert worker.flush_before_exit(10, "test")
        assert torch.equal(cache, before)  # neither the load nor the save touched the released cache
        stats = worker.take_stats()
        assert stats.get("transfers_skipped_cache_released", 0) == 2
        connector.restore_kv_caches()
        _load(worker, 5, "awake")
        assert finished_load(worker, "awake") == set()
        assert torch.equal(cache[5], cache[3])
    finally:
        worker.close()


def test_a_load_copy_launched_before_the_sleep_ends_before_unregister_returns() -> None:
    worker, cache = _worker()
    connector = _Connector(worker)
    try:
        _save(worker, 3)
        assert worker.flush_before_exit(10, "test")
        dev = RecordingDevice()
        worker.staging = Staging(dev)
        dev.hold(Direction.LOAD)  # the copy into the cache is still running when vLLM sleeps
        _load(worker, 5)
        dev.wait_op(("launch", Direction.LOAD))
        releasing = _released_in_background(connector)
        releasing.join(0.3)
        assert releasing.is_alive()  # the release waits for the copy into the cache
        assert not torch.equal(cache[5], cache[3])
        dev.unhold(Direction.LOAD)
        releasing.join(10)
        assert not releasing.is_alive()
        assert torch.equal(cache[5], cache[3])  # the copy landed before the memory was released
        assert finished_load(worker, "r") == set()
        assert dev.violations == []
    finally:
        worker.staging = Staging(CpuDevice())
        worker.close()


def test_a_save_gathered_before_the_sleep_is_read_out_before_unregister_returns_and_then_stored() -> None:
    worker, cache = _worker()
    connector = _Connector(worker)
    try:
        dev = RecordingDevice()
        worker.staging = Staging(dev)
        want = cache[3].clone()
        dev.hold(Direction.SAVE)  # the gather out of the cache has not run yet when vLLM sleeps
        _save(worker, 3)
        releasing = _released_in_background(connector)
        releasing.join(0.3)
        assert releasing.is_alive()  # the release waits for the gather out of the cache
        dev.unhold(Direction.SAVE)
        releasing.join(10)
        assert not releasing.is_alive()
        cache[3].fill_(9.0)  # what the released memory holds after the sleep is not read any more
        assert worker.flush_before_exit(10, "test")
        worker.staging = Staging(CpuDevice())
        connector.restore_kv_caches()
        _load(worker, 5)
        assert finished_load(worker, "r") == set()
        assert torch.equal(cache[5], want)  # stored: the bytes the gather read before the sleep
        assert dev.violations == []
    finally:
        worker.staging = Staging(CpuDevice())
        worker.close()
