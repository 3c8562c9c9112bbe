"""`kvpack bench tiers`: memory and disk tier throughput next to memcpy and raw file I/O.

For each object size, the same bytes are moved four ways in one run:
memory tier put/get vs `np.copyto` into a warm buffer (memcpy), and disk tier
put/get vs plain `write`+`rename` / `readinto` of the same bytes in the same
folder. Gets from disk are served by the page cache in both columns, so the
ratio isolates kvpack's own cost (header, checks, index, checksum).

The host columns run the same puts and gets on the host memory tier
(`kvpack.tiers.host.HostTier`: one store in ``/dev/shm`` shared by every
process) next to the per-process memory tier: the ratio of their hit paths is
what ``memory.mode: auto`` weighs for a single process. Host gets verify the
payload checksum (checksum=boundary: its objects cross processes); the
unverified column shows what that check costs.

The keyed columns repeat the disk put/get with an integrity key
(`kvpack.store.integrity`, as `KVStore` does with ``integrity_key`` set: a keyed
HMAC-SHA256 sealed into each header on put, checked on get instead of xxh3)
and give their ratio to the unkeyed disk path of the same run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvpack.config.schema import EvictionPolicyName
from kvpack.identity.keys import StoreKey
from kvpack.identity.layout_spec import KVLayoutSpec
from kvpack.identity.objects import Expectation, ObjectHeader, payload_checksum, payload_nbytes
from kvpack.policy.eviction import make_policy
from kvpack.store.integrity import IntegrityKey, check_loaded, seal_items
from kvpack.tiers.base import PutItem, Tier
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.disk.writes import ObjectWriter
from kvpack.tiers.host import HostTier
from kvpack.tiers.memory import MemoryTier

from .timing import best_seconds, gbps, hardware

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}


def _items(nbytes: int, count: int, checksum: bool) -> tuple[list[PutItem], list[Expectation], list[np.ndarray]]:
    spec = KVLayoutSpec("bench", "bench", "uint8", 16)
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(count)]
    items, exps = [], []
    for i, p in enumerate(payloads):
        chunk = f"{i:064x}"
        header = ObjectHeader(
            spec.member_fingerprint, "bench", chunk, "kv", 16, nbytes, payload_checksum(p) if checksum else None
        )
        items.append(PutItem(StoreKey("bench", spec.group_fingerprint, chunk, "kv"), header, p.data))
        exps.append(Expectation(spec.member_fingerprint, "bench", chunk, "kv", 16, nbytes))
    return items, exps, payloads


def _tier_rates(
    tier: Tier, items: list[PutItem], exps: list[Expectation], verify: bool, repeats: int
) -> tuple[float, float]:
    total = sum(payload_nbytes(i.payload) for i in items)
    dsts = [np.empty(payload_nbytes(i.payload), np.uint8) for i in items]
    keys = [i.key for i in items]
    views = [d.data for d in dsts]
    put_s = best_seconds(lambda: tier.put_from(items), repeats)
    results = tier.get_into(keys, views, exps, verify)
    assert all(r.ok for r in results), [r for r in results if not r.ok][:1]
    get_s = best_seconds(lambda: tier.get_into(keys, views, exps, verify), repeats)
    return gbps(total, put_s), gbps(total, get_s)


def _keyed_disk_rates(tier: Tier, items: list[PutItem], exps: list[Expectation], repeats: int) -> tuple[float, float]:
    """Disk put/get the way `KVStore` runs them with an integrity key: seal, put; get unverified, check the MAC."""
    key = IntegrityKey(bytes(range(32)))
    total = sum(payload_nbytes(i.payload) for i in items)
    dsts = [np.empty(payload_nbytes(i.payload), np.uint8).data for i in items]
    keys = [i.key for i in items]

    def get() -> None:
        got = check_loaded(key, dsts, tier.get_into(keys, dsts, exps, False), True, True)
        assert all(r.ok for r in got)

    put_s = best_seconds(lambda: tier.put_from(seal_items(key, items)), repeats)
    get()
    get_s = best_seconds(get, repeats)
    return gbps(total, put_s), gbps(total, get_s)


def _memcpy_rate(payloads: list[np.ndarray], repeats: int) -> float:
    dsts = [np.empty_like(p) for p in payloads]

    def run() -> None:
        for d, p in zip(dsts, payloads):
            np.copyto(d, p)

    return gbps(sum(p.nbytes for p in payloads), best_seconds(run, repeats))


def _raw_file_rates(folder: Path, payloads: list[np.ndarray], repeats: int) -> tuple[float, float]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"raw{i}" for i in range(len(payloads))]

    def write() -> None:
        for path, p in zip(paths, payloads):
            tmp = path.with_name(path.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, p.data)
            finally:
                os.close(fd)
            os.replace(tmp, path)

    dsts = [np.empty_like(p) for p in payloads]

    def read() -> None:
        for path, d in zip(paths, dsts):
            with open(path, "rb", buffering=0) as f:
                f.readinto(d.data)

    total = sum(p.nbytes for p in payloads)
    w = gbps(total, best_seconds(write, repeats))
    r = gbps(total, best_seconds(read, repeats))
    return w, r


def run(
    total_bytes: int, repeats: int, folder: Path, object_writer: Callable[[], ObjectWriter | None] | None = None
) -> list[dict[str, float | str]]:
    """`object_writer`: the disk and host tiers' native batch file write (None: they write from Python)."""
    rows: list[dict[str, float | str]] = []
    for label, size in SIZES.items():
        count = max(4, total_bytes // size)
        items, exps, payloads = _items(size, count, checksum=False)
        memcpy = _memcpy_rate(payloads, repeats)
        mem = MemoryTier(size * count * 2, make_policy(EvictionPolicyName.LRU), pin=False)
        mem_put, mem_get = _tier_rates(mem, items, exps, verify=False, repeats=repeats)
        raw_w, raw_r = _raw_file_rates(folder / f"raw-{label}", payloads, repeats)
        disk = DiskTier(folder / f"kv-{label}", size * count * 4, object_writer=object_writer)
        disk_put, disk_get = _tier_rates(disk, items, exps, verify=True, repeats=repeats)
        keyed = DiskTier(folder / f"kv-keyed-{label}", size * count * 4)
        keyed_put, keyed_get = _keyed_disk_rates(keyed, items, exps, repeats)
        host = HostTier(f"bench-{os.getpid()}-{label}", size * count * 4)
        try:
            host_put, host_get = _tier_rates(host, items, exps, verify=True, repeats=repeats)
            _, host_get_raw = _tier_rates(host, items, exps, verify=False, repeats=repeats)
        finally:
            host.close()
            shutil.rmtree(host.root, ignore_errors=True)
        rows.append(
            {
                "size": label,
                "memcpy": memcpy,
                "mem_put": mem_put,
                "mem_get": mem_get,
                "raw_write": raw_w,
                "raw_read": raw_r,
                "disk_put": disk_put,
                "disk_get": disk_get,
                "keyed_put": keyed_put,
                "keyed_get": keyed_get,
                "host_put": host_put,
                "host_get": host_get,
                "host_get_raw": host_get_raw,
            }
        )
    return rows


def format_keyed_table(rows: list[dict[str, float | str]]) -> str:
    lines = [
        "| size | disk put GB/s | keyed put GB/s (x unkeyed) | disk get GB/s (xxh3 verified) | keyed get GB/s (x "
        "unkeyed) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        f = {k: v for k, v in r.items() if isinstance(v, float)}
        lines.append(
            f"| {r['size']} | {f['disk_put']:.2f} | {f['keyed_put']:.2f} ({f['keyed_put'] / f['disk_put']:.2f}x) "
            f"| {f['disk_get']:.2f} | {f['keyed_get']:.2f} ({f['keyed_get'] / f['disk_get']:.2f}x) |"
        )
    return "\n".join(lines)


def format_host_table(rows: list[dict[str, float | str]]) -> str:
    lines = [
        "| size | memory put GB/s | host put GB/s (x memory) | memory get GB/s | host get GB/s, xxh3 verified "
        "(x memory) | host get GB/s, unverified (x memory) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = {k: v for k, v in r.items() if isinstance(v, float)}
        lines.append(
            f"| {r['size']} | {f['mem_put']:.2f} | {f['host_put']:.2f} ({f['host_put'] / f['mem_put']:.2f}x) "
            f"| {f['mem_get']:.2f} | {f['host_get']:.2f} ({f['host_get'] / f['mem_get']:.2f}x) "
            f"| {f['host_get_raw']:.2f} ({f['host_get_raw'] / f['mem_get']:.2f}x) |"
        )
    return "\n".join(lines)


def format_table(rows: list[dict[str, float | str]]) -> str:
    lines = [
        "| size | memcpy GB/s | memory put GB/s (x memcpy) | memory get GB/s (x memcpy) | raw write GB/s | disk "
        "put GB/s (x raw) | raw read GB/s | disk get GB/s (x raw) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = {k: v for k, v in r.items() if isinstance(v, float)}
        lines.append(
            f"| {r['size']} | {f['memcpy']:.2f} | {f['mem_put']:.2f} ({f['mem_put'] / f['memcpy']:.2f}x) "
            f"| {f['mem_get']:.2f} ({f['mem_get'] / f['memcpy']:.2f}x) | {f['raw_write']:.2f} "
            f"| {f['disk_put']:.2f} ({f['disk_put'] / f['raw_write']:.2f}x) | {f['raw_read']:.2f} "
            f"| {f['disk_get']:.2f} ({f['disk_get'] / f['raw_read']:.2f}x) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpack bench tiers", description=__doc__.splitlines()[0])
    parser.add_argument("--total", default="64MiB", help="bytes moved per measurement (default 64MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="folder for the disk measurements (default: a temp folder)")
    parser.add_argument(
        "--python-writes", action="store_true", help="disk and host files written from Python, not natively"
    )
    args = parser.parse_args(argv)
    from kvpack.config.sizes import parse_size
    from kvpack.ops import load_extension, object_writer

    native = not args.python_writes and load_extension().available

    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvpack-bench-"))
    try:
        rows = run(parse_size(args.total), args.repeats, folder, object_writer if native else None)
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"kvpack bench tiers on {hardware()}; disk folder on {folder.parent}")
    print("memory gets skip the payload checksum (checksum=boundary); disk gets verify it.")
    print(f"disk and host files written {'natively (one GIL release per batch)' if native else 'from Python'}.")
    print(format_table(rows))
    print()
    print("integrity key (HMAC-SHA256 over header and payload) vs the unkeyed disk path:")
    print(format_keyed_table(rows))
    print()
    print("host memory tier (/dev/shm, shared by every process) vs the per-process memory tier, one process:")
    print(format_host_table(rows))
    return 0
