"""The GPU check's vllm-views step: vLLM 0.32+'s per-layer block views as canonical objects.

vLLM hands a connector one ``[B, H, N, C]`` view per layer of one int8 buffer, in one of six
stride orders (`ORDERS`, ``vllm.v1.kv_cache_layout.KVCacheLayout``); the GPU machine has no
vLLM, so the views are built here the way ``create_kv_cache_views`` builds them: contiguous
strides in the order's physical axis order over ``[L, B * ratio, H, N / ratio, C]`` bytes, one
``torch.as_strided`` view per layer, viewed as the cache dtype. Kernel-block splits (``ratio``
> 1) only where vLLM allows them (a block is one dense page: LBHNC, LBNHC).

For each order, full attention (K|V cells) and MLA (one 576-wide latent), the same logical
bytes are written into every order's buffer; `CanonicalGeometry.from_block_views` must give the
same canonical objects from each, on `device` by the kernel (device and, on a GPU, pinned
staging) and by the torch path, as from LBHNC on the CPU by the torch path; and scattering
them into a zeroed buffer of the same order must give back the blocks' bytes.
Used by tests/ops/gpu_check.py (on the CPU with ``--dry-run``).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import torch

# KVCacheLayout: physical position -> logical axis of [L, B, H, N, C]
ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
SPLITTABLE = ("LBHNC", "LBNHC")
DRY_RUN_CASES = (
    "LBNHC/mha/bfloat16/ratio1",
    "BHLNC/mla/bfloat16/ratio1",
    "LBHNC/mha/bfloat16/ratio2",
)  # a block is one dense page: vLLM splits it into kernel blocks


@dataclass(frozen=True)
class ViewCase:
    """One cache: `heads` KV heads of K `head_size` + V `head_size_v` elements (0: MLA latent)."""

    order: str
    heads: int
    head_size: int
    head_size_v: int
    dtype: torch.dtype
    ratio: int = 1  # kernel blocks per allocator block
    layers: int = 3
    blocks: int = 8  # allocator blocks
    tokens: int = 16  # per allocator block

    @property
    def name(self) -> str:
        kind = "mla" if self.head_size_v == 0 else "mha"
        return f"{self.order}/{kind}/{str(self.dtype).removeprefix('torch.')}/ratio{self.ratio}"

    def logical_bytes(self) -> tuple[int, int, int, int, int]:
        """[L, kernel blocks, H, kernel tokens, C bytes]."""
        cell = (self.head_size + self.head_size_v) * self.dtype.itemsize
        return (self.layers, self.blocks * self.ratio, self.heads, self.tokens // self.ratio, cell)


def cases(quick: bool) -> list[ViewCase]:
    """Every order x (full attention, MLA), kernel-block splits where vLLM allows them."""
    out = []
    for order in ORDERS:
        out.append(ViewCase(order, 4, 64, 64, torch.bfloat16))
        out.append(ViewCase(order, 1, 576, 0, torch.bfloat16))
        if not quick:
            out.append(ViewCase(order, 2, 128, 128, torch.float16))
    out += [ViewCase(order, 4, 64, 64, torch.bfloat16, ratio=2) for order in SPLITTABLE]
    return out


def build_views(case: ViewCase, buf: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer [B, H, N, C] views of `buf` (int8 bytes) in `case.order`, as vLLM builds them."""
    size = case.logical_bytes()
    strides = [0] * 5
    step = 1
    for axis in reversed(ORDERS[case.order]):
        strides[axis] = step
        step *= size[axis]
    assert buf.numel() == step, (buf.numel(), step)
    return [
        torch.as_strided(buf, size[1:], strides[1:], buf.storage_offset() + layer * strides[0]).view(case.dtype)
        for layer in range(case.layers)
    ]


def _fill(case: ViewCase, buf: torch.Tensor, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Writes each layer's logical bytes [B, H, N, C] into `buf`'s views; returns the views."""
    views = build_views(case, buf)
    for view, v in zip(views, values):
        view.view(torch.int8).copy_(v.to(buf.device))
    return views


def check_case(case: ViewCase, device: torch.device) -> None:
    """Canonical objects of `case` on `device`, every path, == LBHNC's on the CPU; and back."""
    from kvpack.canonical.geometry import CanonicalGeometry

    size = case.logical_bytes()
    rng = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    values = [torch.randint(-128, 128, size[1:], dtype=torch.int8, generator=rng) for _ in range(case.layers)]
    n_bytes = 1
    for s in size:
        n_bytes *= s

    def geometry(views: list[torch.Tensor]) -> CanonicalGeometry:
        return CanonicalGeometry.from_block_views(
            views, case.blocks, heads=case.heads, head_size=case.head_size, head_size_v=case.head_size_v
        )

    ids = random.Random(case.name).sample(range(case.blocks), 5)
    ref_case = ViewCase("LBHNC", case.heads, case.head_size, case.head_size_v, case.dtype, case.ratio)
    ref_geo = geometry(_fill(ref_case, torch.zeros(n_bytes, dtype=torch.int8), values))
    obj = ref_geo.object_bytes(case.heads)
    want = torch.empty(len(ids) * obj, dtype=torch.uint8)
    ref_geo.copy(ids, want, gather=True, obj_heads=case.heads, use_kernel=False)

    views = _fill(case, torch.zeros(n_bytes, dtype=torch.int8, device=device), values)
    geo = geometry(views)
    paths = [("kernel", True, device), ("torch path", False, device)]
    if device.type == "cuda":
        paths.append(("kernel, pinned staging", True, torch.device("cpu")))
    for path, kernel, where in paths:
        staging = torch.full((len(ids) * obj,), 0xAB, dtype=torch.uint8, device=where)
        if where.type == "cpu" and device.type == "cuda":
            staging = staging.pin_memory()
        geo.copy(ids, staging, gather=True, obj_heads=case.heads, use_kernel=kernel)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if not torch.equal(staging.cpu(), want):
            raise AssertionError(f"{case.name}: {path}: objects differ from LBHNC's on the CPU")
        back_buf = torch.zeros(n_bytes, dtype=torch.int8, device=device)
        back = build_views(case, back_buf)
        geometry(back).copy(ids, staging, gather=False, obj_heads=case.heads, use_kernel=kernel)
        if device.type == "cuda":
            torch.cuda.synchronize()
        for layer, (got, v) in enumerate(zip(back, values)):
            for b in ids:
                kernel_blocks = slice(b * case.ratio, (b + 1) * case.ratio)
                if not torch.equal(got.view(torch.int8)[kernel_blocks].cpu(), v[kernel_blocks]):
                    raise AssertionError(f"{case.name}: {path}: scatter lost layer {layer} block {b}")


def api_missing() -> str | None:
    """Why this tree cannot map block views (None: it can)."""
    from kvpack.canonical.geometry import CanonicalGeometry

    if not hasattr(CanonicalGeometry, "from_block_views"):
        return "kvpack.canonical has no CanonicalGeometry.from_block_views (the vLLM block-view mapping)"
    return None


def run(device: torch.device, quick: bool) -> tuple[str, str]:
    """The step's verdict and reason: every case on `device` (the CPU in a dry run: DRY)."""
    import time
    import traceback

    missing = api_missing()
    if missing:
        return ("SKIP" if device.type == "cpu" else "FAIL"), missing
    t0 = time.monotonic()
    todo = cases(quick)
    if device.type == "cpu":  # a dry run: the step's code on one full, one MLA and one split cache
        todo = [c for c in todo if c.name in DRY_RUN_CASES]
    failed = []
    for case in todo:
        try:
            check_case(case, device)
        except Exception:
            failed.append(case.name)
            print(f"FAIL vllm-views {case.name}\n{traceback.format_exc()}", flush=True)
    if failed:
        return "FAIL", f"{len(failed)} of {len(todo)} caches differ: {', '.join(failed)}"
    what = (
        f"{len(todo)} caches on the CPU (the GPU run checks all 6 orders)"
        if device.type == "cpu"
        else f"{len(todo)} caches (6 orders, full attention and MLA, kernel-block splits) on {device.type}"
    )
    return ("DRY" if device.type == "cpu" else "PASS"), f"{what} ({time.monotonic() - t0:.0f}s)"
