"""`kvpack bench sglang --busy-python`: SGLang's L3 calls while another thread of the process runs Python.

An SGLang server calls its storage backend from its prefetch and backup threads while the
scheduler thread runs Python (on a GPU server it rarely stops). Every time a backend gives
the GIL up (a system call from Python, a torch op, a hash of a buffer) it may have to wait
for the scheduler's switch interval (``sys.getswitchinterval()``, 5 ms) to take it back, so
what a backend costs there is set by how often it gives the GIL up as much as by its copies.

This bench times, on real SGLang host pools, kvpack's memory and disk tiers through SGLang's
zero-copy path and SGLang's ``file`` backend through its generic path (as `kvpack bench
sglang` does), each get and set alone and then with one more thread spinning in Python (the caller and
that thread pinned to a core each, where there are two: `busy_python_threads`), the
backends' calls interleaved. Medians (a busy thread makes the best sample a lucky one), and
each backend's ratio against ``file`` in the same condition. Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from kvpack.tools.bench.timing import busy_python_threads, hardware

Call = Callable[[], object]


def _medians(calls: dict[str, Call], repeats: int) -> dict[str, float]:
    """Median seconds of each call, the calls interleaved (a, b, c, a, b, c...) after one warm-up each."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(repeats + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvpack bench sglang --busy-python", description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--page-tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--pages", type=int, default=12, help="pages per call (the bench model's multi-turn calls: 12)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--io-threads", type=int, default=2)
    p.add_argument(
        "--engine-device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="the device the host pool says SGLang computes on (cuda: pages converted on io_threads threads)",
    )
    p.add_argument("--dir", default="", help="folder for the backends' files (default: a temp folder under $TMPDIR)")
    args = p.parse_args(argv)
    args.layout, args.kind = "page_first", "mha"
    torchvision_shim()
    from sglang.srt.managers.cache_controller import HiCacheController as Ctl
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    pool = host_pool(args)
    n, ps = args.pages, pool.page_size
    src, dst = pool.alloc(n * ps), pool.alloc(n * ps)
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvpack-sglang-gil-"))
    page = int(sum(pool.get_page_buffer_meta(src[:ps])[1]))

    def kvpack(extra: dict[str, Any]) -> Any:
        backend = StorageBackendFactory.create_backend(
            "dynamic", storage_config({**KVPACK_BACKEND, "io_threads": args.io_threads, **extra}, args), pool
        )
        backend.register_mem_pool_host(pool)
        return backend

    memory = kvpack({"memory": {"capacity": str(4 * n * page + (1 << 20))}, "disk": {"enabled": False}})
    disk = kvpack({"memory": {"enabled": False}, "disk": {"path": str(root / "kvpack"), "capacity": "64GiB"}})
    file_backend = HiCacheFile(storage_config({}, args), file_path=str(root / "file"))
    file_backend.register_mem_pool_host(pool)
    zero_copy = {"kvpack memory": memory, "kvpack disk": disk}
    seed = iter(range(1, 1 << 30))

    def setter(name: str) -> Call:
        ctl = controller(zero_copy.get(name, file_backend), pool)
        if name in zero_copy:
            return lambda: Ctl._page_set_zero_copy(ctl, page_keys(n, next(seed), ps), src)
        return lambda: Ctl._generic_page_set(ctl, page_keys(n, next(seed), ps), src)

    keys = {name: page_keys(n, next(seed), ps) for name in (*zero_copy, "sglang file")}
    for name, backend in zero_copy.items():
        Ctl._page_set_zero_copy(controller(backend, pool), keys[name], src)
    Ctl._generic_page_set(controller(file_backend, pool), keys["sglang file"], src)

    def getter(name: str) -> Call:
        ctl = controller(zero_copy.get(name, file_backend), pool)
        get = Ctl._page_get_zero_copy if name in zero_copy else Ctl._generic_page_get
        return lambda: get(ctl, BenchOp, keys[name], dst)

    names = (*zero_copy, "sglang file")
    print(f"# kvpack bench sglang --busy-python: {hardware()}, switch interval {sys.getswitchinterval() * 1e3:.0f} ms")
    print(
        f"# {n} pages of {page // 1024} KiB a call, median of {args.repeats}, "
        f"SGLang on {args.engine_device}, files in {root}"
    )
    print(f"{'call':22} {'alone ms':>9} {'x file':>7} {'busy ms':>9} {'x file':>7}")
    for op, make in (("get", getter), ("set", setter)):
        calls = {name: make(name) for name in names}
        alone = _medians(calls, args.repeats)
        with busy_python_threads(1, own_cores=True):
            time.sleep(0.05)  # the thread is running before the first timed call
            busy = _medians(calls, args.repeats)
        for name in names:
            a, b = alone[name], busy[name]
            ref_a, ref_b = alone["sglang file"], busy["sglang file"]
            print(f"{name + ' ' + op:22} {a * 1e3:9.2f} {a / ref_a:6.2f}x {b * 1e3:9.2f} {b / ref_b:6.2f}x")
    memory.close()
    disk.close()
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0
