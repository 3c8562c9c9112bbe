"""The CUDA canonical kernel's indexing, checked on the CPU.

canonical_copy.cu cannot run without a GPU, but its address arithmetic lives in
canonical_copy.h (kvp_canon_unit, kvp_canon_word, kvp_canon_pick_vec). The
extension's `emulate_cuda_canonical_copy` op walks every word of every tile in the
kernel's order with those same functions and fails on a word address that is not a
multiple of the word size (a load the GPU would fault on). Here it must write the torch
reference's bytes for the GPU backends' NHD and HND caches (and vLLM's CPU packings,
which take narrower words), with object buffers at offsets that force 16-, 8-, 4-, 2-
and 1-byte words, gathering, scattering and for head sub-ranges.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.cuda_emulation import emulate_cuda
from kvpack.canonical.geometry import CanonicalGeometry, TilePacking, paged_geometry, vllm_cpu_geometry
from kvpack.ops import PagedKV, load_extension

pytestmark = pytest.mark.skipif(
    not load_extension().available, reason=f"extension unavailable: {load_extension().reason}"
)

L, NB, H, T, D = 2, 6, 4, 16, 64
IDS = [5, 0, 3]


def _values(dtype: torch.dtype) -> torch.Tensor:
    """[blocks, layers, kv, heads, tokens, dim], every element distinct."""
    n = NB * L * 2 * H * T * D
    return torch.arange(n, dtype=torch.float32).remainder(65000).to(dtype).view(NB, L, 2, H, T, D)


def _geometry(kind: str, dtype: torch.dtype) -> CanonicalGeometry:
    values = _values(dtype)
    if kind == "nhd":  # vLLM GPU flash-attn: [2, blocks, T, H, D] per layer
        return paged_geometry(
            PagedKV.from_layers([values[:, l].permute(1, 0, 3, 2, 4).contiguous() for l in range(L)], block_size=T)
        )
    if kind == "hnd":  # [2, blocks, H, T, D]
        return paged_geometry(
            PagedKV.from_layers([values[:, l].permute(1, 0, 2, 3, 4).contiguous() for l in range(L)], block_size=T)
        )
    e = values.element_size()
    k = TilePacking.panels(1, T, D, e) if kind == "vec" else TilePacking.panels(2, 16, D, e)
    v = TilePacking.row_major(D * e, D, e, T) if kind == "vec" else TilePacking.token_pairs(2, 16, T, e)
    geo = vllm_cpu_geometry([torch.zeros((NB, H, T, 2 * D), dtype=dtype) for _ in range(L)], k, v)
    geo.copy(
        list(range(NB)), values.contiguous().view(torch.uint8).view(-1), gather=False, obj_heads=H, use_kernel=False
    )
    return geo


def _blank_like(geo: CanonicalGeometry) -> CanonicalGeometry:
    from dataclasses import replace

    tensors = tuple(torch.zeros_like(t) for t in geo.tensors)
    shift = [t.data_ptr() - o.data_ptr() for t, o in zip(tensors, geo.tensors)]
    per = len(geo.bases) // len(geo.tensors)
    bases = (
        tuple(b + shift[i // per] for i, b in enumerate(geo.bases))
        if len(geo.tensors) > 1
        else tuple(b + shift[0] for b in geo.bases)
    )
    return replace(geo, tensors=tensors, bases=bases)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["nhd", "hnd", "vec", "amx"])
@pytest.mark.parametrize("offset", [0, 8, 4, 2, 1])
def test_emulated_kernel_writes_the_references_bytes(kind: str, dtype: torch.dtype, offset: int) -> None:
    geo = _geometry(kind, dtype)
    nbytes = len(IDS) * geo.object_bytes(H)
    want = torch.zeros(nbytes, dtype=torch.uint8)
    geo.copy(IDS, want, gather=True, obj_heads=H, use_kernel=False)
    buf = torch.full((nbytes + offset,), 0xAB, dtype=torch.uint8)
    vec = emulate_cuda(geo, IDS, buf[offset:], gather=True, obj_heads=H)
    assert torch.equal(buf[offset:], want)
    assert bool((buf[:offset] == 0xAB).all())
    if kind in ("nhd", "hnd"):  # GPU layouts: the widest word the object offset allows
        assert vec == min(16, offset & -offset if offset else 16)
    back = _blank_like(geo)
    emulate_cuda(back, IDS, buf[offset:], gather=False, obj_heads=H)
    ref = _blank_like(geo)
    ref.copy(IDS, want, gather=False, obj_heads=H, use_kernel=False)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(back.tensors, ref.tensors))


@pytest.mark.parametrize("kind", ["nhd", "hnd"])
def test_emulated_kernel_copies_a_head_range(kind: str) -> None:
    """Heads [1, 3) of a 4-head object from cache heads [2, 4): a TP rank's part."""
    geo = _geometry(kind, torch.bfloat16)
    nbytes = len(IDS) * geo.object_bytes(H)
    want = torch.zeros(nbytes, dtype=torch.uint8)
    got = torch.zeros(nbytes, dtype=torch.uint8)
    geo.copy(IDS, want, gather=True, obj_heads=H, obj_h0=1, cache_h0=2, n_heads=2, use_kernel=False)
    emulate_cuda(geo, IDS, got, gather=True, obj_heads=H, obj_h0=1, cache_h0=2, n_heads=2)
    assert torch.equal(got, want)


def test_emulation_catches_misaligned_words() -> None:
    """A 16-byte word claimed for bases that are only 2-byte aligned is a fault, reported."""
    geo = _geometry("nhd", torch.bfloat16)
    table = torch.tensor([b + 2 for b in geo.bases], dtype=torch.int64)
    fields = geo._fields(H, 0, 0, H)
    fields[0] = 1  # one layer: the shifted bases stay inside the tensors
    out = torch.zeros(len(IDS) * geo.object_bytes(H), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="misaligned"):
        torch.ops.kvpack.emulate_cuda_canonical_copy(
            list(geo.tensors), table[:2], torch.tensor(IDS), out, fields, 16, True
        )
