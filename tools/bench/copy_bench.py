"""`kvpack bench copy`: block gather/scatter throughput next to a plain copy of the same bytes.

CPU: the vLLM CPU layout ([num_blocks, kv_heads, block_size, 2*head_size] per layer),
C++ kernel and torch fallback vs one contiguous ``dst.copy_(src)`` of the same
number of bytes, and the canonical copy (converting vLLM's `vec` and `amx` packings
to kvpack's engine-neutral layout) vs the engine-native C++ copy, all measured in
this run. GPU (when CUDA is available): the vLLM
flash-attention layout ([2, num_blocks, block_size, kv_heads, head_size] per layer)
gathered into pinned host memory and into device memory, and scattered back, vs a
pinned D2H/H2D copy and a device-to-device copy of the same bytes.

GB/s counts the staging bytes once (like memcpy: n_blocks * slot_bytes per call).
Prints ratios; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from kvpack.ops import Backend, PagedKV, gather_blocks, load_extension, scatter_blocks, upload_ids
from kvpack.tools.bench.timing import Row, gbps, hardware

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvpack bench copy", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--block-tokens", type=int, default=128)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--blocks", type=int, default=64, help="blocks copied per call")
    p.add_argument("--cache-blocks", type=int, default=0, help="blocks in the cache (default 2x --blocks)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU section")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU section")
    p.add_argument("--markdown", default="", help="append a markdown section with the results to this file")
    return p.parse_args(argv)


def _ids(args: argparse.Namespace, cache_blocks: int) -> list[int]:
    rng = random.Random(0)
    return rng.sample(range(cache_blocks), args.blocks)  # unsorted, as an engine hands them over


def _cpu_rows(args: argparse.Namespace) -> list[Row]:
    dtype = DTYPES[args.dtype]
    nb = args.cache_blocks or 2 * args.blocks
    shape = (nb, args.kv_heads, args.block_tokens, 2 * args.head_size)
    layers = [torch.empty(shape, dtype=torch.uint8 if dtype.itemsize == 1 else dtype) for _ in range(args.layers)]
    for t in layers:
        t.view(torch.uint8).random_(0, 256)
    if dtype.itemsize == 1:
        layers = [t.view(dtype) for t in layers]
    kv = PagedKV.from_layers(layers)
    ids = _ids(args, nb)
    nbytes = len(ids) * kv.layout.slot_bytes
    staging = torch.empty(nbytes, dtype=torch.uint8)
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    backends = ([Backend.CPP] if load_extension().available else []) + [Backend.TORCH]
    # Two references: torch's copy_ (which uses every intra-op thread) and one
    # thread's memmove, the fair peer of the C++ kernel, which is serial by design
    # (csrc/block_copy_cpu.cpp: an OpenMP team inside an engine slows the engine).
    # The two groups are timed apart: a threaded copy leaves cache lines in the other
    # cores' caches, and whichever serial copy ran next would pay to fetch them back
    # (a small call's reading then says more about the previous copy than about its own).
    threaded: dict[str, Callable[[], object]] = {"memcpy": lambda: dst.copy_(src)}
    serial: dict[str, Callable[[], object]] = {
        "memcpy 1 thread": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    }
    for b in backends:
        group = serial if b is Backend.CPP else threaded
        group[f"cpu gather {b.value}"] = partial(gather_blocks, kv, ids, staging, backend=b)
        group[f"cpu scatter {b.value}"] = partial(scatter_blocks, kv, ids, staging, backend=b)
    canonical = _canonical_fns(layers, ids, staging, args) if load_extension().available else {}
    serial.update(canonical)
    best = _interleaved_best(threaded, args.repeats) | _interleaved_best(serial, args.repeats)
    base = gbps(nbytes, best.pop("memcpy"))
    base_1t = gbps(nbytes, best.pop("memcpy 1 thread"))
    native = {op: best.get(f"cpu {op} cpp") for op in ("gather", "scatter")}
    rows = [
        Row(name, gbps(nbytes, t), f"memcpy ({torch.get_num_threads()} threads)", base)
        for name, t in best.items()
        if name not in canonical
    ]
    rows += [Row(name, gbps(nbytes, t), "memcpy (1 thread)", base_1t) for name, t in best.items() if "cpp" in name]
    for name, secs in best.items():
        op = "gather" if "gather" in name else "scatter"
        if name in canonical and (native_s := native[op]) is not None:
            rows.append(Row(name, gbps(nbytes, secs), f"engine-native {op} (cpp)", gbps(nbytes, native_s)))
    return rows


def _canonical_fns(
    layers: list[torch.Tensor], ids: list[int], staging: torch.Tensor, args: argparse.Namespace
) -> dict[str, Callable[[], object]]:
    """The canonical copy (`kvpack.canonical`) of the same blocks, under each vLLM CPU
    packing of this dtype: `vec` (K as [D][T]) and, for bf16, `amx` (K [T/16][D/2][16][2],
    V [D/16][T/2][16][2]). Same bytes as the engine-native copy, converted while copying.
    Rows are labelled with the kernel's SIMD level; on a CPU with AVX-512 the SSE2 level
    runs too, so the gain of the wider blocks is measured in the same run."""
    from kvpack.canonical.geometry import CpuSimd, TilePacking, cpu_simd, vllm_cpu_geometry

    e, t, d = layers[0].element_size(), args.block_tokens, args.head_size
    packings = {"vec": (TilePacking.panels(1, t, d, e), TilePacking.row_major(d * e, d, e, t))}
    if e == 2 and t % 16 == 0 and d % 16 == 0:
        packings["amx"] = (TilePacking.panels(2, 16, d, e), TilePacking.token_pairs(2, 16, t, e))
    best = cpu_simd() or CpuSimd.SCALAR
    levels = [best] + ([CpuSimd.SSE2] if best > CpuSimd.SSE2 else [])
    fns: dict[str, Callable[[], object]] = {}
    for isa, (k, v) in packings.items():
        geo = vllm_cpu_geometry(layers, k, v)
        heads = geo.heads
        for level in levels:
            for op in ("gather", "scatter"):
                fns[f"canonical {op} ({isa} packing, {level.name.lower()})"] = partial(
                    geo.copy_at_simd, ids, staging, gather=op == "gather", obj_heads=heads, simd=level
                )
    return fns


def _interleaved_best(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Fastest seconds per function, timing them round-robin so that load from other
    processes on a shared machine hits the baseline and the kernels alike."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


QUEUED_CALLS = 10  # calls launched back to back in a "queued" row


def _cuda_seconds(fn: Callable[[], object], repeats: int, queued: int = 1) -> float:
    """Median seconds per call from CUDA events around `queued` calls launched back to back,
    after one warm-up call. One call (queued=1) includes the host's launch cost, during
    which the GPU idles; queued calls hide it behind the previous copy, as copies queued
    on a side stream behind the forward do."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(queued):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / queued)
    return statistics.median(times)


def _gpu_rows(args: argparse.Namespace) -> list[Row]:
    dtype = DTYPES[args.dtype]
    nb = args.cache_blocks or 2 * args.blocks
    shape = (2, nb, args.block_tokens, args.kv_heads, args.head_size)
    dev = torch.device("cuda")
    layers = [torch.empty(shape, dtype=torch.uint8, device=dev).random_(0, 256).view(dtype) for _ in range(args.layers)]
    kv = PagedKV.from_layers(layers)
    ids = upload_ids(kv, _ids(args, nb))  # uploaded once, outside every timed call
    nbytes = len(ids.ids) * kv.layout.slot_bytes
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 256)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    r = args.repeats
    rows = []
    backends = ([Backend.CUDA] if load_extension().has_cuda else []) + [Backend.TORCH]
    # the torch path is bound by the host's launches: queueing its calls changes nothing
    for queued in (1, QUEUED_CALLS):
        d2h = gbps(nbytes, _cuda_seconds(lambda: pinned.copy_(dev_a, non_blocking=True), r, queued))
        h2d = gbps(nbytes, _cuda_seconds(lambda: dev_a.copy_(pinned, non_blocking=True), r, queued))
        d2d = gbps(nbytes, _cuda_seconds(lambda: dev_b.copy_(dev_a), r, queued))
        how = "one call" if queued == 1 else f"{queued} queued"
        for b in backends if queued == 1 else backends[:1]:

            def run(fn: Callable[..., object], buf: torch.Tensor) -> float:
                return gbps(nbytes, _cuda_seconds(lambda: fn(kv, ids, buf, backend=b), r, queued))

            rows += [
                Row(f"gpu gather->pinned {b.value}, {how}", run(gather_blocks, pinned), "pinned D2H copy", d2h),
                Row(f"gpu scatter<-pinned {b.value}, {how}", run(scatter_blocks, pinned), "pinned H2D copy", h2d),
                Row(f"gpu gather->device {b.value}, {how}", run(gather_blocks, dev_b), "d2d copy", d2d),
                Row(f"gpu scatter<-device {b.value}, {how}", run(scatter_blocks, dev_b), "d2d copy", d2d),
            ]
    return rows


def _table(rows: list[Row]) -> list[str]:
    out = ["| operation | GB/s | baseline | baseline GB/s | ratio |", "|---|---:|---|---:|---:|"]
    for row in rows:
        out.append(f"| {row.what} | {row.gbps:.2f} | {row.baseline} | {row.baseline_gbps:.2f} | {row.ratio:.2f}x |")
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    status = load_extension()
    gpu = torch.cuda.is_available() and not args.no_gpu
    lines = [
        f"hardware: {hardware()}"
        + (f"; GPU: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "; no GPU"),
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; kernels: {status.reason}",
        f"shape: {args.layers} layers, {args.blocks} of {args.cache_blocks or 2 * args.blocks} blocks, "
        f"{args.block_tokens} tokens/block, {args.kv_heads} kv heads, head {args.head_size}, {args.dtype}",
    ]
    for line in lines:
        print(line)
    rows: list[Row] = []
    if not args.no_cpu:
        rows += _cpu_rows(args)
    if gpu:
        rows += _gpu_rows(args)
    table = _table(rows)
    print("\n".join(table))
    if args.markdown:
        prog = "python -m kvpack.tools.bench.copy_bench" if argv is None else "kvpack bench copy"
        cmd = prog + " " + " ".join(sys.argv[1:] if argv is None else argv)
        stamp = time.strftime("%Y-%m-%d")
        with open(args.markdown, "a") as f:
            f.write(f"\n## Block copy ({stamp})\n\nCommand: `{cmd.strip()}`\n\n")
            f.write("\n".join(f"- {line}" for line in lines) + "\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
