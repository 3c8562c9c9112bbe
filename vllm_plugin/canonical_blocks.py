"""vLLM in kvpack's canonical object layout (`kvpack.canonical`, `kvpack.identity.heads`).

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
`CanonicalGeometry`, its own head range, and the gather/scatter the worker calls.
Which geometry is `cache_kind`'s decision, from engine facts: vLLM's CPU attention
packs each block for its ISA (`packing.find_packing` finds the packing), every other
writer (the GPU backends, the MLA backends on any device) fills vLLM's ``[B, H, N, C]``
views row by row, read in any stride order by `CanonicalGeometry.from_block_views`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from kvpack import CanonicalGeometry, HeadRange, HeadSplit, LayoutError, upload_runs, vllm_cpu_geometry
from kvpack.ops import load_extension
from kvpack.transfers import Direction, Lane, inline_lane

from .byte_facts import UNKNOWN, BlockByteFacts
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


def uses_mla(vllm_config: VllmConfig) -> bool:
    """Whether the model's attention is MLA (one latent per token, no V): from the model config."""
    return bool(getattr(vllm_config.model_config, "use_mla", False))


class CacheKind(str, Enum):
    """Who wrote a registered cache's bytes, so how they map to canonical objects."""

    CPU_PACKED = "cpu_packed"
    """vLLM's CPU attention: each (block, head) tile packed for the attention ISA."""
    BLOCK_VIEW = "block_view"
    """A backend that writes vLLM's ``[B, H, N, C]`` view row by row: every GPU backend,
    and the MLA backends on any device (vLLM's CPU MLA stamps no ISA)."""


def cache_kind(device: torch.device, *, mla: bool, facts: BlockByteFacts) -> CacheKind:
    """The decision, from engine facts, never from a shape: MLA, or a cache on any device but
    the CPU (CUDA, XPU, ``meta`` in a registration without bytes), is a block view. On the CPU
    the attention backend stamps its ISA on every layer before ``register_kv_caches``; a
    layer with an ISA is packed, one without is written by slot (a block view). Raises
    LayoutError for a CPU attention layer without its ISA (its packing is unknown)."""
    if mla or device.type != "cpu":
        return CacheKind.BLOCK_VIEW
    if facts.cpu_attn_isa not in (UNKNOWN, "-"):
        return CacheKind.CPU_PACKED
    if "CPU_ATTN" in facts.attn_backend.split(","):
        raise LayoutError(
            "kvpack: vLLM's CPU attention layers carry no attention ISA, so their block packing is unknown; "
            "kvpack cannot store this engine's KV in the canonical layout (please report the vLLM version)"
        )
    return CacheKind.BLOCK_VIEW


def view_content(vllm_config: VllmConfig, names: Sequence[str], split: HeadSplit) -> tuple[int, int]:
    """(K, V) elements of one cell of this worker's views: from the layers' own cache spec when
    vLLM built them (``get_kv_cache_spec``), else from the model config (``head_size`` twice;
    MLA: the latent and 0). Raises LayoutError naming the spec when a backend packs the
    cell otherwise (head slots that are not KV heads, content bytes of its own)."""
    mla = uses_mla(vllm_config)
    k, v = split.head_dim, 0 if mla else split.head_dim
    context: dict[str, Any] = getattr(vllm_config.compilation_config, "static_forward_context", {}) or {}
    for name in names:
        get = getattr(context.get(name), "get_kv_cache_spec", None)
        try:
            spec = get(vllm_config) if callable(get) else None
        except Exception:  # a layer that cannot say: the model config's facts stand
            spec = None
        if spec is None:
            continue
        if getattr(spec, "num_head_slots", None) is not None or getattr(spec, "state_content_bytes", None) is not None:
            raise LayoutError(
                f"kvpack: layer {name}'s cache spec {spec!r} packs its cells itself (head slots "
                f"{spec.num_head_slots}, content bytes {spec.state_content_bytes}); kvpack cannot store it "
                "as canonical objects"
            )
        k, v = int(spec.head_size), int(getattr(spec, "head_size_v", 0) or 0)
        break
    return k, v


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
        launched on `lane` (`kvpack.transfers.staging`; inline without one)."""
        lane = lane if lane is not None else inline_lane(Direction.SAVE, self.geometry.tensors[0].device)
        ids, flat = list(block_ids), out.view(-1)
        lane.launch(lambda: self.geometry.copy(ids, flat, gather=True, obj_heads=self.own.size, stream=lane.stream))

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, lane: Lane | None = None) -> None:
        """Rows of `src` (contiguous objects of `own`) -> blocks, launched on `lane`."""
        lane = lane if lane is not None else inline_lane(Direction.LOAD, self.geometry.tensors[0].device)
        ids, flat = list(block_ids), lane.keep(src).contiguous().view(-1)
        lane.launch(lambda: self.geometry.copy(ids, flat, gather=False, obj_heads=self.own.size, stream=lane.stream))

    @property
    def reads_addresses(self) -> bool:
        """Whether `scatter_at` can run: the cache holds all the heads of its objects, and it is
        on a GPU, or in host memory with the C++ kernel built."""
        geo = self.geometry
        if geo.heads != self.own.size:
            return False
        return geo.tensors[0].device.type != "cpu" or load_extension().available

    def scatter_at(self, block_ids: Sequence[int], addrs: Sequence[int], lane: Lane) -> None:
        """Objects of `own`, object i at host address ``addrs[i]`` (a tier's lent slot or a
        staging row, valid until the lane's event) -> blocks, launched on `lane`. Only where
        `reads_addresses`. A cache in host memory copied inline: one kernel call over the batch
        (`CanonicalGeometry.copy_at`). A device's lane (a GPU): the objects copied into device
        rows, one DMA per run of objects back to back (`upload_runs`: the addresses must be
        pinned or registered memory, `StagingDevice.reads_in_place`), then converted on the
        device (`CanonicalGeometry.copy`): no host copy."""
        ids, where, geo = list(block_ids), list(addrs), self.geometry
        if lane.device.kind == "cpu" and geo.tensors[0].device.type == "cpu":
            lane.launch(lambda: geo.copy_at(ids, where, gather=False, use_kernel=True))
            return
        rows = lane.scratch(len(ids), self.slot_bytes)

        def run() -> None:
            order = upload_runs(where, self.slot_bytes, rows)
            geo.copy([ids[k] for k in order], rows.view(-1), gather=False, obj_heads=self.own.size, stream=lane.stream)

        lane.launch(run)

    def scatter_from(
        self, block_ids: Sequence[int], src: torch.Tensor, stored: HeadRange, part: HeadRange, lane: Lane | None = None
    ) -> None:
        """Rows of `src`, objects of the range `stored`: heads `part` (inside both `stored`
        and `own`) -> this worker's blocks, launched on `lane`."""
        lane = lane if lane is not None else inline_lane(Direction.LOAD, self.geometry.tensors[0].device)
        ids, rows = list(block_ids), lane.keep(src)
        lane.launch(lambda: self.geometry.scatter_heads(ids, rows, stored, part, self.own, stream=lane.stream))

    @classmethod
    def from_tensors(
        cls,
        tensors: Sequence[torch.Tensor],
        num_blocks: int,
        split: HeadSplit,
        own: HeadRange,
        kind: CacheKind,
        *,
        isa: str = UNKNOWN,
        cell: tuple[int, int] | None = None,
    ) -> CanonicalBlocks:
        """The worker's attention layers, written as `kind` says: CPU_PACKED with the packing of
        the attention ISA `isa`; BLOCK_VIEW with `cell` (K, V) elements per cell (default: the
        split's head size twice). Raises LayoutError (engine start-up) naming the layout when
        it or the ISA's packing is not one kvpack can convert."""
        unique = list({(t.data_ptr(), tuple(t.shape)): t for t in tensors}.values())
        first = unique[0]
        if kind is CacheKind.CPU_PACKED:
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
            k, v = cell if cell is not None else (split.head_dim, split.head_dim)
            geometry = CanonicalGeometry.from_block_views(
                unique, num_blocks, heads=own.size, head_size=k, head_size_v=v
            )
        if geometry.num_blocks != num_blocks:
            raise LayoutError(f"kvpack: the KV cache has {geometry.num_blocks} blocks, vLLM allocated {num_blocks}")
        if geometry.heads != own.size or geometry.head_dim != split.head_dim:
            raise LayoutError(
                f"kvpack: this rank's KV cache holds {geometry.heads} heads of {geometry.head_dim}, expected heads "
                f"[{own.start}, {own.stop}) of {split.num_heads} with head size {split.head_dim}"
            )
        return cls(geometry, own, num_blocks)
