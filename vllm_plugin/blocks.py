"""Whole-block copies between vLLM's paged KV tensors and kvpack's staging rows.

An object is one vLLM block of *every* registered layer (target and draft
layers alike), so a hit restores all of them or none. Staging layout: one row
of `slot_bytes` per block; inside a row, each layer's block bytes in
registration order (each segment's, for layouts that keep K and V apart):
``kvpack.ops``' staging layout ``[block][layer][segment][outer][inner][row]``.

The copies are `kvpack.ops.gather_blocks` / `scatter_blocks` (C++ kernel on
the CPU, CUDA kernel on a GPU, torch fallback) over `PagedKV` views built once
at registration; the layout is read from the tensors, never assumed (vLLM CPU
``[blocks, heads, block_size, 2*head]``; GPU ``[2, blocks, ...]`` gives two
segments). Whole blocks are copied, so the ISA-dependent order inside a CPU
block never matters. Layers of different shapes (a draft model with other
head counts) form separate runs of equal layers, each copied by one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpack.errors import LayoutError
from kvpack.ops import PagedKV, gather_blocks, scatter_blocks


@dataclass(frozen=True)
class BlockLayout:
    """The cache as runs of equal layers (`PagedKV` each), in registration order."""

    runs: tuple[PagedKV, ...]
    num_blocks: int
    slot_bytes: int
    description: tuple[str, ...]
    """One entry per layer: dtype, shape and strides (goes into the member fingerprint)."""

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], num_blocks: int) -> BlockLayout:
        unique: list[torch.Tensor] = []
        desc: list[str] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for t in tensors:
            ident = (t.data_ptr(), tuple(t.shape))
            if ident in seen:  # a tensor shared by several layers is stored once
                continue
            seen.add(ident)
            unique.append(t)
            desc.append(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}/{list(t.stride())}")
        groups: list[list[torch.Tensor]] = []
        for t in unique:
            if groups and _same_geometry(groups[-1][0], t):
                groups[-1].append(t)
            else:
                groups.append([t])
        runs = []
        for g in groups:
            try:
                run = PagedKV.from_layers(g)
            except (LayoutError, ValueError) as exc:
                raise LayoutError(f"kvpack: unsupported KV cache layout: {exc}") from None
            if run.layout.num_blocks != num_blocks:
                raise LayoutError(
                    f"kvpack: a KV tensor of shape {tuple(g[0].shape)} has {run.layout.num_blocks} blocks, "
                    f"vLLM allocated {num_blocks}"
                )
            runs.append(run)
        slot = sum(r.layout.slot_bytes for r in runs)
        return cls(tuple(runs), num_blocks, slot, tuple(desc))

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Blocks `block_ids` -> rows of `out` (``[len(block_ids), slot_bytes]`` uint8, contiguous)."""
        if len(self.runs) == 1:
            gather_blocks(self.runs[0], block_ids, out.view(-1))
            return
        off = 0
        for run in self.runs:
            w = run.layout.slot_bytes
            part = torch.empty((len(block_ids), w), dtype=torch.uint8, device=out.device)
            gather_blocks(run, block_ids, part.view(-1))
            out[:, off : off + w].copy_(part)
            off += w

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Rows of `src` -> blocks `block_ids`."""
        src = src.contiguous()
        if len(self.runs) == 1:
            scatter_blocks(self.runs[0], block_ids, src.view(-1))
            return
        off = 0
        for run in self.runs:
            w = run.layout.slot_bytes
            scatter_blocks(run, block_ids, src[:, off : off + w].contiguous().view(-1))
            off += w


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)
