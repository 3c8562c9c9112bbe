"""Canonical objects (`kvpack.canonical`): the C++ kernel and the torch reference write
the same bytes for every tile packing, and those bytes are the K/V values in the documented
order ``[layer][kv][head][token][dim]`` whatever the engine's layout.

The packings are the ones vLLM's CPU ISAs use (`vllm_plugin.packing` finds them at start-up;
tests/vllm/test_canonical_packing.py checks them against vLLM's own write kernel), plus a
split no fast path covers (element by element). Each case fills a cache through the
reference scatter from known K/V, gathers with both backends, and compares with the K/V.
"""

from __future__ import annotations

import pytest
import torch
from canonical_caches import same_bytes, vllm_cpu_cache

from kvpack.canonical.geometry import (
    CpuSimd,
    TilePacking,
    cpu_simd,
    paged_geometry,
    vllm_cpu_geometry,
)
from kvpack.ops import PagedKV, load_extension

L, NB, H, T, D = 3, 12, 4, 32, 64
IDS = [7, 0, 11, 3]

PACKINGS = {
    "rows": lambda e: TilePacking.row_major(D * e, D, e, T),
    "vec-K": lambda e: TilePacking.panels(1, T, D, e),
    "vec16-K": lambda e: TilePacking.panels(1, 16, D, e),
    "amx-K": lambda e: TilePacking.panels(2, 16, D, e),
    "amx-V": lambda e: TilePacking.token_pairs(2, 16, T, e),
    "panels4": lambda e: TilePacking.panels(4, 8, D, e),
    "pairs4x32": lambda e: TilePacking.token_pairs(4, 32, T, e),
}

needs_kernel = pytest.mark.skipif(not load_extension().available, reason="no C++ compiler: the kernel is not built")


def kv_values(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[blocks, layers, kv, heads, tokens, dim] distinct values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((NB, L, 2, H, T, D), generator=g).to(dtype)


def filled_cpuvllm_cpu_cache(dtype: torch.dtype, k: TilePacking, v: TilePacking, values: torch.Tensor):  # type: ignore[no-untyped-def]
    tensors = [torch.zeros((NB, H, T, 2 * D), dtype=dtype) for _ in range(L)]
    geo = vllm_cpu_geometry(tensors, k, v)
    objs = values.contiguous().view(torch.uint8).view(-1)
    geo.copy(list(range(NB)), objs, gather=False, obj_heads=H, use_kernel=False)
    return geo


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k_name", ["vec-K", "vec16-K", "amx-K", "panels4", "rows"])
@pytest.mark.parametrize("v_name", ["rows", "amx-V", "pairs4x32"])
def test_kernel_and_reference_gather_the_kv_values(dtype: torch.dtype, k_name: str, v_name: str) -> None:
    e = torch.tensor([], dtype=dtype).element_size()
    values = kv_values(dtype, 1)
    geo = filled_cpuvllm_cpu_cache(dtype, PACKINGS[k_name](e), PACKINGS[v_name](e), values)
    want = values[IDS].contiguous().view(torch.uint8).view(-1)
    for kernel in (True, False):
        out = torch.zeros(len(IDS) * geo.object_bytes(H), dtype=torch.uint8)
        geo.copy(IDS, out, gather=True, obj_heads=H, use_kernel=kernel)
        assert torch.equal(out, want), f"kernel={kernel}"
    # a different packing of the same values is a different cache, but the same objects
    other = filled_cpuvllm_cpu_cache(dtype, PACKINGS["rows"](e), PACKINGS["rows"](e), values)
    assert not all(torch.equal(a, b) for a, b in zip(geo.tensors, other.tensors)) or (k_name, v_name) == (
        "rows",
        "rows",
    )


@needs_kernel
@pytest.mark.parametrize("k_name", ["vec-K", "amx-K", "panels4"])
@pytest.mark.parametrize("v_name", ["rows", "amx-V"])
def test_kernel_scatters_a_head_range_where_the_reference_does(k_name: str, v_name: str) -> None:
    """Heads [1, 3) of a 4-head object into cache heads [0, 2): what a TP=2 rank 0 of a
    4-head model... here any other head range: the bytes outside it stay untouched."""
    dtype = torch.bfloat16
    e = 2
    src = kv_values(dtype, 2)
    objs = src[IDS].contiguous().view(torch.uint8).view(-1)
    caches = []
    for kernel in (True, False):
        tensors = [torch.full((NB, 2, T, 2 * D), 7.0, dtype=dtype) for _ in range(L)]
        geo = vllm_cpu_geometry(tensors, PACKINGS[k_name](e), PACKINGS[v_name](e))
        geo.copy(IDS, objs, gather=False, obj_heads=H, obj_h0=1, cache_h0=0, n_heads=2, use_kernel=kernel)
        caches.append(geo)
    assert all(torch.equal(a, b) for a, b in zip(caches[0].tensors, caches[1].tensors))
    out = torch.zeros(len(IDS) * caches[0].object_bytes(2), dtype=torch.uint8)
    caches[0].copy(IDS, out, gather=True, obj_heads=2)
    assert torch.equal(out.view(dtype).view(len(IDS), L, 2, 2, T, D), src[IDS][:, :, :, 1:3])
    untouched = [b for b in range(NB) if b not in IDS]
    assert all(bool((t[untouched] == 7.0).all()) for t in caches[0].tensors)


@pytest.mark.parametrize("shape_kind", ["nhd", "hnd"])
def test_token_major_layouts_give_the_same_objects(shape_kind: str) -> None:
    """vLLM GPU-style ``[2, blocks, T, H, D]`` (NHD) and ``[2, blocks, H, T, D]`` (HND) caches,
    here on the CPU: row-major tiles at other strides, the same canonical bytes."""
    values = kv_values(torch.float32, 3)
    if shape_kind == "nhd":
        tensors = [values[:, l].permute(1, 0, 3, 2, 4).contiguous() for l in range(L)]  # [2, B, T, H, D]
    else:
        tensors = [values[:, l].permute(1, 0, 2, 3, 4).contiguous() for l in range(L)]  # [2, B, H, T, D]
    geo = paged_geometry(PagedKV.from_layers(tensors, block_size=T))
    out = torch.zeros(len(IDS) * geo.object_bytes(H), dtype=torch.uint8)
    geo.copy(IDS, out, gather=True, obj_heads=H)
    assert torch.equal(out, values[IDS].contiguous().view(torch.uint8).view(-1))


def test_a_head_range_outside_the_cache_is_refused() -> None:
    geo = filled_cpuvllm_cpu_cache(
        torch.float32, PACKINGS["vec-K"](4), PACKINGS["rows"](4), kv_values(torch.float32, 4)
    )
    out = torch.zeros(geo.object_bytes(H), dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not map"):
        geo.copy([0], out, gather=True, obj_heads=H, obj_h0=2, cache_h0=3, n_heads=2)
    with pytest.raises(IndexError):
        geo.copy([NB], out, gather=True, obj_heads=H)


def _streamed_bytes() -> int:
    """A copy size the kernel streams on this CPU: it streams calls of at least 16x the
    per-core L2 (`stream_min_bytes` in csrc/canonical_copy_cpu.cpp); 20x, and >= 64 MiB."""
    import os

    try:
        l2 = int(os.sysconf("SC_LEVEL2_CACHE_SIZE"))
    except (ValueError, OSError):
        l2 = 0
    return max(64 << 20, 20 * (l2 if l2 > 0 else 1 << 20))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "k_name,v_name", [("vec-K", "rows"), ("amx-K", "amx-V"), ("vec16-K", "rows"), ("panels4", "pairs4x32")]
)
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
def test_copies_larger_than_the_caches_write_the_references_bytes(
    dtype: torch.dtype, k_name: str, v_name: str, misaligned: bool
) -> None:
    """DRAM-sized calls take the streamed path (prefetched source, bounce buffer,
    non-temporal stores); a misaligned object buffer falls back to plain stores. Both
    must write exactly the torch reference's bytes, gathering and scattering."""
    e = torch.tensor([], dtype=dtype).element_size()
    offset = e if misaligned else 0  # one element: not 16-byte aligned
    heads, tokens, dim = 8, 128, 128
    per_block = 2 * heads * tokens * dim * e
    layers = 4
    nb = -(-_streamed_bytes() // (layers * per_block))
    k, v = _at(k_name, e, tokens, dim), _at(v_name, e, tokens, dim)
    src = vllm_cpu_cache(nb, layers, heads, tokens, dim, dtype, k, v, seed=11)
    ids = list(range(nb - 1, -1, -1))
    nbytes = nb * src.object_bytes(heads)
    assert nbytes >= _streamed_bytes() - layers * per_block
    outs = []
    for kernel in (True, False):
        buf = torch.zeros(nbytes + offset, dtype=torch.uint8)
        src.copy(ids, buf[offset:], gather=True, obj_heads=heads, use_kernel=kernel)
        outs.append(buf[offset:])
    assert torch.equal(outs[0], outs[1]), "streamed gather differs from the reference"
    back = []
    for kernel in (True, False):
        dst = vllm_cpu_cache(nb, layers, heads, tokens, dim, dtype, k, v)
        buf = torch.zeros(nbytes + offset, dtype=torch.uint8)
        buf[offset:].copy_(outs[1])
        dst.copy(ids, buf[offset:], gather=False, obj_heads=heads, use_kernel=kernel)
        back.append(dst)
    assert same_bytes(back[0], back[1]), "streamed scatter differs"
    assert same_bytes(back[0], src), "gather then scatter is not the identity"


@needs_kernel
@pytest.mark.parametrize("simd", list(CpuSimd), ids=[s.name.lower() for s in CpuSimd])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "k_name,v_name", [("vec-K", "rows"), ("amx-K", "amx-V"), ("vec16-K", "rows"), ("panels4", "pairs4x32")]
)
def test_every_simd_level_the_cpu_has_writes_the_references_bytes(
    simd: CpuSimd, dtype: torch.dtype, k_name: str, v_name: str
) -> None:
    """The kernel runs the widest SIMD level the CPU has: AVX-512 blocks of whole 64-byte
    rows, SSE2 blocks, or scalar code (CPUs without SSE2). Capped at each level this CPU
    has, in-cache calls gather and scatter exactly the torch reference's bytes. Tiles of
    64 tokens x 128 dims take the AVX-512 blocks (32x32 2-byte units, 16x16 4-byte units,
    token pairs 32 dims at a time); `vec16-K`'s 16-token panels and `panels4` fall back."""
    have = cpu_simd()
    if have is None or simd > have:
        pytest.skip(f"this CPU's canonical copy runs {have.name if have is not None else 'no kernel'}, not {simd.name}")
    e = torch.tensor([], dtype=dtype).element_size()
    nb, layers, heads, tokens, dim = 6, 2, 2, 64, 128
    k, v = _at(k_name, e, tokens, dim), _at(v_name, e, tokens, dim)
    src = vllm_cpu_cache(nb, layers, heads, tokens, dim, dtype, k, v, seed=int(simd) + 20)
    ids = [4, 1, 5]
    want = torch.zeros(len(ids) * src.object_bytes(heads), dtype=torch.uint8)
    src.copy(ids, want, gather=True, obj_heads=heads, use_kernel=False)
    got = torch.zeros_like(want)
    assert src.copy_at_simd(ids, got, gather=True, obj_heads=heads, simd=simd) == simd
    assert torch.equal(got, want), f"{simd.name} gather differs from the reference"
    ref, dst = (vllm_cpu_cache(nb, layers, heads, tokens, dim, dtype, k, v) for _ in range(2))
    ref.copy(ids, want, gather=False, obj_heads=heads, use_kernel=False)
    dst.copy_at_simd(ids, want, gather=False, obj_heads=heads, simd=simd)
    assert same_bytes(dst, ref), f"{simd.name} scatter differs from the reference"


def _at(name: str, e: int, tokens: int, dim: int) -> TilePacking:
    """`PACKINGS[name]` for a tile of `tokens` x `dim`."""
    return {
        "rows": lambda: TilePacking.row_major(dim * e, dim, e, tokens),
        "vec-K": lambda: TilePacking.panels(1, tokens, dim, e),
        "vec16-K": lambda: TilePacking.panels(1, 16, dim, e),
        "amx-K": lambda: TilePacking.panels(2, 16, dim, e),
        "amx-V": lambda: TilePacking.token_pairs(2, 16, tokens, e),
        "panels4": lambda: TilePacking.panels(4, 8, dim, e),
        "pairs4x32": lambda: TilePacking.token_pairs(4, 32, tokens, e),
    }[name]()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_streamed_scatter_of_token_major_rows_writes_the_references_bytes(dtype: torch.dtype) -> None:
    """A DRAM-sized scatter into a token-major cache (a run of one head's dims per token at
    a stride: SGLang's ``page_first`` host pools, vLLM's NHD) streams each run with
    non-temporal stores; it must write exactly the torch reference's bytes, and only them."""
    e = torch.tensor([], dtype=dtype).element_size()
    layers, heads, tokens, dim = 4, 2, 64, 128
    per_block = 2 * tokens * heads * dim * e
    nb = 2 * -(-_streamed_bytes() // (layers * per_block)) + 1
    g = torch.Generator().manual_seed(5)
    src = [torch.randn((2, nb, tokens, heads, dim), generator=g).to(dtype) for _ in range(layers)]
    geo = paged_geometry(PagedKV.from_layers(src, block_size=tokens))
    ids = list(range(nb - 1, 0, -2))  # every other block: the blocks between stay as they were
    objs = torch.zeros(len(ids) * geo.object_bytes(heads), dtype=torch.uint8)
    geo.copy(ids, objs, gather=True, obj_heads=heads, use_kernel=False)
    assert len(ids) * layers * per_block >= _streamed_bytes()
    outs = []
    for kernel in (True, False):
        dst = [torch.full_like(t, 3.0) for t in src]
        paged_geometry(PagedKV.from_layers(dst, block_size=tokens)).copy(
            ids, objs, gather=False, obj_heads=heads, use_kernel=kernel
        )
        outs.append(dst)
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "streamed row scatter differs"
    assert all(torch.equal(d[:, ids], s[:, ids]) for d, s in zip(outs[0], src))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", ["all", "range"])
def test_streamed_gather_of_token_major_pages_writes_the_kv_values(dtype: torch.dtype, heads: str) -> None:
    """A DRAM-sized gather out of SGLang ``page_first`` pages (``[2, tokens, layers, heads,
    dim]``) walks each page in address order, token by token, streaming every (layer, head)
    row to its tile; the objects must hold exactly the pool's K/V values in the canonical
    order ``[layer][kv][head][token][dim]``, for every head or a head range (into heads
    1-2 of 3-head objects, head 0 left as it was), and equal the torch reference's bytes."""
    e = torch.tensor([], dtype=dtype).element_size()
    layers, n_heads, tokens, dim = 3, 4, 64, 128
    h0, count, obj_heads, obj_h0 = (0, n_heads, n_heads, 0) if heads == "all" else (1, 2, 3, 1)
    per_page = 2 * layers * count * tokens * dim * e
    pages = -(-_streamed_bytes() // per_page) + 3
    g = torch.Generator().manual_seed(9)
    buf = torch.randn((2, pages * tokens, layers, n_heads, dim), generator=g).to(dtype)
    geo = paged_geometry(PagedKV.from_sglang_host_pool(buf, "page_first", page_size=tokens))
    ids = list(range(pages - 1, 2, -1)) + [0]  # pages 1 and 2 not asked for
    assert len(ids) * per_page >= _streamed_bytes()
    outs = []
    for kernel in (True, False):
        objs = torch.full((len(ids) * geo.object_bytes(obj_heads),), 7, dtype=torch.uint8)
        geo.copy(
            ids, objs, gather=True, obj_heads=obj_heads, obj_h0=obj_h0, cache_h0=h0, n_heads=count, use_kernel=kernel
        )
        outs.append(objs)
    got = outs[0].view(len(ids), layers, 2, obj_heads, -1)
    want = buf.view(2, pages, tokens, layers, n_heads, dim)[:, ids, :, :, h0 : h0 + count]
    want = want.permute(1, 3, 0, 4, 2, 5).contiguous().view(torch.uint8).view(len(ids), layers, 2, count, -1)
    assert torch.equal(got[:, :, :, obj_h0 : obj_h0 + count], want), "streamed gather is not the pool's K/V values"
    assert bool((got[:, :, :, :obj_h0] == 7).all()), "streamed gather wrote outside its head range"
    assert torch.equal(outs[0], outs[1]), "streamed token-major gather differs from the reference"
