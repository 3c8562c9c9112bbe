"""A kvpack process on a host store, run by tests/common/test_host_tier.py (a process of its own).

    python host_child.py store NAME CAPACITY FIRST COUNT PAGE   # saves pages FIRST.., prints STORED ok
    python host_child.py load NAME CAPACITY FIRST COUNT PAGE    # prints LOADED hits wrong misses
    python host_child.py loop NAME CAPACITY FIRST 0 PAGE        # saves pages FIRST, FIRST+1, ... until killed
    python host_child.py budget NAME CAPACITY FIRST COUNT PAGE  # store, then GROWTH <bytes> and waits for stdin
    python host_child.py cycle NAME CAPACITY FIRST COUNT PAGE   # saves pages FIRST..FIRST+COUNT over and over
    python host_child.py watch NAME CAPACITY FIRST COUNT PAGE   # loads them over and over; READ hits wrong misses refused

Every process uses `kvpack.Session` with ``memory.mode: host`` (disk off). A page's bytes
follow from its number (`page_bytes`), so any process can tell a right load from a wrong one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fixtures.builders import GROUP_FP, MEMBER_FP, TOKENS, chunk_id  # noqa: E402
from kvpack import KVPackConfig, MemberObject, Session  # noqa: E402
from kvpack.tiers.base import TierStatus  # noqa: E402


def page_bytes(i: int, page: int) -> np.ndarray:
    """Page `i`'s bytes (the same in every process)."""
    return np.random.default_rng(i).integers(0, 256, page, dtype=np.uint8)


def config(name: str, capacity: int) -> KVPackConfig:
    return KVPackConfig.from_dict(
        {"memory": {"mode": "host", "host_name": name, "capacity": capacity}, "disk": {"enabled": False}}
    )


def vm_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def store(session: Session, first: int, count: int, page: int, batch: int = 8) -> int:
    obj = MemberObject("kv", MEMBER_FP, TOKENS, page)
    ok = 0
    for lo in range(first, first + count, batch):
        idx = list(range(lo, min(lo + batch, first + count)))
        data = {i: page_bytes(i, page) for i in idx}
        done = session.save_pages("t", obj, [chunk_id(i) for i in idx], lambda todo: [data[idx[j]].data for j in todo])
        ok += sum(done)
    return ok


def load(session: Session, first: int, count: int, page: int) -> tuple[int, int, int]:
    from kvpack import ChunkFacts, ObjectIO

    obj = MemberObject("kv", MEMBER_FP, TOKENS, page)
    bufs = [np.zeros(page, np.uint8) for _ in range(count)]
    items = session.reads(
        "t", [ObjectIO(ChunkFacts(chunk_id(first + k), TOKENS), obj, bufs[k].data) for k in range(count)]
    )
    hits = wrong = misses = 0
    for k, r in enumerate(session.complete_load(session.prepare_load(items)).results):
        if r.status is TierStatus.OK:
            hits += 1
            wrong += int(not np.array_equal(bufs[k], page_bytes(first + k, page)))
        else:
            misses += 1
    return hits, wrong, misses


def main(mode: str, name: str, capacity: int, first: int, count: int, page: int) -> None:
    session = Session.start(config(name, capacity), GROUP_FP)
    if mode == "store":
        print("STORED", store(session, first, count, page), flush=True)
    elif mode == "load":
        print("LOADED", *load(session, first, count, page), flush=True)
    elif mode == "loop":
        print("STARTED", flush=True)
        i = first
        while True:
            store(session, i, 8, page)
            i += 8
    elif mode in ("cycle", "watch"):  # until stdin closes (a thread waits for it)
        import threading

        done = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
        print("STARTED", flush=True)
        totals = [0, 0, 0]
        while not done.is_set():
            if mode == "cycle":
                store(session, first, count, page)
            else:
                totals = [a + b for a, b in zip(totals, load(session, first, count, page))]
        if mode == "watch":
            refused = session.store.metrics.snapshot().get("rejected_objects", {})
            print("READ", *totals, int(sum(refused.values())), flush=True)
            if refused:
                print(refused, file=sys.stderr)
    elif mode == "budget":
        store(session, first, 16, page)  # warm: every code path and buffer of a store once
        base = vm_kib("VmRSS")
        store(session, first + 16, count, page)
        print("GROWTH", max(0, vm_kib("VmHWM") - base) * 1024, flush=True)
        sys.stdin.readline()  # the parent measures the shared memory while every writer lives
    session.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
