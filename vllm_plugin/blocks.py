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
segments). Every copy is launched on a `kvpack.transfers.staging.Lane` (the side stream of its
direction on a GPU, with pinned host rows and device scratch; inline on the CPU).
Whole blocks are copied, so the ISA-dependent order inside a CPU
block never matters. Layers of different shapes (a draft model with other
head counts) form separate runs of equal layers, each copied by one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from kvpack import LayoutError
from kvpack.ops import PagedKV, gather_blocks, scatter_blocks
from kvpack.transfers import Direction, Lane, inline_lane


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
        unique = [_allocator_blocks(t, num_blocks) for t in unique]
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

    def gather(self, block_ids: Sequence[int], out: torch.Tensor, lane: Lane | None = None) -> None:
        """Blocks `block_ids` -> rows of `out` (``[len(block_ids), slot_bytes]`` uint8, contiguous),
        launched on `lane` (`kvpack.transfers.staging`: the save side stream on a GPU; inline without one).
        Several runs on a GPU gather into device scratch rows (column by column), then one
        contiguous async copy into `out`; all on the lane, so the host never touches `out`
        before the lane's event."""
        lane = lane if lane is not None else inline_lane(Direction.SAVE, self.runs[0].device)
        ids = list(block_ids)
        if len(self.runs) == 1:
            run0 = self.runs[0]
            lane.launch(lambda: _gather(run0, ids, out.view(-1), lane))
            return
        same = out.device == self.runs[0].device
        rows = out if same else lane.scratch(len(ids), self.slot_bytes)
        off = 0
        for run in self.runs:
            w = run.layout.slot_bytes
            part = lane.scratch(len(ids), w)
            cols = rows[:, off : off + w]
            _launch_gather(lane, run, ids, part)
            lane.launch(partial(cols.copy_, part))
            off += w
        if not same:
            lane.launch(lambda: out.copy_(rows, non_blocking=True))

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, lane: Lane | None = None) -> None:
        """Rows of `src` (contiguous) -> blocks, launched on `lane` (see `gather`); `src`
        stays untouched until the lane's event (`kvpack.transfers.staging.Staged`)."""
        lane = lane if lane is not None else inline_lane(Direction.LOAD, self.runs[0].device)
        ids = list(block_ids)
        if not src.is_contiguous():
            raise ValueError("kvpack: staging rows to scatter must be contiguous")
        lane.keep(src)
        if len(self.runs) == 1:
            run0 = self.runs[0]
            lane.launch(lambda: _scatter(run0, ids, src.view(-1), lane))
            return
        rows = src
        if src.device != self.runs[0].device:
            rows = lane.scratch(len(ids), self.slot_bytes)
            lane.launch(lambda: rows.copy_(src, non_blocking=True))
        off = 0
        for run in self.runs:
            w = run.layout.slot_bytes
            part = lane.scratch(len(ids), w)
            cols = rows[:, off : off + w]
            lane.launch(partial(part.copy_, cols))
            _launch_scatter(lane, run, ids, part)
            off += w


def _launch_gather(lane: Lane, run: PagedKV, ids: list[int], part: torch.Tensor) -> None:
    lane.launch(lambda: _gather(run, ids, part.view(-1), lane))


def _launch_scatter(lane: Lane, run: PagedKV, ids: list[int], part: torch.Tensor) -> None:
    lane.launch(lambda: _scatter(run, ids, part.view(-1), lane))


def _gather(run: PagedKV, ids: list[int], out: torch.Tensor, lane: Lane) -> None:
    gather_blocks(run, ids, out, stream=lane.stream)


def _scatter(run: PagedKV, ids: list[int], src: torch.Tensor, lane: Lane) -> None:
    scatter_blocks(run, ids, src, stream=lane.stream)


def _allocator_blocks(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """`t` addressed by vLLM's block ids. A 4-D view split into ``ratio`` kernel blocks per
    block (``[num_blocks * ratio, H, N, C]``: an attention kernel's block is smaller than the
    allocator's) is one dense page per block, which vLLM requires before it splits
    (``create_kv_cache_views``): viewed here as ``[num_blocks, 1, 1, page]``, whole blocks only.
    Raises LayoutError when the kernel blocks of a block are not one dense run."""
    if t.dim() != 4 or int(t.shape[0]) == num_blocks or num_blocks <= 0 or int(t.shape[0]) % num_blocks:
        return t
    ratio = int(t.shape[0]) // num_blocks
    _, heads, tokens, cell = (int(x) for x in t.shape)
    kernel_page = heads * tokens * cell
    stride0, s_h, s_n, s_c = (int(x) for x in t.stride())
    extent = (heads - 1) * s_h + (tokens - 1) * s_n + (cell - 1) * s_c + 1
    if stride0 != kernel_page or extent != kernel_page:
        raise LayoutError(
            f"kvpack: a KV view {tuple(t.shape)} / strides {tuple(t.stride())} splits each of {num_blocks} blocks "
            f"into {ratio} kernel blocks that are not one dense run; kvpack cannot copy its blocks"
        )
    page = ratio * kernel_page
    return t.as_strided((num_blocks, 1, 1, page), (page, page, page, 1))


def _same_geometry(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)
