"""`kvpack bench scale`: the disk tier at 10k-1M objects, with 1 and 3 processes on one folder.

For each N: writer processes fill a fresh store folder with N objects
of `--payload` bytes (put throughput, objects/s over all writers), then fresh
processes (as many as `--procs`, at once, like a TP group opening one store)
each time `KVStore.from_config` up to the answer of a first 64-key lookup,
and report:

- ``open_first_s``: from_config to the first answer (the slowest process);
- ``full_index_s``: how long the folder scan (reconcile of an indexed store, or
  the build of one without an index) took, in the process that ran it;
- ``rss_b_per_obj``: RSS growth of one process from before `from_config` to after
  the folder scan and 3,000 lookups, per object (fixed costs included);
  ``rss_scan_mb``: the same growth while the scan still runs (its transient
  buffers and the scanning thread's malloc arena); ``index_b_per_obj``: the index file (+ WAL) size per object (it is
  shared by the host's processes: page cache, counted once);
- ``hit_ms`` / ``miss_ms``: median `contains` of 64 stored / absent keys;
- ``get_obj_s``: `get_into` of batches of 64 stored objects, objects/s (one process).

The fill is real: `--writers` processes (default: as many as the case's
`--procs`) put N objects through `KVStore.store` (the tier's own write path:
temporary file, rename, index rows), each its own share of keys, with the
tier's default of no per-file fsync. ``--reuse`` writes each N once and opens
that same store with every `--procs` count (the later opens are reopens of an
indexed folder: ``full_index_s`` is then the reconcile of a complete index).
``--legacy`` also opens each store with its index deleted (a store written by
an older kvpack): first answer from the folder while one process builds it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvpack.config.schema import DiskTierConfig, KVPackConfig, MemoryTierConfig
from kvpack.identity.keys import StoreKey
from kvpack.identity.objects import Expectation, ObjectHeader, payload_checksum
from kvpack.store import KVStore
from kvpack.tiers.base import PutItem
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.disk.catalog import INDEX_NAME

FP_GROUP = "a" * 32
FP_MEMBER = "b" * 32
TENANT = "bench"
BATCH = 256


def _key(i: int) -> StoreKey:
    """Object i's key: a chunk hash like a real one (uniform hex, so the 256 ``cc`` folders fill evenly)."""
    return StoreKey(TENANT, FP_GROUP, hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).hexdigest(), "kv")


def _config(root: Path, capacity: int) -> KVPackConfig:
    return KVPackConfig(memory=MemoryTierConfig(enabled=False), disk=DiskTierConfig(path=str(root), capacity=capacity))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_part(root: str, lo: int, hi: int, payload: int) -> None:
    """Worker: put objects lo..hi-1 through one store (batches of `BATCH`)."""
    store = KVStore.from_config(_config(Path(root), 1 << 50), write_back=False)
    data = np.random.default_rng(lo).integers(0, 256, payload, dtype=np.uint8)
    checksum = payload_checksum(data.data)
    for start in range(lo, hi, BATCH):
        items = []
        for i in range(start, min(hi, start + BATCH)):
            k = _key(i)
            header = ObjectHeader(FP_MEMBER, TENANT, k.chunk, "kv", 16, payload, checksum)
            items.append(PutItem(k, header, data.data))
        store.store(items)
    store.close()


def open_and_probe(root: str, n: int, payload: int, measure: bool, gets: bool = True) -> dict[str, float]:
    """Worker: open the store, answer a first lookup, then (if `measure`) time lookups and gets."""
    rss0 = _rss()
    t0 = time.perf_counter()
    store = KVStore.from_config(_config(Path(root), 1 << 50), write_back=False)
    rng = np.random.default_rng(os.getpid())
    hits = [_key(int(i)) for i in rng.integers(0, n, 64)]
    first = store.contains(hits)
    out: dict[str, float] = {"open_first_s": time.perf_counter() - t0, "first_hits": sum(first)}
    tier = next(t for t in store.tiers if isinstance(t, DiskTier))
    if measure:
        misses = [_key(n + int(i)) for i in rng.integers(0, n, 64)]
        for name, keys in (("hit_ms", hits), ("miss_ms", misses)):
            times = []
            for _ in range(1000):
                s = time.perf_counter()
                store.contains(keys)
                times.append(time.perf_counter() - s)
            out[name] = statistics.median(times) * 1e3
        dsts = [np.empty(payload, np.uint8).data for _ in range(64)]
        got, s = 0, time.perf_counter()
        while gets and time.perf_counter() - s < 2.0:
            keys = [_key(int(i)) for i in rng.integers(0, n, 64)]
            exps = [Expectation(FP_MEMBER, TENANT, k.chunk, "kv", 16, payload) for k in keys]
            got += sum(r.ok for r in tier.get_into(keys, dsts, exps, True))
        if gets:
            out["get_obj_s"] = got / (time.perf_counter() - s)
        out["rss_scan_mb"] = (_rss() - rss0) / 1e6
    if tier.wait_indexed(3600.0) and tier.scan_seconds is not None:
        out["full_index_s"] = tier.scan_seconds
    if measure:
        for _ in range(1000):
            store.contains(hits)
        out["rss_b_per_obj"] = (_rss() - rss0) / n
    out["objects"] = tier.usage().objects
    store.close()
    return out


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvpack.tools.bench.scale_bench", "--worker", *args], stdout=subprocess.PIPE, text=True
    )


def fill(root: Path, n: int, writers: int, payload: int) -> float:
    """Fresh store of N objects written by `writers` processes at once; returns put objects/s (all writers)."""
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    bounds = [(n * p // writers, n * (p + 1) // writers) for p in range(writers)]
    procs = [_spawn(["write", str(root), str(lo), str(hi), str(payload)]) for lo, hi in bounds]
    if any(w.wait() != 0 for w in procs):
        raise RuntimeError("a writer failed")
    rate = n / (time.perf_counter() - t0)
    os.system("sync")  # noqa: S605 - the open below should not race the writeback of the fill
    return rate


def _run_case(root: Path, n: int, procs: int, payload: int, legacy: bool, writers: int) -> dict[str, float]:
    """One row: fill (unless `writers` is 0: the store is there already, or `legacy`), then open with `procs`."""
    row: dict[str, float] = {"n": n, "procs": procs}
    if legacy:
        for p in root.iterdir():
            if p.name.startswith(INDEX_NAME):
                p.unlink()
    elif writers:
        row["writers"] = writers
        row["put_obj_s"] = fill(root, n, writers, payload)
    probes = [_spawn(["open", str(root), str(n), str(payload), str(int(p == 0)), "1"]) for p in range(procs)]
    results = [json.loads(p.communicate()[0]) for p in probes]
    row["open_first_s"] = max(r["open_first_s"] for r in results)
    row["first_hits_min"] = min(r["first_hits"] for r in results)
    for r in results:
        row.update({k: v for k, v in r.items() if k not in ("open_first_s", "first_hits")})
    index = sum(p.stat().st_size for p in root.iterdir() if p.name.startswith(INDEX_NAME))
    row["index_b_per_obj"] = index / n
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        kind, rest = argv[1], argv[2:]
        if kind == "write":
            write_part(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
            return 0
        print(json.dumps(open_and_probe(rest[0], int(rest[1]), int(rest[2]), rest[3] == "1", rest[4] == "1")))
        return 0
    parser = argparse.ArgumentParser(prog="kvpack bench scale", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--payload", type=int, default=256, help="bytes per object (files are 4 KiB + this)")
    parser.add_argument("--dir", default=None, help="folder for the stores (default: a temporary one)")
    parser.add_argument("--legacy", action="store_true", help="also open each store with its index deleted")
    parser.add_argument("--writers", type=int, default=0, help="writer processes of the fill (default: --procs)")
    parser.add_argument(
        "--reuse", action="store_true", help="write each N once and open it with every --procs count (reopens)"
    )
    args = parser.parse_args(argv)
    base = Path(args.dir or tempfile.mkdtemp(prefix="kvpack-scale-"))
    try:
        for n in args.n:
            for k, procs in enumerate(args.procs):
                root = base / (f"n{n}" if args.reuse else f"n{n}-p{procs}")
                writers = 0 if args.reuse and k else (args.writers or procs)
                print(json.dumps(_run_case(root, n, procs, args.payload, False, writers)), flush=True)
                if args.legacy:
                    print(json.dumps({"legacy": 1, **_run_case(root, n, procs, args.payload, True, 0)}), flush=True)
                if not args.reuse:
                    shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(base / f"n{n}", ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
