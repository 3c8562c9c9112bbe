"""`kvpack bench sglang`: HiCache L3 throughput through real SGLang host pools, kvpack vs SGLang's `file` backend.

One run, same pages, same machine:

- kvpack (``KVPackStorage``) through SGLang's zero-copy path (the controller's
  ``_page_set_zero_copy`` / ``_page_get_zero_copy`` -> ``batch_set_v1`` /
  ``batch_get_v1``), on the memory tier and on the disk tier;
- SGLang's built-in ``file`` backend (``HiCacheFile``) through the path SGLang
  takes for it, the generic one (``_generic_page_set`` / ``_generic_page_get``:
  it has no v1 methods), in a folder on the same file system; its calls and
  those of kvpack's disk tier alternate (kvpack set, file set, kvpack set...,
  then the gets likewise), so neither runs while the file system is quieter
  (on an ext4 mount with online discard, file creation stalls for a while
  after many deletions, e.g. the previous run's clean-up);
- a single-thread ``memcpy`` of the same bytes between two warm buffers,
  timed right before every kvpack memory-tier call: each memory row is the
  best kvpack call against the best memcpy of the same repeats (paired
  samples, the same count on both sides), so a load change during the run
  moves both. This is the target's reference and the strictest one: one
  large copy streams, while a host pool's pages are separate regions
  (K and V of each page, per layer on ``layer_first``);
- for reading, the same single thread copying exactly the regions kvpack
  must copy (each page's regions of the host pool <-> one contiguous buffer,
  one ``memmove`` per region), also paired: the floor of any backend's copy
  work for these pages, printed next to the strict ratio, never instead.

Set times include reaching the tier: kvpack's disk set is timed up to
``flush()`` (every file written), like the file backend's synchronous writes.
Gets are timed from the page cache and, with ``--cold`` (default), after
``posix_fadvise(DONTNEED)`` dropped both backends' files from it (real disk
reads). GB/s counts page bytes once. Prints ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvpack.tools.bench.sglang_multiturn import KVPACK_BACKEND
from kvpack.tools.bench.sglang_pools import (
    DTYPES,
    BenchOp,
    controller,
    host_pool,
    page_keys,
    storage_config,
    torchvision_shim,
)
from kvpack.tools.bench.timing import Row, gbps, hardware


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvpack bench sglang", description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=["layer_first", "page_first", "page_first_direct"], default="page_first")
    p.add_argument("--kind", choices=["mha", "mla"], default="mha")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--page-tokens", type=int, default=64)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--pages", type=int, default=256, help="pages per call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--io-threads", type=int, default=2, help="kvpack io_threads (copy/IO threads per call)")
    p.add_argument(
        "--engine-device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="the device the host pool says SGLang computes on: cuda converts pages as on a GPU server "
        "(io_threads threads), cpu as on a CPU one (one thread)",
    )
    p.add_argument("--dir", default="", help="folder for both backends' files (default: a temp folder under $TMPDIR)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold (dropped page cache) gets")
    p.add_argument("--markdown", default="", help="append a markdown section with the results to this file")
    return p.parse_args(argv)


@dataclass
class _Entry:
    """One backend under test: SGLang's zero-copy path (v1) or its generic one."""

    label: str
    backend: Any
    zero_copy: bool
    flush: Callable[[], object] | None
    folder: Path | None
    paired_memcpy: bool = False


def _drop_cache(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _memcpy_timer(nbytes: int) -> Callable[[], float]:
    """Seconds for one single-thread memcpy of `nbytes` between two warm buffers."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst.fill(1)

    def once() -> float:
        return _timed(lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes))

    return once


def _threaded_copy_seconds(nbytes: int, threads: int, samples: int) -> float:
    """Best seconds of a `threads`-thread copy of `nbytes` between two warm buffers (torch's
    ``copy_`` on its intra-op threads, set for these samples only): the reference for a
    conversion that runs on that many threads."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.ones_like(src)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dst.copy_(src)
        return min(_timed(lambda: dst.copy_(src)) for _ in range(samples))
    finally:
        torch.set_num_threads(before)


def _region_memcpy_timers(
    pool: Any, indices: torch.Tensor, nbytes: int
) -> tuple[Callable[[], float], Callable[[], float]]:
    """(store, load): seconds for one thread to copy every region of the pages at
    `indices` into one contiguous buffer, and back, one ``memmove`` per region."""
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(1)
    base, memmove = buf.ctypes.data, ctypes.memmove
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    regions = list(zip([int(p) for p in ptrs], [int(x) for x in sizes], offsets))

    def store(keep: np.ndarray = buf) -> None:  # `keep`: the buffer lives as long as the timer
        for ptr, size, off in regions:
            memmove(base + off, ptr, size)

    def load(keep: np.ndarray = buf) -> None:
        for ptr, size, off in regions:
            memmove(ptr, base + off, size)

    return (lambda: _timed(store)), (lambda: _timed(load))


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if "--multiturn" in given:  # the multi-turn comparison on real CPU servers (its own options)
        from kvpack.tools.bench import sglang_multiturn

        return sglang_multiturn.main([a for a in given if a != "--multiturn"], before_model=torchvision_shim)
    if "--handoff" in given:  # a CPU SGLang server's first request for prompts a vLLM server computed
        from kvpack.tools.bench import sglang_handoff

        return sglang_handoff.main([a for a in given if a != "--handoff"], before_model=torchvision_shim)
    if "--busy-python" in given:  # the calls while another thread of the process runs Python
        from kvpack.tools.bench import sglang_gil

        return sglang_gil.main([a for a in given if a != "--busy-python"])
    args = _parse(given)
    torchvision_shim()
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    pool = host_pool(args)
    n, ps = args.pages, pool.page_size
    src = pool.alloc(n * ps)
    dst = pool.alloc(n * ps)
    page = int(sum(pool.get_page_buffer_meta(torch.arange(ps))[1]))
    nbytes = n * page
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvpack-sglang-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"# kvpack bench sglang: {hardware()}, torch {torch.__version__}")
    print(
        f"# {args.kind} {args.layout} {args.dtype}: {args.layers} layers x {args.heads} heads x {args.head_dim} "
        f"x {ps} tokens = {page / 1024:.0f} KiB/page, {n} pages ({nbytes / 2**20:.0f} MiB) per call, "
        f"{args.repeats} repeats (best), files in {root}"
    )

    # memcpy reference: one thread, warm buffers, same bytes; sampled before each memory-tier call
    memcpy_once = _memcpy_timer(nbytes)
    memcpy_once()
    memcpy_best: dict[str, float] = {}
    region_store, region_load = _region_memcpy_timers(pool, src, nbytes)
    _, region_load_dst = _region_memcpy_timers(pool, dst, nbytes)
    region_store(), region_load_dst()
    region_best: dict[str, float] = {}

    set_zero_copy = HiCacheController._page_set_zero_copy
    get_zero_copy = HiCacheController._page_get_zero_copy
    set_generic = HiCacheController._generic_page_set
    get_generic = HiCacheController._generic_page_get

    def kvpack_backend(tier: str) -> Any:
        extra = dict(KVPACK_BACKEND, io_threads=args.io_threads)
        if tier == "memory":
            # Two calls' worth: from the third call on, stores recycle evicted slots
            # (the steady state of a full cache) instead of faulting in fresh memory.
            extra.update(memory={"capacity": f"{2 * nbytes + (1 << 20)}"}, disk={"enabled": False})
        else:
            extra.update(memory={"enabled": False}, disk={"path": str(root / f"kvpack-{tier}"), "capacity": "64GiB"})
        backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, args), pool)
        backend.register_mem_pool_host(pool)
        return backend

    results: dict[str, float] = {}
    want = pool.get_data_page(int(src[0]), flat=True).clone()

    def run(entries: list[_Entry]) -> None:
        """Time every entry's sets, gets and cold gets, the entries' repeats
        interleaved (a, b, a, b...), so a backend is never favoured by running
        while the machine or the file system is quieter."""
        keys: dict[str, list[str]] = {}
        set_times: dict[str, list[float]] = {e.label: [] for e in entries}
        paired: list[float] = []
        regions: list[float] = []
        for rep in range(args.repeats + 1):
            for e in entries:
                ctl, k = (
                    controller(e.backend, pool),
                    page_keys(n, seed=1000 * rep + hash(e.label) % 997, page_tokens=ps),
                )
                keys[e.label] = k
                if e.paired_memcpy:
                    paired.append(memcpy_once())
                    regions.append(region_store())
                if e.zero_copy:
                    t = _timed(lambda: (set_zero_copy(ctl, k, src), e.flush and e.flush()))
                else:
                    t = _timed(lambda: set_generic(ctl, k, src))
                set_times[e.label].append(t)
        for e in entries:
            results[f"{e.label} set"] = gbps(nbytes, min(set_times[e.label][1:]))
        if paired:
            memcpy_best["set"] = min(paired[1:])
            region_best["set"] = min(regions[1:])
        get_times: dict[str, list[float]] = {e.label: [] for e in entries}
        paired, regions = [], []
        for _ in range(args.repeats + 1):
            for e in entries:
                ctl, fn, k = controller(e.backend, pool), get_zero_copy if e.zero_copy else get_generic, keys[e.label]
                if e.paired_memcpy:
                    paired.append(memcpy_once())
                    regions.append(region_load_dst())
                got: list[int] = []
                get_times[e.label].append(_timed(lambda: got.append(fn(ctl, BenchOp, k, dst))))
                if got[-1] != n:
                    print(f"! {e.label}: get returned {got[-1]} of {n} pages", file=sys.stderr)
        if paired:
            memcpy_best["get"] = min(paired[1:])
            region_best["get"] = min(regions[1:])
        for e in entries:
            results[f"{e.label} get (page cache)" if e.folder else f"{e.label} get"] = gbps(
                nbytes, min(get_times[e.label][1:])
            )
        cold_entries = [e for e in entries if e.folder is not None]
        if cold_entries and not args.no_cold:
            cold: dict[str, list[float]] = {e.label: [] for e in cold_entries}
            for _ in range(max(2, args.repeats // 2)):
                for e in cold_entries:
                    ctl, fn, k = (
                        controller(e.backend, pool),
                        get_zero_copy if e.zero_copy else get_generic,
                        keys[e.label],
                    )
                    _drop_cache(e.folder)  # type: ignore[arg-type]
                    cold[e.label].append(_timed(lambda: fn(ctl, BenchOp, k, dst)))
            for e in cold_entries:
                results[f"{e.label} get (cold)"] = gbps(nbytes, min(cold[e.label]))

    mem = kvpack_backend("memory")
    binding = mem.pools.kv
    threads = binding.copy_threads if binding is not None and binding.canonical is not None else 1
    print(f"# kvpack converts pages on {threads} thread(s): the host pool says SGLang computes on {args.engine_device}")
    run([_Entry("kvpack memory", mem, True, None, None, paired_memcpy=True)])
    mem.close()
    disk = kvpack_backend("disk")
    file_dir = root / "sglang-file"
    file_backend = HiCacheFile(storage_config({"file_storage_path": str(file_dir)}, args), file_path=str(file_dir))
    file_backend.register_mem_pool_host(pool)
    run(
        [
            _Entry("kvpack disk", disk, True, disk.flush, root / "kvpack-disk"),
            _Entry("sglang file", file_backend, False, None, file_dir),
        ]
    )
    disk.close()
    memcpy_set, memcpy_get = gbps(nbytes, memcpy_best["set"]), gbps(nbytes, memcpy_best["get"])
    memcpy_gbps = max(memcpy_set, memcpy_get)
    check = pool.get_data_page(int(src[0]), flat=True)
    if not torch.equal(check.view(torch.uint8), want.view(torch.uint8)):
        print("! source pages changed during the run", file=sys.stderr)

    rows = [
        Row("kvpack memory set", results["kvpack memory set"], "memcpy (paired)", memcpy_set),
        Row("kvpack memory get", results["kvpack memory get"], "memcpy (paired)", memcpy_get),
        Row(
            "kvpack memory set",
            results["kvpack memory set"],
            "region memcpy, 1 thread (paired)",
            gbps(nbytes, region_best["set"]),
        ),
        Row(
            "kvpack memory get",
            results["kvpack memory get"],
            "region memcpy, 1 thread (paired)",
            gbps(nbytes, region_best["get"]),
        ),
        Row("kvpack disk set (to flush)", results["kvpack disk set"], "sglang file set", results["sglang file set"]),
        Row(
            "kvpack disk get (page cache)",
            results["kvpack disk get (page cache)"],
            "sglang file get (page cache)",
            results["sglang file get (page cache)"],
        ),
    ]
    if threads > 1:
        threaded = gbps(nbytes, _threaded_copy_seconds(nbytes, threads, 2 * args.repeats + 2))
        rows[2:2] = [
            Row(f"kvpack memory {op}", results[f"kvpack memory {op}"], f"memcpy, {threads} threads", threaded)
            for op in ("set", "get")
        ]
    if not args.no_cold:
        rows.append(
            Row(
                "kvpack disk get (cold)",
                results["kvpack disk get (cold)"],
                "sglang file get (cold)",
                results["sglang file get (cold)"],
            )
        )
    print(f"{'measured':34} {'GB/s':>7}   {'vs':34} {'GB/s':>7}   ratio")
    for r in rows:
        print(f"{r.what:34} {r.gbps:7.2f}   {r.baseline:34} {r.baseline_gbps:7.2f}   {r.ratio:5.2f}x")
    print(f"{'memcpy (1 thread, best sample)':34} {memcpy_gbps:7.2f}")
    if args.markdown:
        cmd = "kvpack bench sglang " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.markdown, "a") as f:
            f.write(
                f"\n### `{cmd.strip()}`\n\n{hardware()}; {args.kind} {args.layout} {args.dtype}, "
                f"{page // 1024} KiB pages, {n} pages a call\n\n| measured | GB/s | vs | GB/s | ratio "
                "|\n|---|---|---|---|---|\n"
            )
            for r in rows:
                f.write(f"| {r.what} | {r.gbps:.2f} | {r.baseline} | {r.baseline_gbps:.2f} | {r.ratio:.2f}x |\n")
            f.write(f"| memcpy (1 thread, best sample) | {memcpy_gbps:.2f} | | | |\n")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
