"""The worker side's own bounds, with the real `WorkerSide` over a real disk store (no engine).

Regression (found by the serving benchmark): a load that outlived ``io_timeout_ms`` made
`get_finished` count the timeout while holding its non-reentrant lock, so the worker's
main thread and its load and save threads all blocked for good and the server hung
("No available shared memory broadcast block found"). Now the load is cancelled and
reported failed (vLLM recomputes), and the call returns.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from kvpack.config.schema import KVPackConfig
from kvpack.store import KVStore
from kvpack.tiers.factory import build_tiers

pytest.importorskip("vllm")

from vllm_helpers import bare_worker  # noqa: E402

from fixtures.tiers import SlowTier  # noqa: E402
from kvpack.vllm_plugin.metadata import BlockRef, KVPackConnectorMetadata, TransferJob  # noqa: E402
from kvpack.vllm_plugin.worker import WorkerSide  # noqa: E402

BS = 16


def _worker(tmp_path: Path, get_delay_s: float) -> WorkerSide:
    config = KVPackConfig.from_dict(
        {"memory": {"enabled": False}, "disk": {"path": str(tmp_path / "kv")}, "io_timeout_ms": 50}
    )
    store = KVStore(config, [SlowTier(build_tiers(config)[0], 0.0, get_delay_s=get_delay_s)])
    worker = bare_worker(config, BS, store=store)
    worker.register_kv_caches({"model.layers.0.attn": torch.zeros((8, 2, BS, 2 * 32))}, 8)
    return worker


def test_a_load_that_outlives_io_timeout_ms_is_cancelled_without_deadlock(tmp_path: Path) -> None:
    worker = _worker(tmp_path, get_delay_s=1.0)
    try:
        job = TransferJob("r1", "default", (BlockRef("a" * 64, (3,), BS),))
        worker.start_step(KVPackConnectorMetadata(loads=[job]), has_forward=True)
        time.sleep(0.2)  # the adverse condition: the load is now past io_timeout_ms (50 ms)
        result: list[tuple[set[str], set[str], set[str]]] = []
        caller = threading.Thread(target=lambda: result.append(worker.get_finished()), daemon=True)
        caller.start()
        caller.join(5.0)
        assert not caller.is_alive(), "get_finished deadlocked"
        _, recving, failed = result[0]
        assert recving == {"r1"} and failed == {"r1"}  # done, and failed: vLLM recomputes
        assert worker.take_load_errors() == {3}
        assert worker.take_stats().get("load_timeouts") == 1
    finally:
        worker.close()
