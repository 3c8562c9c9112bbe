"""Helpers for the benchmarks, the demo and the tests that drive offline `vllm.LLM` engines.

Users need none of this: kvpack saves every block in the step that computes
it and flushes its stores before the process exits (`kvpack.exit_flush`), so
a script that calls ``generate()`` and ends leaves its KV on disk. `drain`
exists for tests that need a deterministic point *inside* one process (for
example, "everything of run 1 is on every tier" before run 2 starts in the
same process); `shutdown` lets one process run several engine lifetimes.
"""

from __future__ import annotations

import time
from typing import Any


def drain(llm: Any, timeout_s: float = 30.0, settle_s: float = 1.0) -> bool:
    """Step an in-process engine until kvpack's pending saves ran, then flush the stores
    (a test's deterministic point; users never need it).

    Returns True when everything reached every tier within `timeout_s`. In
    multi-process mode the engine core steps (and saves) by itself and its
    workers cannot be asked without pickling a function into them, so this
    only waits `settle_s` (best effort); the workers flush their stores on
    shutdown.
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    deadline = time.monotonic() + timeout_s
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is not None and hasattr(core, "scheduler"):  # in-process
        while core.scheduler.has_requests() and time.monotonic() < deadline:
            _, executed = core.step_fn()
            core.post_step(model_executed=executed)
        # the in-process worker's connector is vLLM's process-wide one
        worker = getattr(get_kv_transfer_group(), "worker", None) if has_kv_transfer_group() else None
        ok = worker is None or worker.flush_before_exit(max(0.0, deadline - time.monotonic()), "drain")
        return ok and time.monotonic() < deadline
    time.sleep(min(settle_s, timeout_s))
    return True


def shutdown(llm: Any) -> None:
    """Shut an offline engine down now (its engine core and workers), best effort.

    Lets a process run several engine lifetimes one after another (tests,
    benchmarks, the demo) without waiting for garbage collection: vLLM's own
    shutdown collects the heap (twice) once the engine's parts are released, so
    no collection of our own follows it (each is a walk of every object vLLM,
    torch and transformers hold: about as long as a short prefill)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # an engine that failed half-way: nothing left to stop
        pass
