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


def drain(llm: Any, timeout_s: float = 30.0, settle_s: float = 1.0) -> bool:
    """Step an in-process engine until kvpack's pending saves ran, then flush the stores.

    Returns True when everything reached every tier within `timeout_s`. In
    multi-process mode the engine core steps (and saves) by itself and its
    workers cannot be asked without pickling a function into them, so this
    only waits `settle_s` (best effort); the workers flush their stores on
    shutdown.
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
    time.sleep(min(settle_s, timeout_s))
    return True


def shutdown(llm: Any) -> None:
    """Shut an offline engine down now (its engine core and workers), best effort.

    Lets a process run several engine lifetimes one after another (tests,
    benchmarks, the demo) without waiting for garbage collection."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # an engine that failed half-way: nothing left to stop
        pass
    gc.collect()
