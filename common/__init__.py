"""kvpack: one correct, fast, multi-tenant KV-cache reuse layer for vLLM and SGLang.

The engine-neutral core. It never imports vllm, sglang, an adapter or the
operator tools (`kvpack.tools`; checked by tests/common/test_structure.py);
the adapters (`kvpack.vllm_plugin`, `kvpack.sglang_plugin`) translate engine
calls into the types below.

    from kvpack import KVPackConfig, KVStore
    store = KVStore.from_config(KVPackConfig.from_dict({"disk": {"path": "/tmp/kv"}}))

Glossary (one name per idea; docs/ARCHITECTURE.md has the full one, the layers and
the life of a stored block):

- tenant: the security boundary. A validated name (`keys.validate_tenant`) in
  every key, quota and metric; decided by `tenancy.resolve_tenant` from the
  request's facts (a trusted named tenant, the salt's scope) or the config.
- chunk: a run of tokens of one engine block (vLLM block = SGLang page), named
  by its chunk hash (`ChunkHash`, `chain_hash`: parent hash + token ids).
- layout: everything a writer and a reader of one member must agree on
  (`KVLayoutSpec`: engine and its memory layout family, model, dtype, tokens
  per chunk, ranks, layers, per-layer shape, engine facts). Other "layouts"
  carry their qualifier: the disk folder layout, SGLang's host-pool layout
  (``layer_first``/``page_first``).
- fingerprint: a digest of a layout. The group fingerprint scopes keys; the
  member fingerprint is in every object's header and must match to load.
- group: the logical cache entry, one chunk of one tenant under one group
  fingerprint (`GroupKey`: ``tenant/fingerprint/chunk``). Visible, hit and
  evicted whole.
- member: one stored object of a group (``kv``, ``kv@<rank>of<size>``,
  ``draft``, ``mamba``, ``swa``), declared by `MemberSpec` (`MemberRole`,
  `Coverage`); addressed by `StoreKey` (group key + member).
- object: what a tier stores for one member: `ObjectHeader` + payload.
- hit: full when every required member of every leading chunk is there
  (`GroupLookup`); anything less is a partial hit, counted by missing member.
  A rejected object (`RejectReason`: fingerprint, checksum...) is a miss.
- tail: the computed part of a request's last, partial block, stored with its
  token ids under `tail_chunk(parent, slot)`; reused up to the longest common
  prefix (`TailMatch`, in units of ``prefix_match_unit``).
- slot: unqualified, a tail slot (one of a parent's ``TAIL_SLOTS`` places for a
  tail). Every other slot says which: arena slot (memory tier), staging slot
  (Mooncake ring), token slot (an engine's slot mapping); `slots.py` is about
  ``__slots__`` dataclasses.
- draft: speculative-decoding draft-model state. The config's
  `config.DraftPlacementMode` (AUTO/PACKED/SIDECAR) is what the operator asks
  for; the adapter resolves it to a `DraftPlacement` (NONE, PACKED: in the
  target's object, SIDECAR: its own member). A missing draft: `DraftPolicy`.
- tier: one storage medium behind `tiers.base.Tier` (memory, disk, mooncake);
  every outcome is a `TierStatus`. The store (`KVStore`) stacks them.
- write-back: lower tiers written from a bounded queue; a full queue drops
  and counts. Wait budget: the most one engine step waits on remote tiers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .exports import LazyExports

if TYPE_CHECKING:  # imported on first use (`kvpack.exports`): `import kvpack.cli` imports no tier and no torch
    from .canonical import (
        CanonicalGeometry,
        StoredRange,
        TilePacking,
        address_of,
        head_range_fingerprint,
        paged_geometry,
        split_sources,
        upload_runs,
        vllm_cpu_geometry,
    )
    from .canonical import group_spec as canonical_group_spec
    from .client_input import MAX_DETAIL_CHARS, Refusals, clip
    from .config.reset import ClearTier, ResetScope
    from .config.schema import ChecksumPolicy, DraftPlacementMode, DraftPolicy, KVPackConfig, MemoryMode
    from .errors import ConfigError, KVPackError, LayoutError
    from .identity.heads import HeadRange, HeadSplit
    from .identity.keys import (
        ChunkChain,
        ChunkHash,
        GroupKey,
        StoreKey,
        chain_hash,
        chunk_hashes,
        member_name,
        validate_chunk_hashes,
        validate_member,
    )
    from .identity.layout_spec import KVLayoutSpec
    from .identity.model_identity import ModelIdentity, adapter_identity, checkpoint_kv_heads
    from .identity.model_identity import (
        model_identity as identify_model,
    )  # not under its module's name: kvpack.identity.model_identity stays the module
    from .identity.objects import Expectation, ObjectHeader, Payload, RejectReason
    from .observe.adapter_events import AdapterEvent, AdapterRefusal
    from .observe.batch_log import BatchFigures, BatchLog, Direction
    from .observe.engine_counters import EngineCounters
    from .observe.metrics import (
        ExportedCounter,
        Metrics,
        MetricsInterval,
        exported_counters,
        parse_series_key,
        series_key,
    )
    from .observe.router_facts import FactsRow, FactsTail, RouterFacts, new_origin, shared_fact_tails
    from .observe.shared_sweep import SharedSweep, shared_tier_sweep, shared_tier_sweeps
    from .observe.tier_events import TierEvent, TierEventFeed, TierEventKind
    from .observe.weights import WeightsOrigin, WeightsState, WeightsWatch, with_weights
    from .policy.budget import WaitBudget
    from .policy.clearing import ClearReport, ClearScope
    from .policy.groups import Coverage, DraftPlacement, GroupLookup, MemberRole, MemberSpec, tail_usable
    from .policy.hits import HandoffClaim, HitPlan, HitQuery, PlannedTail
    from .policy.tails import TailMatch, tail_chunk
    from .policy.tenancy import BadTenant, RequestScope, TenantSource, resolve_tenant, shares_facts
    from .session import ChunkFacts, LoadBatch, MemberObject, ObjectIO, SaveResult, Session, start_engine_process
    from .store import KVStore, LoadItem
    from .store.hit_sources import UNKNOWN_TIER, HitSources
    from .store.page_loads import PagePart
    from .store.pins import PinOutcome, pin_trusted
    from .tiers.base import GetResult, Medium, PutItem, TierStatus
    from .tiers.host import resolve_memory
    from .tiers.parallel import conversion_threads
    from .tiers.reported import ReportedMemoryIndex, ReportedObject
    from .transfers import Finished, Gathered, LoadChunk, LoadJob, PlannedLoad, SaveJob, TransferRunner

__version__ = "0.1.0"

__all__ = [
    "AdapterEvent",
    "AdapterRefusal",
    "PagePart",
    "TransferRunner",
    "conversion_threads",
    "SaveJob",
    "PlannedLoad",
    "LoadJob",
    "LoadChunk",
    "Gathered",
    "Finished",
    "BadTenant",
    "CanonicalGeometry",
    "TilePacking",
    "paged_geometry",
    "vllm_cpu_geometry",
    "ChecksumPolicy",
    "ChunkFacts",
    "ChunkChain",
    "ChunkHash",
    "ClearReport",
    "ClearScope",
    "ClearTier",
    "ResetScope",
    "ConfigError",
    "Coverage",
    "DraftPlacement",
    "DraftPlacementMode",
    "DraftPolicy",
    "Expectation",
    "GetResult",
    "GroupKey",
    "GroupLookup",
    "HandoffClaim",
    "HeadRange",
    "HeadSplit",
    "HitPlan",
    "HitQuery",
    "KVLayoutSpec",
    "KVPackConfig",
    "KVPackError",
    "KVStore",
    "LayoutError",
    "LoadBatch",
    "LoadItem",
    "MAX_DETAIL_CHARS",
    "MemberObject",
    "MemberRole",
    "MemberSpec",
    "MemoryMode",
    "Metrics",
    "MetricsInterval",
    "ExportedCounter",
    "EngineCounters",
    "exported_counters",
    "parse_series_key",
    "series_key",
    "HitSources",
    "UNKNOWN_TIER",
    "Medium",
    "BatchFigures",
    "BatchLog",
    "Direction",
    "ModelIdentity",
    "ObjectHeader",
    "ObjectIO",
    "Payload",
    "PlannedTail",
    "PutItem",
    "Refusals",
    "RejectReason",
    "ReportedMemoryIndex",
    "ReportedObject",
    "RequestScope",
    "SaveResult",
    "Session",
    "SharedSweep",
    "FactsRow",
    "FactsTail",
    "RouterFacts",
    "new_origin",
    "shared_fact_tails",
    "shares_facts",
    "StoreKey",
    "StoredRange",
    "TailMatch",
    "TenantSource",
    "TierEvent",
    "TierEventFeed",
    "TierEventKind",
    "TierStatus",
    "PinOutcome",
    "WaitBudget",
    "address_of",
    "canonical_group_spec",
    "chain_hash",
    "checkpoint_kv_heads",
    "chunk_hashes",
    "member_name",
    "clip",
    "head_range_fingerprint",
    "identify_model",
    "adapter_identity",
    "resolve_memory",
    "pin_trusted",
    "resolve_tenant",
    "shared_tier_sweep",
    "shared_tier_sweeps",
    "split_sources",
    "start_engine_process",
    "tail_chunk",
    "tail_usable",
    "upload_runs",
    "validate_chunk_hashes",
    "validate_member",
    "WeightsOrigin",
    "WeightsState",
    "WeightsWatch",
    "with_weights",
]

__getattr__ = LazyExports.read(__name__, __file__).resolve
