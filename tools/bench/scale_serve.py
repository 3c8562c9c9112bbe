"""A TP=2 vLLM server's start-up on a disk tier that holds N objects: start-up does not wait on it.

    python -m kvpack.tools.bench.scale_serve --n 100000 [--tp 2] [--dir DIR]

Fills a store folder with N objects through the tier's own write path (`scale_bench.fill`),
then starts vLLM's OpenAI server (tiny model, fp32, ``--tensor-parallel-size`` TP, kvpack with
that folder as its disk tier: the scheduler and every TP worker open it) twice: on an empty
folder and on the filled one. Reports, per start, the seconds from launch to ``/health`` and
to the answer of a first completion, and each as a ratio of the empty folder's. The objects
belong to another layout (the bench's), so the server's prompt is a miss either way: what is
measured is what opening a large store costs a starting engine, nothing else.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from kvpack.tools.bench.scale_bench import fill
from kvpack.tools.bench.serve_server import Server, http_call
from kvpack.tools.ports import free_port
from kvpack.tools.tinymodel import build_tiny_llama

KV_CACHE_BYTES = 64 << 20
MAX_MODEL_LEN = 1024


def start_once(model: Path, store: Path, tp: int, log: Path) -> tuple[float, float]:
    """(seconds to /health, seconds to the first completion's answer) of one server start."""
    kvpack = {"memory": {"capacity": "256MiB"}, "disk": {"path": str(store), "capacity": "4GiB"}}
    server = Server(
        model=str(model),
        port=free_port(),
        log=log,
        prefix_caching=False,
        kvpack=kvpack,
        kv_cache_bytes=KV_CACHE_BYTES,
        max_model_len=MAX_MODEL_LEN,
        extra_args=("--tensor-parallel-size", str(tp), "--dtype", "float32"),
    )
    t0 = time.monotonic()
    server.start(timeout_s=600)
    healthy = time.monotonic() - t0
    try:
        body = {"model": str(model), "prompt": "kvpack start-up " * 40, "max_tokens": 4, "temperature": 0}
        status, text = http_call("POST", server.port, "/v1/completions", body, timeout=120)
        if status != 200:
            raise RuntimeError(f"completion failed ({status}): {text[:300]}")
        first = time.monotonic() - t0
    finally:
        server.stop()
    return healthy, first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpack.tools.bench.scale_serve", description=__doc__)
    parser.add_argument("--n", type=int, default=100_000, help="objects in the filled folder")
    parser.add_argument("--tp", type=int, default=2, help="vLLM's tensor-parallel size")
    parser.add_argument("--payload", type=int, default=256, help="bytes per object")
    parser.add_argument("--writers", type=int, default=2, help="writer processes of the fill")
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    # vLLM's CPU build binds each TP rank's threads to cores; on one NUMA node it must be told how
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % (os.cpu_count() or 1)) for r in range(args.tp)))
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvpack-scale-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model = build_tiny_llama(work / "model")
        filled = work / "filled"
        rate = fill(filled, args.n, args.writers, args.payload)
        print(f"fill: {args.n} objects at {rate:.0f} puts/s", flush=True)
        rows = []
        for name, store in (("empty folder", work / "empty"), (f"{args.n} objects", filled)):
            healthy, first = start_once(model, store, args.tp, work / "server.log")
            rows.append((name, healthy, first))
            print(f"{name}: /health {healthy:.1f} s, first completion {first:.1f} s", flush=True)
        base = rows[0]
        print(f"\n| store at start (TP={args.tp}) | /health (s) | x empty | first completion (s) | x empty |")
        print("|---|---|---|---|---|")
        for name, healthy, first in rows:
            print(f"| {name} | {healthy:.1f} | {healthy / base[1]:.2f} | {first:.1f} | {first / base[2]:.2f} |")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
