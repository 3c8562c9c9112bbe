"""Durable before exit: a store kvpack accepted reaches disk before its process ends.

Each case is a real child process that stores objects through `KVStore`
(memory tier + disk tier with write-back) and then ends the way a user's
process ends: the script returns, it gets SIGTERM, it gets SIGINT. It calls
no kvpack helper (no flush, no close). A new process then reads the folder:
every object the store accepted must be there. The objects are large enough
that the write-back queue still holds most of them when the child ends, so
without the exit flush the check fails (the negative control below shows it:
with the bound cut to a millisecond objects are lost, counted and logged).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from fixtures.warm_start import KVPACK_MODULES, warm_starts
from kvpack.config.schema import KVPackConfig
from kvpack.identity.keys import StoreKey
from kvpack.identity.objects import Expectation
from kvpack.store import KVStore, LoadItem
from kvpack.tiers.host import drop

N_OBJECTS = 48
OBJECT_BYTES = 1 << 20
FP = "f" * 32

CHILD = (
    textwrap.dedent(
        """
    import os, signal, sys, time
    import numpy as np
    from kvpack.config.schema import KVPackConfig
    from kvpack.identity.keys import StoreKey
    from kvpack.identity.objects import ObjectHeader
    from kvpack.store import KVStore
    from kvpack.tiers.base import PutItem

    path, how, bound, host = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    memory = {"mode": "host", "host_name": host, "capacity": "64MiB"} if host else {}
    config = KVPackConfig.from_dict({"disk": {"path": path}, "memory": memory, "shutdown_flush_s": bound, "io_threads": 1})
    store = KVStore.from_config(config)
    items = []
    for i in range(N_OBJECTS):
        payload = np.full(OBJECT_BYTES, i % 251, dtype=np.uint8)
        header = ObjectHeader(fingerprint=FP, tenant="default", chunk=f"c{i:04d}", member="kv",
                              token_count=16, payload_len=payload.nbytes, checksum=None)
        items.append(PutItem(StoreKey("default", FP, f"c{i:04d}", "kv"), header, memoryview(payload)))
    statuses = store.store(items)
    print("ACCEPTED", sum(s.name == "OK" for s in statuses), flush=True)
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    elif how == "sigint":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    # "exit": the script simply ends
    """
    )
    .replace("N_OBJECTS", str(N_OBJECTS))
    .replace("OBJECT_BYTES", str(OBJECT_BYTES))
    .replace("FP", repr(FP))
)


def _child(path: Path, how: str, bound_s: float, host: str = "") -> subprocess.CompletedProcess[str]:
    """The child stores through the per-process memory tier, or through host store `host` (forked
    from a process that imported torch; its output unbuffered, as a signal ends it)."""
    argv = ["-c", CHILD, str(path), how, str(bound_s), host]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = path.parent / f"child-{how}-{uuid.uuid4().hex[:8]}.log"
    return warm_starts().run_script(sys.executable, argv, env, log, 120, modules=KVPACK_MODULES)


def _on_disk(path: Path) -> int:
    """Objects a new store over `path` loads intact."""
    config = KVPackConfig.from_dict({"memory": {"enabled": False}, "disk": {"path": str(path)}, "checksum": "always"})
    store = KVStore.from_config(config)
    try:
        items = []
        for i in range(N_OBJECTS):
            dst = memoryview(bytearray(OBJECT_BYTES))
            exp = Expectation(
                fingerprint=FP,
                tenant="default",
                chunk=f"c{i:04d}",
                member="kv",
                token_count=16,
                payload_len=OBJECT_BYTES,
            )
            items.append(LoadItem(StoreKey("default", FP, f"c{i:04d}", "kv"), dst, exp))
        return sum(r.ok for r in store.load(items))
    finally:
        store.close()


@pytest.mark.parametrize(("how", "returncode"), [("exit", 0), ("sigterm", -signal.SIGTERM), ("sigint", -signal.SIGINT)])
def test_accepted_stores_are_on_disk_after_the_process_ends(tmp_path: Path, how: str, returncode: int) -> None:
    proc = _child(tmp_path / "kv", how, bound_s=60.0)
    assert f"ACCEPTED {N_OBJECTS}" in proc.stdout, proc.stderr[-2000:]
    assert proc.returncode == returncode, proc.stderr[-2000:]  # the signal still ends the process as before
    if how == "sigint":
        assert "KeyboardInterrupt" in proc.stderr  # Python's own SIGINT handler ran: not swallowed
    assert _on_disk(tmp_path / "kv") == N_OBJECTS


def test_a_script_storing_through_the_host_store_leaves_every_accepted_store_on_disk(tmp_path: Path) -> None:
    """With the host store in front the disk is written behind it too (`KVStore.store`), so
    the exit flush covers it: the script simply ends, every object it stored is on disk."""
    name = f"exitflush-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        proc = _child(tmp_path / "kv", "exit", bound_s=60.0, host=name)
        assert f"ACCEPTED {N_OBJECTS}" in proc.stdout, proc.stderr[-2000:]
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert _on_disk(tmp_path / "kv") == N_OBJECTS
    finally:
        drop(name)


def test_the_bound_drops_what_it_cannot_write_and_says_so(tmp_path: Path) -> None:
    """Negative control: with a 1 ms bound most of the queue is lost, and the log says how much."""
    proc = _child(tmp_path / "kv", "exit", bound_s=0.001)
    assert f"ACCEPTED {N_OBJECTS}" in proc.stdout, proc.stderr[-2000:]
    assert "had not reached ['disk'] after shutdown_flush_s" in proc.stderr
    assert _on_disk(tmp_path / "kv") < N_OBJECTS
