"""Background threads run below the engine's priority."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from kvpack.background import lower_current_thread_priority


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux-only")
def test_lowering_affects_only_the_calling_thread() -> None:
    seen: dict[str, int] = {}

    def worker() -> None:
        assert lower_current_thread_priority(5)
        seen["worker"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["worker"] == min(19, before + 5)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
