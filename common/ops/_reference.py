"""Pure-torch block gather/scatter: the fallback backend and the tests' reference.

Works on any device torch supports (index_select / index_copy_ over byte views of
the cache storage). Same semantics and staging layout as the C++/CUDA kernels.
"""

from __future__ import annotations

import torch

from .layout import KVLayout
from .paged import PagedKV


def token_range(layout: KVLayout, i: int, n: int, first_offset: int, last_count: int) -> tuple[int, int]:
    """Tokens [t0, t1) copied for block i of n (whole block when not token addressable)."""
    t = layout.tokens_per_block
    if not layout.token_addressable:
        return 0, t
    return (first_offset if i == 0 else 0), (last_count if i == n - 1 else t)


def segment_byte_views(kv: PagedKV) -> list[torch.Tensor]:
    """[num_blocks, outer, inner, row_bytes] uint8 views, one per (layer, segment)."""
    lay = kv.layout
    views = []
    for idx, addr in enumerate(kv.segment_addresses):
        owner = kv.tensors[0] if len(kv.tensors) == 1 else kv.tensors[idx // lay.num_segments]
        storage = owner.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=owner.device).set_(storage)
        views.append(
            flat.as_strided(
                (lay.num_blocks, lay.outer.count, lay.inner.count, lay.row_bytes),
                (lay.block_stride, lay.outer.stride, lay.inner.stride, 1),
                addr - storage.data_ptr(),
            )
        )
    return views


def _token_slice(view: torch.Tensor, token_dim: int | None, t0: int, t1: int) -> torch.Tensor:
    """`view` ([outer, inner, row]) restricted to tokens [t0, t1)."""
    if token_dim == 0:
        return view[t0:t1]
    if token_dim == 1:
        return view[:, t0:t1]
    return view


def _copy(kv: PagedKV, ids: list[int], staging: torch.Tensor, first_offset: int, last_count: int, gather: bool) -> None:
    lay = kv.layout
    n = len(ids)
    if n == 0:
        return
    stage = staging[: n * lay.slot_bytes].view(
        n, lay.num_layers, lay.num_segments, lay.outer.count, lay.inner.count, lay.row_bytes
    )
    ranges = [token_range(lay, i, n, first_offset, last_count) for i in range(n)]
    full = [i for i in range(n) if ranges[i] == (0, lay.tokens_per_block)]
    partial = [i for i in range(n) if ranges[i] != (0, lay.tokens_per_block)]
    cache_dev, stage_dev = kv.device, staging.device
    full_ids = torch.tensor([ids[i] for i in full], dtype=torch.int64, device=cache_dev)
    full_pos = torch.tensor(full, dtype=torch.int64, device=stage_dev)
    for ls, view in enumerate(segment_byte_views(kv)):
        layer, seg = divmod(ls, lay.num_segments)
        dst = stage[:, layer, seg]
        if full:
            if gather:
                dst.index_copy_(0, full_pos, view.index_select(0, full_ids).to(stage_dev))
            else:
                view.index_copy_(0, full_ids, dst.index_select(0, full_pos).to(cache_dev))
        for i in partial:
            t0, t1 = ranges[i]
            c = _token_slice(view[ids[i]], lay.token_dim, t0, t1)
            s = _token_slice(dst[i], lay.token_dim, t0, t1)
            if gather:
                s.copy_(c)
            else:
                c.copy_(s)


def gather_reference(kv: PagedKV, ids: list[int], out: torch.Tensor, first_offset: int, last_count: int) -> None:
    """Cache blocks `ids` -> `out` (uint8, staging layout). Arguments pre-validated."""
    _copy(kv, ids, out, first_offset, last_count, gather=True)


def scatter_reference(kv: PagedKV, ids: list[int], src: torch.Tensor, first_offset: int, last_count: int) -> None:
    """`src` (uint8, staging layout) -> cache blocks `ids`. Arguments pre-validated."""
    _copy(kv, ids, src, first_offset, last_count, gather=False)
