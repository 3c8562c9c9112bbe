"""`kvpack bench evict`: a put into a full disk tier beside busy Python threads, native removal vs Python.

An engine's save thread shares its process with Python threads that rarely sleep (vLLM's and
SGLang's schedulers). Every system call made from Python gives the GIL up, and taking it back
can wait up to the interpreter's switch interval (5 ms) while such a thread runs. A put into a
full tier evicts as many groups as it stores; this bench times that put (the median of
`--puts` puts of `--objects` one-object groups, into a tier holding four times as many, so
the evicted objects' folders stay) in one run two ways, alternated put by put on two tiers:

- *Python*: the victims' files unlinked and their folders tried from Python, a read of the
  system's randomness per temporary name (kvpack before the native batch removal);
- *native*: `kvpack.ops.object_remover` (the batch in one call, the GIL released once) and
  one read of randomness per batch (kvpack now);

with 0 .. `--busy` busy threads, and prints their ratio. The native writer writes both.
Without the extension only the Python column is measured.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvpack.identity.keys import StoreKey
from kvpack.identity.layout_spec import KVLayoutSpec
from kvpack.identity.objects import ObjectHeader, payload_checksum
from kvpack.tiers.base import PutItem
from kvpack.tiers.disk import DiskTier, fs
from kvpack.tiers.disk.removes import ObjectRemover

from .timing import busy_python_threads, hardware

LEAVES = 4
"""Leaf folders the objects share (each keeps objects after an eviction, as in a large store)."""


def _items(first: int, count: int, nbytes: int) -> list[PutItem]:
    spec = KVLayoutSpec("bench", "bench", "uint8", 16)
    items = []
    for i in range(first, first + count):
        chunk = f"{i % LEAVES:02x}{i:062x}"
        payload = np.full(nbytes, i % 251, np.uint8)
        header = ObjectHeader(spec.member_fingerprint, "bench", chunk, "kv", 16, nbytes, payload_checksum(payload))
        items.append(PutItem(StoreKey("bench", spec.group_fingerprint, chunk, "kv"), header, payload.data))
    return items


@contextmanager
def _one_name_per_read(per_object: bool) -> Iterator[None]:
    """While `per_object`: each temporary name reads the system's randomness itself (as before)."""
    batch = fs.temp_names
    if per_object:
        fs.temp_names = lambda finals: [batch([f])[0] for f in finals]
    try:
        yield
    finally:
        fs.temp_names = batch


def run(objects: int, nbytes: int, puts: int, busy: int, folder: Path, native: bool) -> list[tuple[int, float, float]]:
    """Per busy-thread count 0..`busy`: (count, Python median ms, native median ms or nan)."""
    from kvpack.ops import object_remover, object_writer

    probe = DiskTier(folder / "probe", 1 << 30)
    probe.put_from(_items(0, 1, nbytes))
    charge = probe.usage().used_bytes
    probe.close()
    kinds: dict[str, Callable[[], ObjectRemover | None] | None] = {"python": None}
    if native:
        kinds["native"] = object_remover
    rows = []
    for threads in range(busy + 1):
        tiers = {
            kind: DiskTier(
                folder / f"{kind}-{threads}",
                4 * objects * charge,
                object_writer=object_writer,
                object_remover=remover,
            )
            for kind, remover in kinds.items()
        }
        for tier in tiers.values():
            for k in range(4):
                tier.put_from(_items(1_000_000 * (k + 1), objects, nbytes))
        times: dict[str, list[float]] = {kind: [] for kind in tiers}
        with busy_python_threads(threads):
            for r in range(puts):
                for kind, tier in tiers.items():
                    items = _items(10_000 * (r + 1), objects, nbytes)
                    with _one_name_per_read(kind == "python"):
                        start = time.perf_counter()
                        tier.put_from(items)
                        times[kind].append(time.perf_counter() - start)
        for tier in tiers.values():
            tier.close()
        py = statistics.median(times["python"]) * 1e3
        nat = statistics.median(times["native"]) * 1e3 if "native" in times else float("nan")
        rows.append((threads, py, nat))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpack bench evict", description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=64, help="objects per put, each evicting one (default 64)")
    parser.add_argument("--bytes", type=int, default=1024, help="bytes per object (default 1024)")
    parser.add_argument("--puts", type=int, default=8, help="puts timed per column (default 8)")
    parser.add_argument("--busy", type=int, default=2, help="busy Python threads, up to (default 2)")
    args = parser.parse_args(argv)
    from kvpack.ops import load_extension

    native = load_extension().available
    with tempfile.TemporaryDirectory(prefix="kvpack-bench-evict-") as d:
        rows = run(args.objects, args.bytes, args.puts, args.busy, Path(d), native)
    print(f"kvpack bench evict on {hardware()}: a put of {args.objects} objects that evicts as many, median ms")
    print("| busy Python threads | Python removal | native removal | native x Python |")
    print("|---|---|---|---|")
    for threads, py, nat in rows:
        print(f"| {threads} | {py:.1f} | {nat:.1f} | {nat / py:.2f}x |")
    return 0
