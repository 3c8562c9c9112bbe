"""Helpers for offline `vllm.LLM` use.

kvpack saves a request's KV when it finishes; the copy runs in the engine's
next step (the blocks stay allocated until then). vLLM's engine-core process
(the default mode) keeps stepping on its own, but an in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) only steps inside ``generate``: call
`drain(llm)` before dropping such an engine so its last requests are stored.
"""

from __future__ import annotations

import time
from typing import Any


def drain(llm: Any, timeout_s: float = 30.0) -> bool:
    """Step an in-process engine until kvpack's pending saves ran, then flush the stores.

    Returns True when everything reached every tier within `timeout_s`.
    In multi-process mode the engine core drains by itself; the workers'
    stores are flushed through ``collective_rpc``.
    """
    from .connector import live_connectors

    deadline = time.monotonic() + timeout_s
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is not None and hasattr(core, "scheduler"):  # in-process
        while core.scheduler.has_requests() and time.monotonic() < deadline:
            _, executed = core.step_fn()
            core.post_step(model_executed=executed)
        ok = True
        for conn in live_connectors():
            if conn.worker is not None:
                ok &= conn.worker.flush(max(0.0, deadline - time.monotonic()))
        return ok and time.monotonic() < deadline
    results = llm.collective_rpc(_flush_worker, args=(max(0.0, deadline - time.monotonic()),))
    return all(bool(r) for r in results)


def _flush_worker(worker: Any, timeout_s: float) -> bool:  # runs inside each vLLM worker
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return True
    conn = get_kv_transfer_group()
    side = getattr(conn, "worker", None)
    return True if side is None else bool(side.flush(timeout_s))
