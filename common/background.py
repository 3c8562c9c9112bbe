"""Helpers for kvpack's background threads (write-back, engine-side saves).

Background storage work must never slow the engine's own threads: on a
CPU-bound host (a CPU engine, or the host side of a GPU engine) a save that
competes for the same cores shows up as slower decode steps. So:

- the C++ copy kernel is serial (see csrc/block_copy_cpu.cpp): an OpenMP team
  started from a background thread stays behind and slows every later decode
  step until the engine restarts (benchmarks/RESULTS.md, "the kernel is now serial");
- saves and write-back run at a lower scheduling priority than the engine.
"""

from __future__ import annotations

import os
import threading

BACKGROUND_NICENESS = 10
"""How much lower (in nice steps) kvpack's background threads run than the engine."""


def lower_current_thread_priority(niceness: int = BACKGROUND_NICENESS) -> bool:
    """Raise the calling thread's nice value by `niceness` (Linux: per thread).

    Returns False where the platform has no per-thread priority; the thread
    then simply runs at the process's priority."""
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + niceness))
        return True
    except (AttributeError, OSError):
        return False
