"""The core's part of vLLM's ``[B, H, N, C]`` views: the overlap proof, the device decision,
and the canonical mapping's refusals (the views vLLM's own allocator builds are in
tests/vllm/test_gpu_cache_layouts.py; here one byte buffer is viewed in a stride order the
way that allocator does, so the core is checked without vLLM).
"""

from __future__ import annotations

import pytest
import torch

from kvpack.canonical.geometry import CanonicalGeometry
from kvpack.canonical.vllm_views import stride_order
from kvpack.errors import LayoutError
from kvpack.ops import KVLayoutKind, PagedKV
from kvpack.ops.layout import rows_overlap, vllm_layer_kind

L, B, H, N, D = 2, 5, 3, 4, 8
C = 2 * D


def _views(order: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Per-layer [B, H, N, C] views of one buffer laid out in `order` (e.g. ``LHBNC``): the
    dims' strides are the products of the sizes of the dims physically inside them."""
    sizes = {"L": L, "B": B, "H": H, "N": N, "C": C}
    strides: dict[str, int] = {}
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= sizes[dim]
    buf = torch.arange(step, dtype=torch.float32).to(dtype).to(device)
    return [
        buf.as_strided((B, H, N, C), (strides["B"], strides["H"], strides["N"], 1), layer * strides["L"])
        for layer in range(L)
    ]


ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


@pytest.mark.parametrize("order", ORDERS)
def test_every_order_is_named_from_its_strides(order: str) -> None:
    assert stride_order(_views(order)) == order


@pytest.mark.parametrize("order", ORDERS)
def test_the_native_path_takes_every_order_and_copies_its_blocks(order: str) -> None:
    # LHBNC interleaves blocks with heads (block stride < a block's extent) without overlap
    from kvpack.ops import gather_blocks, scatter_blocks, staging_bytes_per_block

    views = _views(order)
    kv = PagedKV.from_layers(views)
    ids = [4, 1]
    out = torch.zeros(len(ids) * staging_bytes_per_block(kv), dtype=torch.uint8)
    gather_blocks(kv, ids, out)
    blank = torch.zeros(views[0].untyped_storage().nbytes() // 4, dtype=torch.float32)
    fresh = [blank.as_strided(v.shape, v.stride(), v.storage_offset()) for v in views]
    scatter_blocks(PagedKV.from_layers(fresh), ids, out)
    for v, f in zip(views, fresh):
        assert torch.equal(f[ids], v[ids])
        assert not f[[0, 2, 3]].any()


def test_overlapping_rows_are_refused() -> None:
    assert rows_overlap(((5, 64), (4, 16)), 16) is None  # dense
    assert rows_overlap(((5, 64), (3, 320), (4, 16)), 16) is None  # interleaved, disjoint (LHBNC)
    assert rows_overlap(((5, 32), (4, 16)), 16) is not None  # block 1 starts inside block 0
    assert rows_overlap(((1, 0), (4, 16)), 16) is None  # a size-1 dim's stride never matters
    buf = torch.zeros(B * N * C, dtype=torch.float32)
    with pytest.raises(LayoutError, match="blocks overlap"):
        PagedKV.from_layers([buf.as_strided((B, H, N, C), (N * C // 2, N * C, C, 1))])


@pytest.mark.parametrize(("device", "kind"), [("cpu", KVLayoutKind.VLLM_CPU), ("meta", KVLayoutKind.VLLM_BLOCK_VIEW)])
def test_a_cache_off_the_cpu_is_a_gpu_cache(device: str, kind: KVLayoutKind) -> None:
    # the CPU attention packs blocks (whole blocks only); any other device's view is by token
    views = _views("LBNHC", device)
    assert vllm_layer_kind(views[0]) is kind
    layout = PagedKV.from_layers(views).layout
    assert layout.kind is kind and layout.token_addressable is (kind is KVLayoutKind.VLLM_BLOCK_VIEW)


@pytest.mark.parametrize("order", ORDERS)
def test_the_canonical_mapping_reads_k_then_v_of_each_cell(order: str) -> None:
    views = _views(order)
    geo = CanonicalGeometry.from_block_views(views, B, heads=H, head_size=D, head_size_v=D)
    out = torch.zeros(2 * geo.object_bytes(H), dtype=torch.uint8)
    geo.copy([3, 1], out, gather=True, obj_heads=H, use_kernel=False)
    objs = out.view(torch.float32).view(2, L, 2, H, N, D)
    for i, b in enumerate((3, 1)):
        for layer, v in enumerate(views):
            assert torch.equal(objs[i, layer, 0], v[b, :, :, :D])
            assert torch.equal(objs[i, layer, 1], v[b, :, :, D:])


@pytest.mark.parametrize(
    ("heads", "k", "v", "match"),
    [
        (H + 1, D, D, "H is 3"),
        (H, D, D // 2, "C is 16 elements"),
        (H, 3 * D // 2, D // 2, "K and V differ"),
    ],
)
def test_content_the_view_does_not_hold_is_refused_naming_the_order(heads: int, k: int, v: int, match: str) -> None:
    with pytest.raises(LayoutError, match=f"order LHBNC.*{match}"):
        CanonicalGeometry.from_block_views(_views("LHBNC", "meta"), B, heads=heads, head_size=k, head_size_v=v)
