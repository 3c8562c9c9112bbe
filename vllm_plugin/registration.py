"""Worker registration: vLLM's KV cache tensors -> one frozen `WorkerLayout`.

``register_kv_caches`` hands each worker its layers' cache tensors once. From
them this module fixes, for the worker's lifetime, what it writes: one
`MemberLayout` per member (``kv``; ``kv_g<i>`` per KV cache group of a hybrid;
a sidecar ``draft``), each with its layers' `BlockLayout` and its member
fingerprint, which covers every fact that changes a block's bytes
(`byte_facts`, plus each layer's dtype, shape and strides).

Draft KV (speculative decoding; `Scope.draft_placement`): PACKED puts the
draft layers into each ``kv`` object after the target's (so the two cannot be
separated); SIDECAR makes them a member of their own, with their own layout
fingerprint, in the same group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpack import (
    DraftPlacement,
    KVLayoutSpec,
    LayoutError,
    MemberObject,
    StoredRange,
    head_range_fingerprint,
    member_name,
    split_sources,
)

from .blocks import BlockLayout
from .byte_facts import block_byte_facts
from .canonical_blocks import CacheKind, CanonicalBlocks, cache_kind, uses_mla, view_content
from .scopes import DRAFT_MEMBER, Scope, split_draft_layers

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvpack.vllm")


@dataclass(frozen=True)
class RankPosition:
    """This worker's place among the engine's TP x PP ranks (each writes its own members)."""

    tp_rank: int = 0
    pp_rank: int = 0
    tp_size: int = 1
    pp_size: int = 1

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world(self) -> int:
        return self.tp_size * self.pp_size

    @classmethod
    def of_this_process(cls, vllm_config: VllmConfig) -> RankPosition:
        parallel = vllm_config.parallel_config
        return cls(_tp_rank(), _pp_rank(), int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size))


@dataclass(frozen=True)
class MemberLayout:
    """One member this worker writes: its layers' layout and which group's block ids address it."""

    member: str
    fingerprint: str
    layout: BlockLayout | CanonicalBlocks
    group: int
    """Index into `BlockRef.block_ids` (vLLM's KV cache group)."""
    draft: bool = False
    """The sidecar draft member (loaded only for `BlockRef.with_draft` chunks)."""
    writes: bool = True
    """False for a rank whose heads another rank stores (replicated KV heads, MLA)."""
    sources: tuple[tuple[StoredRange, ...], ...] = ()
    """Canonical objects: per head split (`BlockRef.source`), the stored objects this
    rank's heads are read from (`kvpack.canonical.split_sources`); () for native objects."""

    @property
    def obj(self) -> MemberObject:
        """This member's object, as the session saves and loads it (`kvpack.session`)."""
        return MemberObject(self.member, self.fingerprint)


@dataclass(frozen=True)
class WorkerLayout:
    """Everything one worker copies, fixed at registration (group 0's ``kv`` member first)."""

    members: tuple[MemberLayout, ...]
    draft: BlockLayout | None = None
    """Draft layers only (PACKED: the trailing bytes of a ``kv`` row; SIDECAR: the ``draft`` object)."""
    draft_member: str | None = None
    """The sidecar draft member's name (SIDECAR only)."""

    @property
    def kv(self) -> MemberLayout:
        return self.members[0]


def register_layout(
    vllm_config: VllmConfig, scope: Scope, position: RankPosition, kv_caches: dict[str, torch.Tensor], num_blocks: int
) -> WorkerLayout:
    """The `WorkerLayout` of `kv_caches`. Raises LayoutError (engine start-up) for a cache
    kvpack cannot copy correctly."""
    if scope.heads is not None:
        return _register_canonical(vllm_config, scope, position, kv_caches, num_blocks)
    if scope.hybrid:
        return _register_groups(vllm_config, scope, position, kv_caches, num_blocks)
    placement = scope.draft_placement
    target, draft = split_draft_layers(vllm_config, tuple(kv_caches))
    if placement is DraftPlacement.SIDECAR and not draft:
        raise LayoutError(
            "kvpack: draft_placement 'sidecar' needs the drafter's KV layers, but none of the registered "
            f"layers {sorted(kv_caches)} is one (expected 'draft_model.*', or a layer index at or past the "
            "target's layer count); use draft_placement 'packed'"
        )
    if placement is DraftPlacement.PACKED and not draft:
        log.warning("kvpack: no drafter KV layer told apart; every registered layer is packed into each object")

    def layout(names: tuple[str, ...]) -> BlockLayout:
        return BlockLayout.from_tensors([kv_caches[n] for n in names], num_blocks)

    kv_names = target + draft if placement is DraftPlacement.PACKED else target
    kv_layout = layout(kv_names)
    kv = MemberLayout(
        member_name("kv", position.rank, position.world),
        native_member_fingerprint(vllm_config, scope, position, kv_caches, kv_names, kv_layout, "kv"),
        kv_layout,
        0,
    )
    members = [kv]
    draft_layout = layout(draft) if draft else None
    draft_member = None
    if draft_layout is not None and placement is DraftPlacement.SIDECAR:
        draft_member = member_name(DRAFT_MEMBER, position.rank, position.world)
        fingerprint = native_member_fingerprint(
            vllm_config, scope, position, kv_caches, draft, draft_layout, DRAFT_MEMBER
        )
        members.append(MemberLayout(draft_member, fingerprint, draft_layout, 0, draft=True))
    log.info(
        "kvpack: %d KV layers registered (%d draft, %s), %d blocks, %d bytes per object, member %s%s",
        len(kv_caches),
        len(draft),
        placement.value,
        num_blocks,
        kv_layout.slot_bytes,
        kv.member,
        f" + {draft_member} ({draft_layout.slot_bytes} bytes)" if draft_member and draft_layout else "",
    )
    return WorkerLayout(tuple(members), draft_layout, draft_member)


def _register_canonical(
    vllm_config: VllmConfig, scope: Scope, position: RankPosition, kv_caches: dict[str, torch.Tensor], num_blocks: int
) -> WorkerLayout:
    """Canonical objects (`vllm_plugin.canonical_blocks`): one member, this rank's KV heads."""
    split = scope.heads
    assert split is not None
    own = split.own(position.tp_rank)
    names = tuple(kv_caches)
    device = next(iter(kv_caches.values())).device
    facts = block_byte_facts(vllm_config, names, device.type)
    kind = cache_kind(device, mla=uses_mla(vllm_config), facts=facts)
    cell = view_content(vllm_config, names, split) if kind is CacheKind.BLOCK_VIEW else None
    blocks = CanonicalBlocks.from_tensors(
        [kv_caches[n] for n in names], num_blocks, split, own, kind, isa=facts.cpu_attn_isa, cell=cell
    )
    member = split.member(own)
    fingerprint = head_range_fingerprint(scope.spec, split, own, blocks.geometry.num_layers)
    sources = split_sources(scope.spec, split, own, blocks.geometry.num_layers)
    kv = MemberLayout(member, fingerprint, blocks, 0, writes=split.writes(position.tp_rank), sources=sources)
    log.info(
        "kvpack: %d KV layers registered in the canonical layout (%s), %d blocks, heads [%d, %d) of %d, "
        "%d bytes per object, member %s%s",
        len(names),
        facts.cpu_attn_isa if kind is CacheKind.CPU_PACKED else kind.value,
        num_blocks,
        own.start,
        own.stop,
        split.num_heads,
        blocks.slot_bytes,
        member,
        "" if kv.writes else " (read only: another rank stores these heads)",
    )
    return WorkerLayout((kv,))


def _register_groups(
    vllm_config: VllmConfig, scope: Scope, position: RankPosition, kv_caches: dict[str, torch.Tensor], num_blocks: int
) -> WorkerLayout:
    """Hybrid model: one member per KV cache group, over that group's layers (a drafter's
    layers are packed into the group vLLM put them in)."""
    members: list[MemberLayout] = []
    for group in scope.groups:
        names = tuple(n for n in kv_caches if n in group.layer_names)
        if not names:
            continue  # this rank holds no layer of the group (pipeline parallel)
        tensors = [t for n in names for t in _layer_tensors(kv_caches[n])]
        layout = BlockLayout.from_tensors(tensors, num_blocks)
        member = member_name(group.member_base, position.rank, position.world)
        fingerprint = native_member_fingerprint(
            vllm_config, scope, position, kv_caches, names, layout, group.member_base
        )
        members.append(MemberLayout(member, fingerprint, layout, group.index))
        log.info(
            "kvpack: KV cache group %d (%s, %s coverage): %d layers, %d bytes per object, member %s",
            group.index,
            group.kind,
            group.coverage.value,
            len(names),
            layout.slot_bytes,
            member,
        )
    unknown = set(kv_caches) - {n for g in scope.groups for n in g.layer_names}
    if unknown:
        raise LayoutError(f"kvpack: KV layers {sorted(unknown)} belong to no KV cache group")
    if not members:
        raise LayoutError("kvpack: no registered KV layer belongs to a KV cache group")
    return WorkerLayout(tuple(members))


def native_member_fingerprint(
    vllm_config: VllmConfig,
    scope: Scope,
    position: RankPosition,
    kv_caches: dict[str, torch.Tensor],
    names: tuple[str, ...],
    layout: BlockLayout,
    role: str,
) -> str:
    """The header fingerprint of a member over layers `names`: the group's facts, this rank,
    the layer set and shapes, and every fact that changes a block's bytes (`byte_facts`)."""
    facts = block_byte_facts(vllm_config, names, scope.spec.engine.partition(":")[2])
    extra: tuple[tuple[str, str], ...] = (("layers", ";".join(layout.description)), *facts.as_extra())
    if role != "kv":
        extra += (("member", role),)
    first = kv_caches[names[0]] if names else None
    spec = KVLayoutSpec(
        engine=scope.spec.engine,
        model=scope.spec.model,
        dtype=scope.spec.dtype,
        chunk_tokens=scope.block_size,
        tp_size=scope.spec.tp_size,
        pp_size=scope.spec.pp_size,
        tp_rank=position.tp_rank,
        pp_rank=position.pp_rank,
        layer_names=names,
        layer_shape=tuple(first.shape[1:]) if isinstance(first, torch.Tensor) else (),
        extra=extra,
    )
    assert spec.group_fingerprint == scope.fingerprint
    return spec.member_fingerprint


def _layer_tensors(cache: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """A layer's cache tensors (attention: one; Mamba: its conv and SSM state tensors)."""
    return list(cache) if isinstance(cache, (list, tuple)) else [cache]


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


def _pp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except Exception:
        return 0
