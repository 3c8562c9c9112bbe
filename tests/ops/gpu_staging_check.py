"""GPU check of the staging path the adapters use (`kvpack.transfers.staging`), with figures.

Not a pytest module: run by scripts/gpu_check.sh on a lent CUDA machine (no vLLM
needed: the vLLM adapter's `BlockLayout` and `CanonicalBlocks` import only kvpack),
and with ``--cpu`` by its dry run (tests/ops/test_gpu_check_imports.py) here, so nothing in it first
fails on a GPU for a reason a CPU could have shown. Checks:

  1. save then load of paged KV through `Staging` (pinned rows, side streams, events)
     on one run of layers, two runs (a drafter's or another group's layers) and
     canonical objects, with the compute stream kept busy by a queued write of the
     blocks: bytes == the torch reference, the forward's write included; then the
     same on the torch path (kernels switched off: a GPU without nvcc), which
     stages through one device scratch per call;
     then a load read where it lies in a shared mapping the staging device registered
     (``cudaHostRegister``; the host store's arena on a GPU host);
  2. byte offsets past 2^31 in the cache and in the staging (GPU only, ~5 GiB);
  3. bandwidth over prebuilt tensors (>= ``--gib`` GiB, ids uploaded once, events
     around back-to-back launches): gather to pinned vs a pinned ``copy_`` (D2H),
     scatter from pinned (H2D), gather to device vs a device ``copy_`` (D2D); and, no target,
     an H2D copy from registered memory vs from pinned (``h2d_registered``, ~1x expected).

Prints ``STEP staging PASS|FAIL reason`` (checks 1-2) and ``STEP bandwidth PASS|MISSED|DRY
figures`` (3: MISSED names each ratio below its target; DRY: CPU figures, no targets), read by
scripts/gpu_check.sh, then one summary line ``GPU_STAGING PASS|FAIL ...``; exit status 0 when
every check passed. Without ``--cpu`` and without a visible GPU both steps say FAIL at once.

    python tests/ops/gpu_staging_check.py [--cpu] [--gib 1.0] [--repeats 5]
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import kvpack_checkout  # noqa: E402

MAPPING = kvpack_checkout.map_checkout()  # kvpack and kvpack.vllm_plugin from the checkout when not installed

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvpack.canonical import paged_geometry  # noqa: E402
from kvpack.identity.heads import HeadRange  # noqa: E402
from kvpack.ops import ExtensionStatus, PagedKV, gather_blocks, load_extension, scatter_blocks, upload_ids  # noqa: E402
from kvpack.ops._reference import gather_reference  # noqa: E402
from kvpack.transfers.staging import Direction, Staging  # noqa: E402
from kvpack.vllm_plugin.blocks import BlockLayout  # noqa: E402
from kvpack.vllm_plugin.canonical_blocks import CanonicalBlocks  # noqa: E402

TARGETS = {"d2h": 0.8, "h2d": 0.8, "d2d": 0.7}


def _flash(nb: int, bs: int, heads: int, dim: int, device: torch.device) -> torch.Tensor:
    """A vLLM flash layer ``[2, blocks, block_size, heads, dim]`` of random fp16 bytes."""
    return (
        torch.randint(0, 256, (2 * nb * bs * heads * dim * 2,), dtype=torch.uint8, device=device)
        .view(torch.float16)
        .view(2, nb, bs, heads, dim)
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bytewise equality (random fp16 bytes hold NaNs)."""
    return torch.equal(a.view(torch.int16).cpu(), b.view(torch.int16).cpu())


def _busy(device: torch.device, writes: Callable[[], None]) -> None:
    """Queue a long computation, then `writes`, on the compute stream (GPU), or just write."""
    if device.type == "cuda":
        a = torch.randn((4096, 4096), device=device)
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
    writes()


def check_round_trip(copier: BlockLayout | CanonicalBlocks, layer: torch.Tensor, staging: Staging) -> None:
    """Save blocks (one rewritten by a queued forward) and load them into other blocks."""
    nb = layer.shape[1]
    fresh = torch.randint(0, 256, layer[:, 1].shape, dtype=torch.int16, device=layer.device).view(torch.float16)
    ids = [1, nb - 1, 2]
    _busy(layer.device, lambda: layer[:, 1].copy_(fresh))
    staged = staging.gather(len(ids), copier.slot_bytes, lambda rows, lane: copier.gather(ids, rows, lane))
    got = torch.from_numpy(staged.host_rows().copy())
    staged.release()
    if layer.device.type == "cuda":
        torch.cuda.synchronize()
    if not _same(layer[:, 1], fresh):
        raise AssertionError("the compute stream's write was not done")
    want = torch.empty_like(got)
    copier.gather(ids, want_dev := torch.empty(want.shape, dtype=torch.uint8, device=layer.device))
    want.copy_(want_dev.cpu())
    if not torch.equal(got, want):
        raise AssertionError("gathered rows differ from the inline copy")
    before = layer.clone()
    rows = staging.rows(len(ids), copier.slot_bytes)
    rows.copy_(got)
    dst = [0, 3, 4]
    _busy(layer.device, lambda: None)
    staging.scatter(rows, lambda r, lane: copier.scatter(dst, r, lane)).release()
    for s, d in zip(ids, dst):
        if not _same(layer[:, d], before[:, s]):
            raise AssertionError(f"block {s} did not land in block {d}")


def check_staging(device: torch.device) -> None:
    staging = Staging.for_tensor(torch.empty(0, device=device))
    nb, bs = 16, 16
    one = [_flash(nb, bs, 4, 64, device) for _ in range(3)]
    check_round_trip(BlockLayout.from_tensors(one, nb), one[0], staging)
    target, draft = _flash(nb, bs, 4, 64, device), _flash(nb, bs, 1, 32, device)
    check_round_trip(BlockLayout.from_tensors([target, draft], nb), draft, staging)
    cache = _flash(nb, bs, 4, 64, device)
    blocks = CanonicalBlocks(paged_geometry(PagedKV.from_layers([cache])), HeadRange(0, 4), nb)
    check_round_trip(blocks, cache, staging)


def check_staging_torch_path(device: torch.device) -> None:
    """The same round trips on the torch path: what a GPU runs whose kernels did not build
    (no nvcc, a refused CUDA version); staged through one device scratch per call."""
    off = ExtensionStatus(available=False, has_cuda=False, reason="kernels switched off by the check")
    with (
        mock.patch("kvpack.ops.copy.load_extension", lambda: off),
        mock.patch("kvpack.canonical.geometry.load_extension", lambda: off),
    ):
        check_staging(device)


def check_registered_host_load(device: torch.device) -> None:
    """A load from a host store's mapping (a /dev/shm file mapped shared, as
    `kvpack.tiers.host.pages.SharedPages` maps the arena): the staging device registers it
    (on a GPU: ``cudaHostRegister``, and torch then sees it as pinned), the canonical scatter
    reads four objects where they lie (two back to back in descending order, two apart) and
    the blocks equal the gathered ones; then the mapping is unregistered."""
    staging = Staging.for_tensor(torch.empty(0, device=device))
    nb, bs = 16, 16
    cache = _flash(nb, bs, 4, 64, device)
    blocks = CanonicalBlocks(paged_geometry(PagedKV.from_layers([cache])), HeadRange(0, 4), nb)
    if not blocks.reads_addresses:
        raise AssertionError("the canonical layout cannot read objects at addresses here")
    ids, slots, size = [1, 5, 7, 2], [9, 8, 3, 0], blocks.slot_bytes
    got = staging.gather(len(ids), size, lambda r, lane: blocks.gather(ids, r, lane))
    objects = got.host_rows().copy()
    got.release()
    path = f"/dev/shm/kvpack-gpu-check-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 10 * size)
        mapping = mmap.mmap(fd, 10 * size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)
    arena = np.frombuffer(mapping, dtype=np.uint8)
    for row, slot in zip(objects, slots):
        arena[slot * size : (slot + 1) * size] = row
    base = int(arena.ctypes.data)
    try:
        registered = staging.device.register_host(base, arena.nbytes)
        if device.type == "cuda":
            if not registered or not staging.device.reads_in_place(base, arena.nbytes):
                raise AssertionError("CUDA did not register the shared mapping")
            if not torch.frombuffer(mapping, dtype=torch.uint8).is_pinned():
                raise AssertionError("torch does not see the registered mapping as pinned")
        before = cache.clone()
        dst = [0, 3, 4, 6]
        with staging.lane(Direction.LOAD) as lane:
            blocks.scatter_at(dst, [base + slot * size for slot in slots], lane)
            event = staging.device.record(Direction.LOAD)
        staging.device.synchronize(event)
        for s, d in zip(ids, dst):
            if not _same(cache[:, d], before[:, s]):
                raise AssertionError(f"block {s} read from the mapping did not land in block {d}")
    finally:
        staging.device.unregister_host()
        del arena
        mapping.close()


def check_large_offsets(device: torch.device) -> None:
    """Blocks past 2^31 bytes into the cache, into device staging past 2^31 bytes."""
    bs, heads, dim = 16, 8, 128  # 64 KiB per block and segment
    nb = (3 << 30) // (2 * bs * heads * dim * 2) + 1  # > 3 GiB of cache
    layer = _flash(nb, bs, heads, dim, device)
    kv = PagedKV.from_layers([layer])
    ids = list(range(nb - 1, nb // 4, -1))  # 3/4 of the blocks, the last first: > 2 GiB of staging
    n = len(ids) * kv.layout.slot_bytes
    if n <= 1 << 31:
        raise AssertionError(f"staging of {n} B does not pass 2^31")
    out = torch.empty(n, dtype=torch.uint8, device=device)
    gather_blocks(kv, ids, out)
    tail = ids[-64:]
    want = torch.empty(len(tail) * kv.layout.slot_bytes, dtype=torch.uint8, device=device)
    gather_reference(kv, tail, want, 0, bs)
    if not torch.equal(out[n - want.numel() :], want):
        raise AssertionError("gather past 2^31 differs from the torch reference")
    head = ids[:64]
    want = torch.empty(len(head) * kv.layout.slot_bytes, dtype=torch.uint8, device=device)
    gather_reference(kv, head, want, 0, bs)
    if not torch.equal(out[: want.numel()], want):
        raise AssertionError("gather of the last blocks differs from the torch reference")
    layer[:, nb - 1].zero_()
    scatter_blocks(kv, [nb - 1], out[: kv.layout.slot_bytes])
    back = torch.empty(kv.layout.slot_bytes, dtype=torch.uint8, device=device)
    gather_reference(kv, [nb - 1], back, 0, bs)
    if not torch.equal(back, out[: kv.layout.slot_bytes]):
        raise AssertionError("scatter past 2^31 differs from the torch reference")
    del out, layer


def _seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Seconds per call: events around `repeats` back-to-back calls (GPU), after a warm-up."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def bandwidth(device: torch.device, gib: float, repeats: int) -> dict[str, float]:
    """Kernel / plain-copy ratios (>1: the kernel is faster) over `gib` GiB per call."""
    bs, heads, dim, layers = 16, 8, 128, 4
    per_block = layers * 2 * bs * heads * dim * 2
    nb = max(4, int(gib * (1 << 30)) // per_block + 1)
    caches = [_flash(nb, bs, heads, dim, device) for _ in range(layers)]
    kv = PagedKV.from_layers(caches)
    ids = upload_ids(kv, list(range(nb)))
    n = nb * kv.layout.slot_bytes
    pin = device.type == "cuda"
    host = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
    dev_a = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    dev_b = torch.empty(n, dtype=torch.uint8, device=device)
    out: dict[str, float] = {}
    out["d2h"] = _seconds(lambda: host.copy_(dev_a, non_blocking=True), repeats, device) / _seconds(
        lambda: gather_blocks(kv, ids, host), repeats, device
    )
    out["h2d"] = _seconds(lambda: dev_a.copy_(host, non_blocking=True), repeats, device) / _seconds(
        lambda: scatter_blocks(kv, ids, host), repeats, device
    )
    out["d2d"] = _seconds(lambda: dev_b.copy_(dev_a), repeats, device) / _seconds(
        lambda: gather_blocks(kv, ids, dev_b), repeats, device
    )
    if device.type == "cuda":  # a host store's registered mapping vs pinned memory, the same H2D copy
        shared = torch.empty(n, dtype=torch.uint8)
        staging = Staging.for_tensor(dev_a)
        if staging.device.register_host(shared.data_ptr(), n):
            out["h2d_registered"] = _seconds(lambda: dev_a.copy_(host, non_blocking=True), repeats, device) / _seconds(
                lambda: dev_a.copy_(shared, non_blocking=True), repeats, device
            )
            staging.device.unregister_host()
    out["gib"] = n / (1 << 30)
    return out


def step(name: str, verdict: str, reason: str) -> None:
    """The step's one line that scripts/gpu_check.sh reads: ``STEP NAME VERDICT reason``."""
    print(f"STEP {name} {verdict} {reason}", flush=True)


def targets_verdict(figures: dict[str, float]) -> tuple[str, str]:
    """PASS when every ratio meets its target, else MISSED naming each miss (never silent)."""
    ratios = " ".join(f"{k}={figures[k]:.2f}x" for k in TARGETS)
    below = [f"{k} {figures[k]:.2f}<{t}" for k, t in TARGETS.items() if figures[k] < t]
    said = f"{ratios} vs plain copies, {figures['gib']:.2f} GiB/call"
    return ("MISSED", f"{said}; below target: {', '.join(below)}") if below else ("PASS", f"{said}; targets met")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run every check that a CPU can (no GPU needed)")
    p.add_argument("--gib", type=float, default=1.0, help="bytes per timed call, GiB (GPU)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(MAPPING.describe(), flush=True)
    if not args.cpu and not torch.cuda.is_available():
        for name in ("staging", "bandwidth"):
            step(name, "FAIL", "no CUDA device visible (torch.cuda.is_available() is False)")
        print("GPU_STAGING FAIL device=none (no CUDA device visible)", flush=True)
        return 2
    device = torch.device("cpu" if args.cpu else "cuda")
    status = load_extension()
    print(f"extension: {status.reason}", flush=True)
    failed: list[str] = []
    passed = 0
    checks: list[tuple[str, Callable[[], None]]] = [
        ("staging", lambda: check_staging(device)),
        ("staging-torch-path", lambda: check_staging_torch_path(device)),
        ("registered-host-load", lambda: check_registered_host_load(device)),
    ]
    if device.type == "cuda":
        checks.append(("offsets>2^31", lambda: check_large_offsets(device)))
        if not status.has_cuda:
            failed.append(f"no CUDA kernel ({status.reason})")
    t0 = time.monotonic()
    for name, fn in checks:
        try:
            fn()
            passed += 1
            print(f"ok {name}", flush=True)
        except Exception:
            failed.append(name)
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    took = time.monotonic() - t0
    if failed:
        step("staging", "FAIL", f"{passed}/{len(checks)} checks passed on {device.type}; failed: {', '.join(failed)}")
    else:
        step("staging", "PASS", f"{passed}/{len(checks)} checks on {device.type} ({took:.0f}s)")
    figures = bandwidth(device, args.gib if device.type == "cuda" else 1 / 64, args.repeats)
    ratios = " ".join(f"{k}={figures[k]:.2f}x" for k in (*TARGETS, "h2d_registered") if k in figures)
    if device.type == "cuda":
        verdict, said = targets_verdict(figures)
        step("bandwidth", verdict, said)
    else:
        step("bandwidth", "DRY", f"{ratios} on the CPU (no targets: not GPU figures)")
    print(
        f"GPU_STAGING {'PASS' if not failed else 'FAIL'} device={device.type} checks={passed}/{len(checks)} {ratios} "
        f"(vs plain copies, {figures['gib']:.2f} GiB/call; targets d2h,h2d>=0.8 d2d>=0.7)"
        f"{' failed: ' + ','.join(failed) if failed else ''}",
        flush=True,
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
