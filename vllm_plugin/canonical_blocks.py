"""vLLM in kvpack's canonical object layout (`kvpack.canonical`, `kvpack.heads`).

When it applies (`head_split`): one KV cache group of full attention, no draft
KV of its own (no speculative model, or one without KV layers), one pipeline
stage, an unquantized KV cache, on the CPU or a CUDA GPU. Then an object is the
canonical bytes of one chunk for a range of KV heads, its group fingerprint
says what the bytes are (model identity, KV dtype, chunk tokens, format
version) and not who wrote them (engine, TP size, CPU attention ISA, attention
backend; `kvpack.canonical.identity`), and a reader at any TP size loads what a writer
at any other stored.
Everything else (hybrid models, packed or sidecar drafts, PP > 1, fp8 KV) keeps
the engine-native object format, with those facts in its fingerprint.

`CanonicalBlocks` is one worker's copy path: its layers as a
`CanonicalGeometry` (the CPU ISA's packing found by `packing.find_packing`),
its own head range, and the gather/scatter the worker calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpack import CanonicalGeometry, HeadRange, HeadSplit, LayoutError, paged_geometry, vllm_cpu_geometry
from kvpack.ops import Direction, Lane, PagedKV, cpu_lane

from .packing import find_packing

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def head_split(vllm_config: VllmConfig, *, hybrid: bool, draft_kv: bool, device_type: str) -> HeadSplit | None:
    """The engine's `HeadSplit` when its objects are canonical (see the module docstring), else None."""
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    quantized = str(cache.cache_dtype or "auto") not in ("auto", "float16", "bfloat16", "float32", "half", "float")
    if (
        hybrid
        or draft_kv
        or quantized
        or int(parallel.pipeline_parallel_size) != 1
        or device_type not in ("cpu", "cuda")
    ):
        return None
    model = vllm_config.model_config
    heads = 1 if getattr(model, "use_mla", False) else int(model.get_total_num_kv_heads())
    return HeadSplit(heads, int(model.get_head_size()), int(parallel.tensor_parallel_size))


@dataclass(frozen=True, eq=False)
class CanonicalBlocks:
    """One worker's layers as canonical objects of its own heads `own` (see the module docstring).

    Same interface as `blocks.BlockLayout` for its own range (`gather`, `scatter`,
    `slot_bytes`), plus `scatter_from` for an object of another range."""

    geometry: CanonicalGeometry
    own: HeadRange
    num_blocks: int

    @property
    def slot_bytes(self) -> int:
        return self.geometry.object_bytes(self.own.size)

    def object_bytes(self, heads: HeadRange) -> int:
        return self.geometry.object_bytes(heads.size)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor, lane: Lane | None = None) -> None:
        """Blocks -> rows of `out` (``[len(block_ids), slot_bytes]`` uint8): objects of `own`,
        launched on `lane` (`kvpack.staging`; inline without one)."""
        lane = lane if lane is not None else cpu_lane(Direction.SAVE)
        ids, flat = list(block_ids), out.view(-1)
        lane.launch(lambda: self.geometry.copy(ids, flat, gather=True, obj_heads=self.own.size, stream=lane.stream))

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, lane: Lane | None = None) -> None:
        """Rows of `src` (contiguous objects of `own`) -> blocks, launched on `lane`."""
        lane = lane if lane is not None else cpu_lane(Direction.LOAD)
        ids, flat = list(block_ids), lane.keep(src).contiguous().view(-1)
        lane.launch(lambda: self.geometry.copy(ids, flat, gather=False, obj_heads=self.own.size, stream=lane.stream))

    def scatter_from(
        self, block_ids: Sequence[int], src: torch.Tensor, stored: HeadRange, part: HeadRange, lane: Lane | None = None
    ) -> None:
        """Rows of `src`, objects of the range `stored`: heads `part` (inside both `stored`
        and `own`) -> this worker's blocks, launched on `lane`."""
        lane = lane if lane is not None else cpu_lane(Direction.LOAD)
        ids, rows = list(block_ids), lane.keep(src)
        lane.launch(lambda: self.geometry.scatter_heads(ids, rows, stored, part, self.own, stream=lane.stream))

    @classmethod
    def from_tensors(
        cls, tensors: Sequence[torch.Tensor], num_blocks: int, split: HeadSplit, own: HeadRange, isa: str
    ) -> CanonicalBlocks:
        """The worker's attention layers. Raises LayoutError (engine start-up) when their
        layout or the CPU ISA's packing is not one kvpack can convert."""
        unique = list({(t.data_ptr(), tuple(t.shape)): t for t in tensors}.values())
        first = unique[0]
        if first.device.type == "cpu":
            if first.dim() != 4:
                raise LayoutError(
                    f"kvpack: a vLLM CPU KV cache of shape {tuple(first.shape)} is not [blocks, heads, block, 2*head]"
                )
            found = find_packing(first.dtype, int(first.shape[2]), int(first.shape[3]) // 2, isa)
            if found is None:
                raise LayoutError(
                    f"kvpack: vLLM's CPU attention ({isa}) packs a {first.dtype} block in a way kvpack does not know; "
                    "kvpack cannot store this engine's KV in the canonical layout (please report the vLLM version "
                    "and CPU)"
                )
            geometry = vllm_cpu_geometry(unique, *found)
        else:
            geometry = paged_geometry(PagedKV.from_layers(unique))
        if geometry.num_blocks != num_blocks:
            raise LayoutError(f"kvpack: the KV cache has {geometry.num_blocks} blocks, vLLM allocated {num_blocks}")
        if geometry.heads != own.size or geometry.head_dim != split.head_dim:
            raise LayoutError(
                f"kvpack: this rank's KV cache holds {geometry.heads} heads of {geometry.head_dim}, expected heads "
                f"[{own.start}, {own.stop}) of {split.num_heads} with head size {split.head_dim}"
            )
        return cls(geometry, own, num_blocks)
