"""Pure-torch block gather/scatter: the fallback backend and the tests' reference.

Works on any device torch supports (index_select / index_copy_ over byte views of
the cache storage). Same semantics and staging layout as the C++/CUDA kernels.
"""

from __future__ import annotations

import torch

from .layout import KVLayout, vector_alignment
from .paged import PagedKV


def token_range(layout: KVLayout, i: int, n: int, first_offset: int, last_count: int) -> tuple[int, int]:
    """Tokens [t0, t1) copied for block i of n (whole block when not token addressable)."""
    t = layout.tokens_per_block
    if not layout.token_addressable:
        return 0, t
    return (first_offset if i == 0 else 0), (last_count if i == n - 1 else t)


_PER_BLOCK_COPY_BYTES = 16 * 1024
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_size(kv: PagedKV, staging: torch.Tensor) -> int:
    """Widest element (8/4/2/1 bytes) dividing every row, stride and address: fewer, larger copies."""
    lay = kv.layout
    offsets = [a - _owner(kv, i).untyped_storage().data_ptr() for i, a in enumerate(kv.segment_addresses)]
    return min(
        8,
        vector_alignment(
            lay.row_bytes, lay.block_stride, lay.outer.stride, lay.inner.stride, int(staging.storage_offset()), *offsets
        ),
    )


def _owner(kv: PagedKV, idx: int) -> torch.Tensor:
    return kv.tensors[0] if len(kv.tensors) == 1 else kv.tensors[idx // kv.layout.num_segments]


def segment_views(kv: PagedKV, word: int = 1) -> list[torch.Tensor]:
    """[num_blocks, outer, inner, row_bytes / word] views, one per (layer, segment), as
    `word`-byte integers (word must divide every row, stride and storage offset)."""
    lay = kv.layout
    views = []
    for idx, addr in enumerate(kv.segment_addresses):
        owner = _owner(kv, idx)
        storage = owner.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=owner.device).set_(storage)
        flat = flat[: storage.nbytes() - storage.nbytes() % word].view(_WORDS[word])
        views.append(
            flat.as_strided(
                (lay.num_blocks, lay.outer.count, lay.inner.count, lay.row_bytes // word),
                (lay.block_stride // word, lay.outer.stride // word, lay.inner.stride // word, 1),
                (addr - storage.data_ptr()) // word,
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


def _dense(view: torch.Tensor) -> bool:
    """Whether dims 1.. of `view` are one dense run (so it can be flattened to 2-D)."""
    _, o, i, r = view.shape
    _, so, si, sr = view.stride()
    return sr == 1 and (i == 1 or si == r) and (o == 1 or so == i * r)


def _copy(kv: PagedKV, ids: list[int], staging: torch.Tensor, first_offset: int, last_count: int, gather: bool) -> None:
    lay = kv.layout
    n = len(ids)
    if n == 0:
        return
    word = word_size(kv, staging)
    stage = (
        staging[: n * lay.slot_bytes]
        .view(_WORDS[word])
        .view(n, lay.num_layers, lay.num_segments, lay.outer.count, lay.inner.count, lay.row_bytes // word)
    )
    ranges = [token_range(lay, i, n, first_offset, last_count) for i in range(n)]
    # On the CPU, big blocks: one copy_ per block-segment runs at memcpy speed; small blocks:
    # batched index ops (the per-call overhead would dominate). On a GPU always batched: a
    # launch per block-segment is bound by the host's launch rate (RESULTS.md, block copy on
    # a GPU: the torch path).
    batched = lay.segment_bytes < _PER_BLOCK_COPY_BYTES or kv.device.type != "cpu"
    full = [i for i in range(n) if batched and ranges[i] == (0, lay.tokens_per_block)]
    partial = [i for i in range(n) if not (batched and ranges[i] == (0, lay.tokens_per_block))]
    cache_dev, stage_dev = kv.device, staging.device
    full_ids = torch.tensor([ids[i] for i in full], dtype=torch.int64, device=cache_dev)
    full_pos = torch.tensor(full, dtype=torch.int64, device=stage_dev)
    for ls, view in enumerate(segment_views(kv, word)):
        layer, seg = divmod(ls, lay.num_segments)
        dst = stage[:, layer, seg]
        if full:
            # Dense blocks as [blocks, words]: index_select/index_copy_ then move whole rows.
            c = view.flatten(1) if _dense(view) else view
            st = dst.flatten(1) if c.dim() == 2 else dst
            if gather:
                st.index_copy_(0, full_pos, c.index_select(0, full_ids).to(stage_dev))
            else:
                c.index_copy_(0, full_ids, st.index_select(0, full_pos).to(cache_dev))
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
