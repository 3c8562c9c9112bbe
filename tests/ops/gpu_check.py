"""GPU check for kvpack.ops (run by scripts/gpu_check.sh on a lent CUDA machine).

Not a pytest module: one script that keeps going after a failure, so a single run
on a scarce machine reports everything. Checks, on the GPU:
  1. the extension builds with the CUDA kernel;
  2. CUDA gather == hand-written expectation (kvcases) for every layout x dtype,
     into device and pinned host staging, whole and partial blocks, misaligned
     staging (1/4/8-byte words), on a side stream; scatter round trips;
  3. CUDA == torch fallback on engine-sized caches (multi-CTA units);
  4. canonical objects (`kvpack.canonical`) on CUDA, by the CUDA kernel into device
     and pinned staging and by the torch path, == the C++ kernel's objects of the same
     bytes on the CPU, NHD and HND, a head sub-range too, and back; with the CUDA
     kernel's bandwidth next to the native CUDA block gather of the same bytes;
then runs the copy benchmark (CPU and GPU sections).

    python tests/ops/gpu_check.py [--markdown FILE] [--quick]
Exit status: 0 when every check passed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from kvcases import BUILDERS, NUM_BLOCKS, TOKENS, Case, build, expected_staging, token_range, tokens  # noqa: E402

import conftest  # noqa: E402,F401  (maps kvpack to the checkout when not installed)
from kvpack.ops import Backend, PagedKV, gather_blocks, load_extension, scatter_blocks  # noqa: E402

POISON = 0xAB
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


class Checks:
    """Runs named checks, records failures, never stops early."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed: list[str] = []

    def run(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            self.passed += 1
        except Exception:
            self.failed.append(name)
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)


def _staging(n_bytes: int, where: str, offset: int = 0) -> torch.Tensor:
    buf = torch.full((n_bytes + 32,), POISON, dtype=torch.uint8)
    if where == "pinned":
        buf = buf.pin_memory()
    elif where == "device":
        buf = buf.cuda()
    return buf[offset : offset + n_bytes]


def _expected_cache(source: Case, ids: list[int], first: int, last: int | None) -> list[torch.Tensor]:
    want = source.clone_zeroed()
    lay = source.kv.layout
    for i, b in enumerate(ids):
        t0, t1 = token_range(source, i, len(ids), first, last)
        for l in range(lay.num_layers):
            for s in range(lay.num_segments):
                tokens(want.phys(l, s, b), want.token_dim, t0, t1).copy_(
                    tokens(source.phys(l, s, b), source.token_dim, t0, t1)
                )
    return [t.cpu().view(torch.uint8) for t in want.tensors]


def check_layout(layout: str, dtype: torch.dtype, where: str, offset: int, stream: torch.cuda.Stream | None) -> None:
    case = build(layout, dtype, "cuda")
    rng = random.Random(f"{layout}{dtype}{where}{offset}")
    ids = [rng.randrange(NUM_BLOCKS) for _ in range(5)]
    ids.insert(2, ids[0])  # repeated, unsorted
    runs: list[tuple[list[int], int, int | None]] = [(ids, 0, None)]
    if case.token_dim is not None:
        runs += [(list(dict.fromkeys(ids)), 1, TOKENS - 1), ([ids[1]], 1, 3)]
    for run_ids, first, last in runs:
        staging = _staging(len(run_ids) * case.kv.layout.slot_bytes, where, offset)
        used = gather_blocks(case.kv, run_ids, staging, first_token_offset=first, last_token_count=last, stream=stream)
        assert used is Backend.CUDA, used
        torch.cuda.synchronize()
        want = expected_staging(case, run_ids, POISON, first, last)
        assert torch.equal(staging.cpu(), want), f"gather mismatch ids={run_ids} first={first} last={last}"
        target = case.clone_zeroed()
        scatter_blocks(target.kv, run_ids, staging, first_token_offset=first, last_token_count=last, stream=stream)
        torch.cuda.synchronize()
        for got, exp in zip(
            [t.cpu().view(torch.uint8) for t in target.tensors], _expected_cache(case, run_ids, first, last)
        ):
            assert torch.equal(got, exp), f"scatter mismatch ids={run_ids} first={first} last={last}"


def check_engine_sized(kind: str) -> None:
    """CUDA vs torch fallback on a cache with big blocks (several CTAs per unit)."""
    nb, t, h, d, layers = 48, 128, 8, 128, 4
    raw = [
        torch.empty((2, nb, h, t, d) if kind == "hnd" else (2, nb, t, h, d), dtype=torch.uint8, device="cuda")
        .random_(0, 256)
        .view(torch.bfloat16)
        for _ in range(layers)
    ]
    views = [r.permute(0, 1, 3, 2, 4) if kind == "hnd" else r for r in raw]
    if kind == "block_view":
        views = [
            torch.empty((nb, h, t, 2 * d), dtype=torch.uint8, device="cuda").random_(0, 256).view(torch.bfloat16)
            for _ in range(layers)
        ]
    kv = PagedKV.from_layers(views)
    ids = random.Random(kind).sample(range(nb), 20) + [3, 3]
    n_bytes = len(ids) * kv.layout.slot_bytes
    a, b = _staging(n_bytes, "device"), _staging(n_bytes, "pinned")
    gather_blocks(kv, ids, a, backend=Backend.CUDA)
    gather_blocks(kv, ids, b, backend=Backend.TORCH)
    torch.cuda.synchronize()
    assert torch.equal(a.cpu(), b), f"{kind}: CUDA and torch gathers differ"
    for first, last in [(5, 77), (127, 1)]:
        a.fill_(POISON)
        b.fill_(POISON)
        gather_blocks(kv, ids[:6], a, first_token_offset=first, last_token_count=last, backend=Backend.CUDA)
        gather_blocks(kv, ids[:6], b, first_token_offset=first, last_token_count=last, backend=Backend.TORCH)
        torch.cuda.synchronize()
        assert torch.equal(a.cpu(), b), f"{kind}: partial gathers differ ({first}, {last})"


def check_canonical(kind: str) -> None:
    """Canonical objects from a GPU cache (CUDA kernel, device and pinned staging; torch path)
    == the same cache's bytes copied to the CPU and gathered by the C++ kernel; a scatter
    back gives the cache again; prints the CUDA kernel's GB/s next to the native block copy."""
    from kvpack.canonical import paged_geometry

    nb, t, h, d, layers = 24, 64, 8, 128, 3
    shape = (2, nb, h, t, d) if kind == "hnd" else (2, nb, t, h, d)
    gpu = [
        torch.empty(shape, dtype=torch.uint8, device="cuda").random_(0, 256).view(torch.bfloat16) for _ in range(layers)
    ]
    cpu = [x.cpu() for x in gpu]
    ids = random.Random(kind).sample(range(nb), 10)
    g_geo, c_geo = (
        paged_geometry(PagedKV.from_layers(gpu, block_size=t)),
        paged_geometry(PagedKV.from_layers(cpu, block_size=t)),
    )
    n_bytes = len(ids) * g_geo.object_bytes(h)
    want = torch.empty(n_bytes, dtype=torch.uint8)
    c_geo.copy(ids, want, gather=True, obj_heads=h, use_kernel=True)
    for name, staging, kernel in (
        ("cuda kernel, device staging", torch.empty(n_bytes, dtype=torch.uint8, device="cuda"), True),
        ("cuda kernel, pinned staging", torch.empty(n_bytes, dtype=torch.uint8).pin_memory(), True),
        ("torch path", torch.empty(n_bytes, dtype=torch.uint8, device="cuda"), False),
    ):
        g_geo.copy(ids, staging, gather=True, obj_heads=h, use_kernel=kernel)
        torch.cuda.synchronize()
        assert torch.equal(staging.cpu(), want), f"canonical/{kind}: {name}: GPU and CPU objects differ"
        back = [torch.zeros_like(x) for x in gpu]
        paged_geometry(PagedKV.from_layers(back, block_size=t)).copy(
            ids, staging, gather=False, obj_heads=h, use_kernel=kernel
        )
        torch.cuda.synchronize()
        same = all(
            torch.equal(x[:, ids].view(torch.uint8), y[:, ids].view(torch.uint8)) for x, y in zip(back, gpu)
        )  # bytes: random bf16 has NaNs
        assert same, f"canonical/{kind}: {name}: scatter lost bytes"
    part_g = torch.empty(len(ids) * g_geo.object_bytes(h), dtype=torch.uint8, device="cuda")
    part_c = torch.zeros(len(ids) * g_geo.object_bytes(h), dtype=torch.uint8)
    part_g.copy_(part_c.cuda())
    g_geo.copy(ids, part_g, gather=True, obj_heads=h, obj_h0=2, cache_h0=4, n_heads=3, use_kernel=True)
    c_geo.copy(ids, part_c, gather=True, obj_heads=h, obj_h0=2, cache_h0=4, n_heads=3, use_kernel=True)
    torch.cuda.synchronize()
    assert torch.equal(part_g.cpu(), part_c), f"canonical/{kind}: head sub-range differs"
    _canonical_bandwidth(kind, gpu, t, h)


def _canonical_bandwidth(kind: str, gpu: list[torch.Tensor], t: int, h: int) -> None:
    """CUDA canonical gather vs the native CUDA block gather of the same blocks (d2d)."""
    from kvpack.canonical import paged_geometry

    kv = PagedKV.from_layers(gpu, block_size=t)
    geo = paged_geometry(kv)
    ids = list(range(kv.layout.num_blocks))
    out = torch.empty(len(ids) * geo.object_bytes(h), dtype=torch.uint8, device="cuda")
    native = torch.empty(len(ids) * kv.layout.slot_bytes, dtype=torch.uint8, device="cuda")

    def timed(fn: Callable[[], object]) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20 / 1000.0

    canon = timed(lambda: geo.copy(ids, out, gather=True, obj_heads=h, use_kernel=True))
    torch_path = timed(lambda: geo.copy(ids, out, gather=True, obj_heads=h, use_kernel=False))
    base = timed(lambda: gather_blocks(kv, ids, native, backend=Backend.CUDA))
    gbps = lambda sec: 2 * out.numel() / sec / 1e9  # noqa: E731 (read + write)
    print(
        f"canonical/{kind} d2d gather: cuda kernel {gbps(canon):.0f} GB/s, torch path {gbps(torch_path):.0f} GB/s, "
        f"native block gather {gbps(base):.0f} GB/s; kernel x native {base / canon:.2f}",
        flush=True,
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--markdown", default="", help="append the benchmark section to this file")
    p.add_argument("--quick", action="store_true", help="bf16 and fp8 only")
    args = p.parse_args(argv)

    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}); GPU: "
        f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}",
        flush=True,
    )
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device visible")
        return 2
    t0 = time.monotonic()
    status = load_extension()
    print(f"extension: {status} ({time.monotonic() - t0:.1f}s)", flush=True)
    if not (status.available and status.has_cuda):
        print("FAIL: the CUDA kernel did not build; see the reason above")
        return 2

    checks = Checks()
    side = torch.cuda.Stream()
    dtypes = (torch.bfloat16, torch.float8_e4m3fn) if args.quick else DTYPES
    t0 = time.monotonic()
    for layout in sorted(BUILDERS):
        for dtype in dtypes:
            for where in ("device", "pinned"):
                checks.run(f"{layout}/{dtype}/{where}", lambda: check_layout(layout, dtype, where, 0, None))
        for offset in (1, 4, 8):
            checks.run(f"{layout}/offset{offset}", lambda: check_layout(layout, torch.bfloat16, "device", offset, None))
        checks.run(f"{layout}/side-stream", lambda: check_layout(layout, torch.float16, "pinned", 0, side))
    for kind in ("nhd", "hnd", "block_view"):
        checks.run(f"engine-sized/{kind}", lambda: check_engine_sized(kind))
    for kind in ("nhd", "hnd"):
        checks.run(f"canonical/{kind}", lambda: check_canonical(kind))
    print(
        f"correctness: {checks.passed} passed, {len(checks.failed)} failed ({time.monotonic() - t0:.1f}s)", flush=True
    )
    for name in checks.failed:
        print(f"  failed: {name}")

    from kvpack.tools.bench import copy_bench

    bench_args = ["--repeats", "10"] + (["--markdown", args.markdown] if args.markdown else [])
    try:
        copy_bench.main(bench_args)
    except Exception:
        traceback.print_exc()
        checks.failed.append("benchmark")
    return 0 if not checks.failed else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
