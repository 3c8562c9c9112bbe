"""vLLM's configuration as kvpack's config and the engine's `Scope`: what keys, fingerprints
and member names this engine's objects have.

Everything here is a pure function of the `VllmConfig` (and, for workers,
the cache tensors), so the scheduler-side and worker-side
connectors, which may live in different processes, compute the same keys,
fingerprints and member names independently.

- config: ``kv_connector_extra_config`` -> `KVPackConfig` (strict; a bad key
  fails engine start-up naming the field).
- scope: the group fingerprint (engine, model identity + draft model identity
  and its placement (`kvpack.identity.model_identity`: what the checkpoint is, not its path),
  dtype, block size, TP/PP sizes, KV cache groups) and the member names
  (``kv``, or ``kv@<rank>of<world>``; plus ``draft``/``draft@<rank>of<world>``
  when the draft KV is a sidecar).
- KV cache groups (hybrid models, vLLM's hybrid allocator): each group is a
  member of its own (``kv`` for group 0, ``kv_g<i>`` for group i), with the
  coverage its attention type needs (`cache_groups`).
- draft layers: which registered KV layers belong to the drafter, told apart by
  the speculative config, never by position alone (`split_draft_layers`).

A request's tenant and chain seed are `request_scopes`'.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TYPE_CHECKING

from kvpack import (
    ConfigError,
    Coverage,
    DraftPlacement,
    DraftPlacementMode,
    HeadRange,
    HeadSplit,
    HitQuery,
    KVLayoutSpec,
    KVPackConfig,
    MemberRole,
    MemberSpec,
    RequestScope,
    canonical_group_spec,
    identify_model,
    member_name,
    resolve_memory,
    with_weights,
)

from .canonical_blocks import head_split

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvpack.vllm")


def load_config(vllm_config: VllmConfig) -> KVPackConfig:
    """kvpack config from ``kv_connector_extra_config``, ``memory.mode`` resolved for this engine's
    processes (`kvpack.resolve_memory`); raises ConfigError naming the field."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {}) if ktc is not None else {}
    if not isinstance(extra, dict):
        raise ConfigError("kv_connector_extra_config", "must be a JSON object")
    config = KVPackConfig.from_dict(extra)
    # memory.mode auto: the host memory tier when this engine runs several processes on the host
    parallel = vllm_config.parallel_config
    ranks = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
    config = resolve_memory(config, ranks * int(getattr(parallel, "data_parallel_size", 1) or 1))
    if not extra:
        where = [f"memory ({config.memory.capacity} bytes)"] if config.memory.enabled else []
        if config.disk.enabled:
            where.append(f"disk at {config.disk.path}")
        log.info("kvpack: no kv_connector_extra_config given; using the defaults: %s", ", ".join(where))
    return config


@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV cache groups, as kvpack stores it.

    Every group has its own block table (block ids index the same pool), so
    each is a member of its own in every chunk's kvpack group. `coverage`
    says which chunks of a prefix the member is needed in: ALL (full
    attention), TRAILING (sliding window / chunked local attention: the last
    `window_chunks` chunks before the boundary, the blocks vLLM still holds
    there), BOUNDARY (Mamba state in ``mamba_cache_mode="align"``).
    """

    index: int
    coverage: Coverage
    window_chunks: int
    layer_names: tuple[str, ...]
    kind: str
    """vLLM's spec class name (logs, fingerprint)."""

    @property
    def member_base(self) -> str:
        """This group's KV member before any rank suffix (`kvpack.member_name`: ``kv``, ``kv_g<i>``)."""
        return member_name("kv", group=self.index)

    @property
    def frees_blocks_early(self) -> bool:
        """True when vLLM releases this group's blocks before the request ends (the
        connector must copy them while they are still held)."""
        return self.coverage is not Coverage.ALL


def cache_groups(kv_cache_config: KVCacheConfig | None, block_size: int) -> tuple[CacheGroup, ...]:
    """kvpack's view of vLLM's KV cache groups. Raises ValueError (start-up) for a
    group kvpack cannot store correctly."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return (CacheGroup(0, Coverage.ALL, 0, (), "FullAttentionSpec"),)
    out: list[CacheGroup] = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if int(spec.block_size) != block_size:
            raise ValueError(
                f"kvpack: KV cache group {i} ({kind}) has block size {spec.block_size}, the engine {block_size}; "
                "kvpack stores groups of one block size only"
            )
        if isinstance(spec, SlidingWindowSpec):
            retain = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
            coverage, window = Coverage.TRAILING, max(1, -(-retain // block_size))
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            coverage, window = Coverage.TRAILING, max(1, -(-int(spec.attention_chunk_size) // block_size))
        elif isinstance(spec, MambaSpec):
            if getattr(spec, "mamba_cache_mode", "align") != "align":
                raise ValueError(
                    f"kvpack: KV cache group {i} is Mamba state with mamba_cache_mode="
                    f"{spec.mamba_cache_mode!r}; kvpack needs 'align' (state kept at block boundaries)"
                )
            coverage, window = Coverage.BOUNDARY, 1
        elif isinstance(spec, FullAttentionSpec):
            coverage, window = Coverage.ALL, 0
        else:
            raise ValueError(f"kvpack: KV cache group {i} has spec {kind}, which kvpack cannot store")
        out.append(CacheGroup(i, coverage, window, tuple(group.layer_names), kind))
    return tuple(out)


@dataclass(frozen=True)
class Scope:
    """What every process of one engine agrees on: group fingerprint, members, block size."""

    spec: KVLayoutSpec
    """Group-level spec (no layer set): `spec.group_fingerprint` scopes keys."""
    members: tuple[str, ...]
    """Every KV cache group's member, for every rank (group-major: ``kv``, ``kv_g1``...;
    ``kv@0of2``, ``kv@1of2``, ``kv_g1@0of2``... with TP/PP). Which chunks need
    which member is `member_specs`."""
    block_size: int
    draft: str
    """Draft model identity ("" without speculative decoding)."""
    draft_placement: DraftPlacement = DraftPlacement.NONE
    """NONE (no draft KV), PACKED (draft layers inside the ``kv`` objects) or SIDECAR."""
    draft_members: tuple[str, ...] = ()
    """Every rank's sidecar draft member name (SIDECAR only; role DRAFT)."""
    groups: tuple[CacheGroup, ...] = ()
    """vLLM's KV cache groups (one full-attention group unless the model is hybrid)."""
    world: int = 1
    """TP x PP ranks (each writes its own members)."""
    heads: HeadSplit | None = None
    """Canonical objects (`vllm_plugin.canonical_blocks`): the KV heads over the TP ranks; members
    are head ranges (``kv``, ``kv_h0_1``...). None: engine-native objects, one per rank."""
    min_prefill_tokens: int = 1
    """The fewest prompt tokens a hit leaves vLLM to compute (`min_prefill_tokens`): 1, or 2
    with a drafter that runs a model of its own."""
    remake: Callable[[str], Scope] | None = field(default=None, compare=False, repr=False)
    """The engine's scope for other weights (`make_scope` with ``weights``); None: fixed."""

    def with_weights(self, weights: str) -> Scope:
        """This engine's scope once it holds `weights` (`kvpack.WeightsState.identity`): their name
        is in the model, so in every fingerprint. Itself when it cannot be remade."""
        return self.remake(weights) if self.remake is not None else self

    @property
    def fingerprint(self) -> str:
        return self.spec.group_fingerprint

    @property
    def all_members(self) -> tuple[str, ...]:
        """Target members, then sidecar draft members: everything one chunk's group holds."""
        return self.members + self.draft_members

    @property
    def hybrid(self) -> bool:
        """More than one KV cache group (vLLM's hybrid allocator)."""
        return len(self.groups) > 1

    @property
    def frees_blocks_early(self) -> bool:
        """Some group's blocks are released before the request ends (sliding window, Mamba)."""
        return any(g.frees_blocks_early for g in self.groups)

    def group_members(self, group: int) -> tuple[str, ...]:
        """Every rank's member name of KV cache group `group`."""
        if self.heads is not None:
            return self.members
        base = self.groups[group].member_base if self.groups else "kv"
        return tuple(member_name(base, r, self.world) for r in range(self.world))

    @cached_property
    def lookup_members(self) -> list[MemberSpec]:
        """What a lookup requires under this scope (`member_specs`), computed once."""
        return self.member_specs()

    @cached_property
    def head_splits(self) -> list[list[MemberSpec]]:
        """Canonical objects: each head split's members, the engine's own first (`kvpack.identity.heads`);
        empty for engine-native objects."""
        return [self.member_specs(p) for p in self.heads.partitions()] if self.heads is not None else []

    def split_members(self, split: int) -> list[MemberSpec]:
        """The members of head split `split` (canonical objects), else what a lookup requires."""
        return self.head_splits[split] if self.head_splits else self.lookup_members

    def hit_query(self, rs: RequestScope, token_ids: Sequence[int]) -> HitQuery:
        """A request's facts for the core's planner: its tokens, this engine's members and, for
        canonical objects, the other head splits' (`kvpack.identity.heads`; the engine's own first)."""
        splits = self.head_splits
        return HitQuery(
            scope=rs,
            token_ids=list(token_ids),
            chunk_tokens=self.block_size,
            min_prefill_tokens=self.min_prefill_tokens,
            members=splits[0] if splits else self.lookup_members,
            alternatives=splits[1:],
            draft_members=self.draft_members,
        )

    def member_specs(self, partition: Sequence[HeadRange] | None = None) -> list[MemberSpec]:
        """What a lookup requires: each group's members with its coverage, then sidecar drafts.
        Canonical objects: the members of one head `partition` (default: the ranges this
        engine writes)."""
        if self.heads is not None:
            names = self.members if partition is None else tuple(self.heads.member(r) for r in partition)
            return [MemberSpec(name, self.fingerprint) for name in names]
        specs: list[MemberSpec] = []
        for g in self.groups or (CacheGroup(0, Coverage.ALL, 0, (), ""),):
            role = MemberRole.TARGET if g.coverage is Coverage.ALL else MemberRole.STATE
            specs += [
                MemberSpec(name, self.fingerprint, role, g.coverage, g.window_chunks)
                for name in self.group_members(g.index)
            ]
        return specs + [MemberSpec(name, self.fingerprint, MemberRole.DRAFT) for name in self.draft_members]


def draft_identity(vllm_config: VllmConfig) -> str:
    """The speculative config's draft, as it affects the KV layer set ("" when none):
    ``<method>:<identity>``, the draft checkpoint's `model_identity` (a digest of what
    is on disk, not its path; ``model_id`` names the target only)."""
    spec = vllm_config.speculative_config
    if spec is None or not getattr(spec, "num_speculative_tokens", None):
        return ""
    method = str(getattr(spec, "method", "") or "")
    model = str(getattr(spec, "model", "") or "")
    if model and has_draft_kv(vllm_config):  # n-gram, suffix...: no checkpoint of their own
        draft_cfg = getattr(spec, "draft_model_config", None)
        model = identify_model(model, revision=getattr(draft_cfg, "revision", None)).value
    return f"{method}:{model}"


def target_identity(vllm_config: VllmConfig, config: KVPackConfig) -> str:
    """The target model's cache identity: `KVPackConfig.model_id`, else a digest of the
    checkpoint at ``model_config.model`` (so a copy at another path is a hit and other
    weights at the same path a miss), else the hub name with its revision."""
    model_cfg = vllm_config.model_config
    return identify_model(
        str(model_cfg.model), model_id=config.model_id, revision=getattr(model_cfg, "revision", None)
    ).value


DRAFT_MEMBER = "draft"
"""Base name of the sidecar draft member (``draft@<rank>of<world>`` with TP/PP)."""

_DRAFT_PREFIX = "draft_model."
"""Prefix of every layer a ``draft_model`` drafter registers (vLLM builds it under that prefix)."""
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def min_prefill_tokens(vllm_config: VllmConfig) -> int:
    """The fewest prompt tokens a hit may leave vLLM to compute: 1, or 2 with a drafter that
    runs a model of its own (`has_draft_kv`).

    vLLM 0.32 shapes a request whose prefill step computes one token like a decode in the
    drafter's first pass (the padded drafter batch: the request's query plus
    ``num_speculative_tokens`` padding slots), and the drafter's first proposal for it is then
    rejected whole: one draft round lost per hit, with correct tokens and no error. Measured
    with vLLM's own prefix cache on the tiny test model (draft = copy of the target, 3
    speculative tokens, 48 greedy tokens): a 513-token prompt hitting 512 accepts 36 of 39
    draft tokens, 514 and 515 tokens (2 and 3 to prefill) accept 36 of 36. A hit one token
    shorter costs one token of reuse and keeps every draft round."""
    return 2 if has_draft_kv(vllm_config) else 1


def has_draft_kv(vllm_config: VllmConfig) -> bool:
    """True when the speculative method keeps KV layers of its own (draft model,
    EAGLE/EAGLE-3, MTP, DFlash...); False without speculative decoding and for
    n-gram, suffix, Medusa-style methods, which have no draft KV."""
    spec = vllm_config.speculative_config
    if spec is None or not getattr(spec, "num_speculative_tokens", None):
        return False
    uses = getattr(spec, "uses_draft_kv_cache", None)
    if callable(uses):
        return bool(uses())
    method = str(getattr(spec, "method", "") or "")
    return method not in ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator", "custom_class")


def target_layer_count(vllm_config: VllmConfig) -> int:
    """The target model's total number of hidden layers (all PP stages)."""
    model_cfg = vllm_config.model_config
    try:
        return int(model_cfg.get_total_num_hidden_layers())
    except Exception:
        return int(getattr(model_cfg.hf_text_config, "num_hidden_layers", 0) or 0)


def split_draft_layers(vllm_config: VllmConfig, names: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Registered KV layer names -> (target layers, draft layers), order kept.

    A layer is the drafter's when the speculative method has draft KV and
    either vLLM built it under the ``draft_model.`` prefix (``draft_model``
    method) or its layer index is at or past the target's layer count (EAGLE
    heads and MTP layers appear as ``model.layers.<n>`` after the target's).
    Without draft KV every layer is the target's.
    """
    if not has_draft_kv(vllm_config):
        return tuple(names), ()
    n_target = target_layer_count(vllm_config)
    target: list[str] = []
    draft: list[str] = []
    for name in names:
        m = _LAYER_INDEX.search(name)
        if name.startswith(_DRAFT_PREFIX) or (m is not None and n_target and int(m.group(1)) >= n_target):
            draft.append(name)
        else:
            target.append(name)
    return tuple(target), tuple(draft)


def resolve_draft_placement(vllm_config: VllmConfig, config: KVPackConfig) -> DraftPlacement:
    """The configured `draft_placement`, with AUTO decided for this engine.

    AUTO is PACKED when the draft layers share the target's block index space.
    Every layer of one KV cache group, target and draft, is addressed by the
    same block ids, and each group is a member of its own: so on vLLM AUTO is
    PACKED whenever the drafter has KV.
    """
    if not has_draft_kv(vllm_config):
        return DraftPlacement.NONE
    if config.draft_placement is DraftPlacementMode.SIDECAR:
        return DraftPlacement.SIDECAR
    return DraftPlacement.PACKED


def make_scope(
    vllm_config: VllmConfig,
    config: KVPackConfig | None = None,
    kv_cache_config: KVCacheConfig | None = None,
    weights: str = "",
) -> Scope:
    """The engine's `Scope`. `config` defaults to the one in ``kv_connector_extra_config``;
    `weights`: the weights the engine holds when they changed in place since start-up
    (`kvpack.WeightsState.identity`; part of the model, so of every fingerprint).
    Raises ValueError (engine start-up) for a combination kvpack cannot store."""
    from vllm.platforms import current_platform

    if config is None:
        ktc = vllm_config.kv_transfer_config
        config = KVPackConfig.from_dict(dict(ktc.kv_connector_extra_config or {}) if ktc is not None else {})
    parallel = vllm_config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    world = tp * pp
    block_size = int(vllm_config.cache_config.block_size)
    model_cfg = vllm_config.model_config
    draft = draft_identity(vllm_config)
    placement = resolve_draft_placement(vllm_config, config)
    model = with_weights(target_identity(vllm_config, config), weights)
    if draft:
        model += f"|draft={draft}"
    if placement is not DraftPlacement.NONE:
        model += f"|{placement.value}"  # packed and sidecar objects never share keys
    groups = cache_groups(kv_cache_config, block_size)
    if len(groups) > 1:
        if placement is DraftPlacement.SIDECAR:
            raise ValueError(
                "kvpack: draft_placement 'sidecar' is not supported with several KV cache groups; use 'packed' "
                "(each group's draft layers are stored in that group's member)"
            )
        # a hybrid engine's objects hold one group's layers each: never shared with a one-group engine's
        model += "|groups=" + ",".join(f"{g.kind}:{g.coverage.value}{g.window_chunks}" for g in groups)
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = str(model_cfg.dtype) if cache_dtype in (None, "auto") else str(cache_dtype)
    split = head_split(
        vllm_config,
        hybrid=len(groups) > 1,
        draft_kv=placement is not DraftPlacement.NONE,
        device_type=current_platform.device_type,
    )
    if split is not None:
        return Scope(
            spec=canonical_group_spec(model, dtype.replace("torch.", ""), block_size),
            members=split.written_members(),
            block_size=block_size,
            draft=draft,
            groups=groups,
            world=world,
            heads=split,
            min_prefill_tokens=min_prefill_tokens(vllm_config),
            remake=partial(make_scope, vllm_config, config, kv_cache_config),
        )
    spec = KVLayoutSpec(
        engine=f"vllm:{current_platform.device_type}",
        model=model,
        dtype=dtype.replace("torch.", ""),
        chunk_tokens=block_size,
        tp_size=tp,
        pp_size=pp,
    )
    members = tuple(member_name(g.member_base, r, world) for g in groups for r in range(world))
    draft_members = (
        tuple(member_name(DRAFT_MEMBER, r, world) for r in range(world)) if placement is DraftPlacement.SIDECAR else ()
    )
    return Scope(
        spec=spec,
        members=members,
        block_size=block_size,
        draft=draft,
        draft_placement=placement,
        draft_members=draft_members,
        groups=groups,
        world=world,
        min_prefill_tokens=min_prefill_tokens(vllm_config),
        remake=partial(make_scope, vllm_config, config, kv_cache_config),
    )
