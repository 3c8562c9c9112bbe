"""Whole-block copies between vLLM's paged KV tensors and kvpack's staging rows.

An object is one vLLM block of *every* registered layer (target and draft
layers alike), so a hit restores all of them or none. Staging layout: one row
of `slot_bytes` per block; inside a row, each layer's block bytes in
registration order (each segment's, for layouts that keep K and V apart).

The layout is read from the tensors (never assumed): a layer's block
dimension is the one whose size is the number of blocks, and one block must be
a contiguous run of bytes in it (vLLM CPU ``[blocks, heads, block_size,
2*head]``; GPU ``[2, blocks, ...]`` gives two segments). Whole blocks are
copied, so the ISA-dependent order inside a CPU block never matters.

This is a small torch (index_select / index_copy_) path; `kvpack.ops` (the
C++/CUDA gather/scatter kernels) replaces it once its API is final.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpack.errors import LayoutError


@dataclass(frozen=True)
class BlockLayout:
    """Per-segment uint8 views ``[num_blocks, bytes_per_block]`` of the cache."""

    segments: tuple[torch.Tensor, ...]
    num_blocks: int
    slot_bytes: int
    description: tuple[str, ...]
    """One entry per layer: dtype and shape (goes into the member fingerprint)."""

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], num_blocks: int) -> BlockLayout:
        segments: list[torch.Tensor] = []
        desc: list[str] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for t in tensors:
            ident = (t.data_ptr(), tuple(t.shape))
            if ident in seen:  # a tensor shared by several layers is stored once
                continue
            seen.add(ident)
            desc.append(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}/{list(t.stride())}")
            if t.shape[0] == num_blocks:
                parts = [t]
            elif t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
                parts = [t[0], t[1]]
            else:
                raise LayoutError(
                    f"kvpack: cannot find the block dimension ({num_blocks} blocks) in a KV tensor of shape "
                    f"{tuple(t.shape)}"
                )
            for p in parts:
                per_block = p[0].numel() * p.element_size()
                if not p[0].is_contiguous() or p.stride(0) * p.element_size() < per_block:
                    raise LayoutError(f"kvpack: a block of a KV tensor {tuple(t.shape)} is not contiguous")
                raw = torch.as_strided(
                    _bytes_view(p),
                    (num_blocks, per_block),
                    (p.stride(0) * p.element_size(), 1),
                )
                segments.append(raw)
        return cls(tuple(segments), num_blocks, sum(s.shape[1] for s in segments), tuple(desc))

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Blocks `block_ids` -> rows of `out` (``[len(block_ids), slot_bytes]`` uint8)."""
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.segments[0].device)
        off = 0
        for seg in self.segments:
            w = seg.shape[1]
            out[:, off : off + w].copy_(seg.index_select(0, ids))
            off += w

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Rows of `src` -> blocks `block_ids`."""
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=self.segments[0].device)
        off = 0
        for seg in self.segments:
            w = seg.shape[1]
            seg.index_copy_(0, ids, src[:, off : off + w].to(seg.device))
            off += w


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view over `t`'s storage starting at `t`'s first element."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    offset = t.storage_offset() * t.element_size()
    return flat[offset:]
