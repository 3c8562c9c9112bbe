"""GPU check for kvpack.ops (run by scripts/gpu_check.sh on a lent CUDA machine).

Not a pytest module: one script that keeps going after a failure, so a single run
on a scarce machine reports everything. Steps, each ending in one ``STEP NAME
PASS|FAIL|DRY|SKIP reason`` line:

  kernels     the extension builds with the CUDA kernel, then: CUDA gather ==
              hand-written expectation (kvcases) for every layout x dtype, into device
              and pinned host staging, whole and partial blocks, misaligned staging
              (1/4/8-byte words), on a side stream; scatter round trips; CUDA == torch
              fallback on engine-sized caches (multi-CTA units); canonical objects
              (`kvpack.canonical`) on CUDA, by the CUDA kernel into device and pinned
              staging and by the torch path, == the C++ kernel's objects of the same bytes
              on the CPU, NHD and HND, a head sub-range too, and back, with the CUDA
              kernel's bandwidth next to the native CUDA block gather of the same bytes;
  vllm-views  vLLM 0.32+'s [B, H, N, C] block views in all six stride orders (built with
              torch.as_strided as vLLM builds them), full attention and MLA, kernel-block
              splits, as canonical objects: the same from every order, on the GPU by the
              kernel (device and pinned staging) and the torch path, as from LBHNC on the
              CPU, and back (tests/ops/gpu_views_check.py);
  copy-bench  `kvpack bench copy` (GPU section; CPU section too unless --quick) into
              --markdown; it prints ratios and asserts nothing about speed.

``--dry-run`` needs no GPU: it imports everything the steps import (kvpack mapped from the
checkout when not installed, tests/kvpack_checkout.py), builds every kvcases layout on the
CPU and lists the checks, and says DRY. A step that needs a GPU and finds none says FAIL.

    python tests/ops/gpu_check.py [--markdown FILE] [--quick] [--dry-run]
Exit status: 0 when every step passed (or, with --dry-run, imported).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import kvpack_checkout  # noqa: E402

MAPPING = kvpack_checkout.map_checkout()  # before anything below imports kvpack

import gpu_views_check  # noqa: E402
import torch  # noqa: E402
from kvcases import BUILDERS, NUM_BLOCKS, TOKENS, Case, build, expected_staging, token_range, tokens  # noqa: E402

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
    owners = views if kind == "block_view" else raw  # the tensors that own the cache's bytes
    back = {  # the same rows scattered by each path into zeroed caches of the same layout
        backend: [torch.zeros_like(r) for r in owners] for backend in (Backend.CUDA, Backend.TORCH)
    }
    for backend, zeroed in back.items():
        into = [z.permute(0, 1, 3, 2, 4) for z in zeroed] if kind == "hnd" else zeroed
        scatter_blocks(PagedKV.from_layers(into), ids, b if backend is Backend.TORCH else a, backend=backend)
    torch.cuda.synchronize()
    for c, t_ in zip(back[Backend.CUDA], back[Backend.TORCH]):
        assert torch.equal(c.view(torch.uint8), t_.view(torch.uint8)), f"{kind}: CUDA and torch scatters differ"
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


def step(name: str, verdict: str, reason: str) -> None:
    """The step's one line that scripts/gpu_check.sh reads: ``STEP NAME VERDICT reason``."""
    print(f"STEP {name} {verdict} {reason}", flush=True)


def planned_checks(quick: bool, side: Callable[[], torch.cuda.Stream]) -> list[tuple[str, Callable[[], None]]]:
    """Every kernel check by name, not yet run; `side` gives the side stream when one runs."""
    dtypes = (torch.bfloat16, torch.float8_e4m3fn) if quick else DTYPES
    out: list[tuple[str, Callable[[], None]]] = []
    for layout in sorted(BUILDERS):
        for dtype in dtypes:
            for where in ("device", "pinned"):
                out.append(
                    (f"{layout}/{dtype}/{where}", lambda l=layout, d=dtype, w=where: check_layout(l, d, w, 0, None))
                )
        for offset in (1, 4, 8):
            out.append(
                (
                    f"{layout}/offset{offset}",
                    lambda l=layout, o=offset: check_layout(l, torch.bfloat16, "device", o, None),
                )
            )
        out.append((f"{layout}/side-stream", lambda l=layout: check_layout(l, torch.float16, "pinned", 0, side())))
    for kind in ("nhd", "hnd", "block_view"):
        out.append((f"engine-sized/{kind}", lambda k=kind: check_engine_sized(k)))
    for kind in ("nhd", "hnd"):
        out.append((f"canonical/{kind}", lambda k=kind: check_canonical(k)))
    return out


def bench_args(quick: bool, markdown: str) -> list[str]:
    """`kvpack bench copy` arguments: --quick times the GPU section only, 3 repeats."""
    return (["--no-cpu", "--repeats", "3"] if quick else ["--repeats", "10"]) + (
        ["--markdown", markdown] if markdown else []
    )


def dry_run(quick: bool) -> int:
    """Everything a real run imports, every kvcases layout built on the CPU, the checks listed."""
    from kvpack.canonical import paged_geometry  # noqa: F401  (imported by check_canonical)
    from kvpack.tools.bench import copy_bench

    for name in sorted(BUILDERS):
        case = build(name, torch.bfloat16)
        expected_staging(case, [1, 0], POISON)
    checks = planned_checks(quick, torch.cuda.Stream)
    step(
        "kernels", "DRY", f"imports ok, {len(BUILDERS)} layouts built on the CPU, {len(checks)} checks listed (no GPU)"
    )
    copy_bench._parse(bench_args(quick, ""))
    step("vllm-views", *gpu_views_check.run(torch.device("cpu"), quick))
    step("copy-bench", "DRY", f"kvpack.tools.bench.copy_bench imported, arguments {bench_args(quick, '')} parsed")
    return 0


def run_kernels(quick: bool) -> bool:
    """Builds the extension and runs every check; says the step's verdict."""
    t0 = time.monotonic()
    status = load_extension()
    built = time.monotonic() - t0
    print(f"extension: {status} ({built:.1f}s)", flush=True)
    if not (status.available and status.has_cuda):
        step("kernels", "FAIL", f"the CUDA kernel did not build: {status.reason}")
        return False
    checks = Checks()
    streams: list[torch.cuda.Stream] = []

    def side() -> torch.cuda.Stream:
        if not streams:
            streams.append(torch.cuda.Stream())
        return streams[0]

    t0 = time.monotonic()
    planned = planned_checks(quick, side)
    for name, fn in planned:
        checks.run(name, fn)
    took = time.monotonic() - t0
    print(f"correctness: {checks.passed} passed, {len(checks.failed)} failed ({took:.1f}s)", flush=True)
    if checks.failed:
        step("kernels", "FAIL", f"{len(checks.failed)} of {len(planned)} checks failed: {', '.join(checks.failed)}")
        return False
    step("kernels", "PASS", f"{len(planned)} checks (extension {built:.0f}s, checks {took:.0f}s)")
    return True


def run_bench(quick: bool, markdown: str) -> bool:
    """`kvpack bench copy` on this GPU; says the step's verdict."""
    from kvpack.tools.bench import copy_bench

    t0 = time.monotonic()
    try:
        copy_bench.main(bench_args(quick, markdown))
    except Exception as e:
        traceback.print_exc()
        step("copy-bench", "FAIL", f"{type(e).__name__}: {e}")
        return False
    if not load_extension().has_cuda:
        step("copy-bench", "FAIL", "ran on the torch path only: no CUDA kernel")
        return False
    step(
        "copy-bench",
        "PASS",
        f"table printed{' and appended to ' + markdown if markdown else ''} ({time.monotonic() - t0:.0f}s)",
    )
    return True


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--markdown", default="", help="append the benchmark section to this file")
    p.add_argument("--quick", action="store_true", help="bf16 and fp8 only; the bench's GPU section, 3 repeats")
    p.add_argument("--dry-run", action="store_true", help="no GPU: imports, layouts built on the CPU, checks listed")
    args = p.parse_args(argv)

    print(MAPPING.describe(), flush=True)
    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}); GPU: "
        f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}",
        flush=True,
    )
    if args.dry_run:
        return dry_run(args.quick)
    if not torch.cuda.is_available():
        for name in ("kernels", "vllm-views", "copy-bench"):
            step(name, "FAIL", "no CUDA device visible (torch.cuda.is_available() is False)")
        return 2
    ok = run_kernels(args.quick)
    views = gpu_views_check.run(torch.device("cuda"), args.quick)
    step("vllm-views", *views)
    ok = views[0] == "PASS" and ok
    ok = run_bench(args.quick, args.markdown) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
