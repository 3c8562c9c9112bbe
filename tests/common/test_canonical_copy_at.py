"""`CanonicalGeometry.copy_at`: blocks <-> objects each at its own host address (a memory
tier's slots), one kernel call over the batch (`kvpack::canonical_copy_at`). For every
packing family, KV dtype size and SIMD level this CPU has, and for addresses ascending,
reversed, scattered, in the arena's short runs and misaligned, it must write exactly the
bytes the contiguous copy (torch reference) writes, and no byte outside the objects; the
same at DRAM size (streamed paths, SGLang ``page_first`` pages' token-major gather).
"""

from __future__ import annotations

import random

import pytest
import torch
from canonical_caches import same_bytes, vllm_cpu_cache

from kvpack.canonical.geometry import (
    CanonicalGeometry,
    CpuSimd,
    TilePacking,
    cpu_simd,
    paged_geometry,
)
from kvpack.ops import PagedKV, load_extension

needs_kernel = pytest.mark.skipif(not load_extension().available, reason="no C++ compiler: the kernel is not built")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]
CANARY = 0x5A


def _packings(name: str, e: int, tokens: int, dim: int) -> tuple[TilePacking, TilePacking]:
    """(K, V) packings: row-major tiles (GPU, SGLang), vLLM CPU `vec` and `amx`."""
    rows = TilePacking.row_major(dim * e, dim, e, tokens)
    return {
        "rows": (rows, rows),
        "vec": (TilePacking.panels(1, tokens, dim, e), rows),
        "amx": (TilePacking.panels(2, 16, dim, e), TilePacking.token_pairs(2, 16, tokens, e)),
    }[name]


def _cache(nb: int, layers: int, heads: int, tokens: int, dim: int, dtype: torch.dtype, pk: str, seed: int | None):
    """`vllm_cpu_cache` with the packing family `pk`."""
    e = torch.tensor([], dtype=dtype).element_size()
    return vllm_cpu_cache(nb, layers, heads, tokens, dim, dtype, *_packings(pk, e, tokens, dim), seed=seed)


def _slots(n: int, size: int, order: str, seed: int) -> list[int]:
    """Offsets of n objects of `size` bytes inside a buffer of 3n + 1 slots (distinct, apart)."""
    rng = random.Random(seed)
    if order == "ascending":
        return [i * size for i in range(n)]
    if order == "reversed":
        return [(3 * n - 1 - i) * size for i in range(n)]
    if order == "scattered":
        return [i * size for i in rng.sample(range(3 * n), n)]
    if order == "arena runs":  # runs of 1, 1, 2, 4, ... slots, each run below the last (new slabs)
        out, start, width = [], 3 * n, 1
        while len(out) < n:
            width = min(width, n - len(out))
            start -= width + 1
            out += [(start + k) * size for k in range(width)]
            width = width * 2 if len(out) > 1 else 1
        return out
    assert order == "misaligned", order  # scattered, and no object on a 16-byte boundary
    return [i * size + 8 for i in rng.sample(range(3 * n), n)]


ORDERS = ["ascending", "reversed", "scattered", "arena runs", "misaligned"]


def _check_order(src: CanonicalGeometry, make_dst, ids: list[int], order: str, simd: CpuSimd | None) -> None:  # type: ignore[no-untyped-def]
    """Gather from `src` and scatter into a fresh `make_dst()` through objects at `order`'s
    addresses, with the kernel at `simd` (None: the torch path by runs); both must match
    the contiguous torch reference, and the gather must write nothing between objects."""
    size, n = src.object_bytes(src.heads), len(ids)
    want = torch.zeros(n * size, dtype=torch.uint8)
    src.copy(ids, want, gather=True, obj_heads=src.heads, use_kernel=False)
    rows = want.view(n, size)
    offsets = _slots(n, size, order, seed=len(ids))
    assert len(set(offsets)) == n
    buf = torch.full((3 * n * size + 64,), CANARY, dtype=torch.uint8)
    addrs = [buf.data_ptr() + o for o in offsets]
    kernel = simd is not None
    used = src.copy_at(ids, addrs, gather=True, use_kernel=kernel, simd=CpuSimd.AVX512 if simd is None else simd)
    assert used == simd, f"{order}: copied at {used}, asked {simd}"
    for i, o in enumerate(offsets):
        assert torch.equal(buf[o : o + size], rows[i]), f"{order}: gather of object {i} (block {ids[i]}) differs"
        buf[o : o + size] = CANARY
    assert bool((buf == CANARY).all()), f"{order}: the gather wrote outside its objects"
    for i, o in enumerate(offsets):
        buf[o : o + size] = rows[i]
    ref, dst = make_dst(), make_dst()
    ref.copy(ids, want, gather=False, obj_heads=ref.heads, use_kernel=False)
    dst.copy_at(ids, addrs, gather=False, use_kernel=kernel, simd=CpuSimd.AVX512 if simd is None else simd)
    assert same_bytes(dst, ref), f"{order}: scatter differs from the reference"


@needs_kernel
@pytest.mark.parametrize("simd", list(CpuSimd), ids=[s.name.lower() for s in CpuSimd])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16", "fp8"])
@pytest.mark.parametrize("pk", ["rows", "vec", "amx"])
def test_objects_at_any_addresses_hold_the_contiguous_copys_bytes(simd: CpuSimd, dtype: torch.dtype, pk: str) -> None:
    have = cpu_simd()
    if have is None or simd > have:
        pytest.skip(f"this CPU's canonical copy runs {have.name if have is not None else 'no kernel'}, not {simd.name}")
    nb, layers, heads, tokens, dim = 24, 2, 2, 32, 64
    src = _cache(nb, layers, heads, tokens, dim, dtype, pk, seed=int(simd) * 7 + len(pk))
    ids = random.Random(5).sample(range(nb), 13)
    for order in ORDERS:
        _check_order(src, lambda: _cache(nb, layers, heads, tokens, dim, dtype, pk, None), ids, order, simd)


@pytest.mark.parametrize("pk", ["rows", "amx"])
def test_without_the_kernel_objects_at_any_addresses_are_copied_by_runs(pk: str) -> None:
    """`use_kernel=False` (what runs without a compiler): one torch copy per run of adjacent
    objects, the same bytes."""
    nb, layers, heads, tokens, dim = 16, 2, 2, 32, 64
    src = _cache(nb, layers, heads, tokens, dim, torch.bfloat16, pk, seed=3)
    ids = random.Random(6).sample(range(nb), 11)
    for order in ORDERS:
        _check_order(src, lambda: _cache(nb, layers, heads, tokens, dim, torch.bfloat16, pk, None), ids, order, None)


def _streamed_bytes() -> int:
    """A call size the kernel streams on this CPU (>= 16x the per-core L2; see
    test_canonical_copy.py): 20x, and at least 64 MiB."""
    import os

    try:
        l2 = int(os.sysconf("SC_LEVEL2_CACHE_SIZE"))
    except (ValueError, OSError):
        l2 = 0
    return max(64 << 20, 20 * (l2 if l2 > 0 else 1 << 20))


@needs_kernel
@pytest.mark.parametrize("cache", ["page_first", "vec"])
@pytest.mark.parametrize("order", ["arena runs", "scattered", "misaligned"])
def test_dram_sized_batches_at_any_addresses_hold_the_contiguous_copys_bytes(cache: str, order: str) -> None:
    """At DRAM size the kernel streams (non-temporal stores; SGLang ``page_first`` pages
    gathered token by token in address order; misaligned objects fall back to plain
    stores): one call over the batch, exactly the reference's bytes both ways."""
    dtype, tokens, dim, layers, heads = torch.bfloat16, 64, 128, 3, 4
    per_block = 2 * layers * heads * tokens * dim * 2
    nb = -(-_streamed_bytes() // per_block) + 4

    def make(seed: int | None) -> CanonicalGeometry:
        if cache == "vec":
            return _cache(nb, layers, heads, tokens, dim, dtype, "vec", seed)
        buf = torch.zeros((2, nb * tokens, layers, heads, dim), dtype=dtype)
        if seed is not None:
            g = torch.Generator().manual_seed(seed)
            buf.view(torch.uint8).copy_(
                torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8, generator=g)
            )
        return paged_geometry(PagedKV.from_sglang_host_pool(buf, "page_first", page_size=tokens))

    ids = random.Random(8).sample(range(nb), nb - 3)
    assert len(ids) * per_block >= _streamed_bytes()
    _check_order(make(13), lambda: make(None), ids, order, CpuSimd(cpu_simd() or 0))


@needs_kernel
def test_a_wrong_address_count_or_block_id_is_refused() -> None:
    geo = _cache(4, 1, 1, 16, 64, torch.float32, "rows", seed=1)
    buf = torch.zeros(2 * geo.object_bytes(1), dtype=torch.uint8)
    with pytest.raises(ValueError, match="2 object addresses for 1 blocks"):
        geo.copy_at([0], [buf.data_ptr(), buf.data_ptr() + geo.object_bytes(1)], gather=True)
    for kernel in (True, False):
        with pytest.raises(IndexError):
            geo.copy_at([4], [buf.data_ptr()], gather=True, use_kernel=kernel)
