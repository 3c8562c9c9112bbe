"""Data passed between the two halves of the connector (plain, picklable dataclasses).

Scheduler -> workers, once per step (`KVPackConnectorMetadata`): the blocks to
load into and the blocks to save, each with the chunk key it maps to. Workers
-> scheduler (`KVPackWorkerMetadata`, aggregated over ranks by vLLM): what each
worker put into or evicted from its host-memory tier, so the scheduler side
can answer lookups for memory it cannot see (vLLM's default multi-process mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvpack import ClearScope, HitPlan, ReportedObject, RouterFacts, WeightsState

NO_BLOCK = -1
"""`BlockRef.block_ids` entry of a KV cache group with nothing to copy for the chunk."""

NULL_BLOCK = 0
"""vLLM's null block id (a sliding-window block freed, a Mamba block not kept)."""


def block_at(group_blocks: Sequence[int], chunk: int) -> int:
    """The block of chunk `chunk` in one KV cache group's block table: NO_BLOCK past its
    end or where vLLM put its null block."""
    b = group_blocks[chunk] if chunk < len(group_blocks) else NULL_BLOCK
    return NO_BLOCK if b == NULL_BLOCK else int(b)


@dataclass(frozen=True)
class BlockRef:
    """One chunk of a request <-> its vLLM block in every KV cache group.

    `block_ids[g]` is the block of KV cache group g (one entry for a model
    with one group), or `NO_BLOCK` where that group's member is not copied:
    a sliding-window block vLLM already freed, a Mamba block between
    boundaries, a member that is already stored. `token_count` is the tokens
    the object covers (the block size, or a tail's length). `token_ids` is set
    for tail objects: on save, the tail's ids; on load, the ids the object's
    stored ids must start with. `with_draft` is False for a load of a chunk
    whose sidecar draft member is missing (``draft_policy: target_only``):
    only the target member is restored.
    """

    chunk: str
    block_ids: tuple[int, ...]
    token_count: int
    token_ids: tuple[int, ...] | None = None
    with_draft: bool = True
    tiers: tuple[tuple[str, str], ...] = ()
    """On load: (member, tier name) where the scheduler's lookup found each member of the
    chunk. The worker loads from that tier first and counts an object gone from it as
    ``evicted_before_load`` (`kvpack.store.lifecycle`); empty: no lookup found it (a tail, a handoff)."""
    source: int = 0
    """On load of canonical objects: the head split that holds this chunk (index into
    `HeadSplit.partitions()`; 0 is the engine's own). One request's chunks may come from
    several splits (`kvpack.policy.split_lookup`)."""
    announce: RouterFacts | None = None
    """On save of a whole chunk, with a tier other processes share: its vLLM facts for the other
    instances' routers (`kvpack.vllm_plugin.kv_events`), recorded by that tier (`kvpack.observe.router_facts`)."""

    @property
    def blocks(self) -> set[int]:
        """Every block this chunk copies to or from (what a failed load reports)."""
        return {b for b in self.block_ids if b != NO_BLOCK}


@dataclass(frozen=True)
class TransferJob:
    """All blocks of one request to load or to save this step."""

    req_id: str
    tenant: str
    blocks: tuple[BlockRef, ...]
    capture: bool = False
    """A save of blocks this step computed (`captures`): copied out in this step's
    ``wait_for_save``, stored in the background, never reported as the request's
    finished send."""
    handoff_wait_s: float = 0.0
    """A load of a prefill instance's prompt (`handoff`): its objects may still be
    landing in the shared tier; wait at most this long for them, then load what is there."""
    sync: bool = False
    """A load inside this step (vLLM's synchronous load): the worker copies it before the
    forward that computes the rest of the prompt; failed blocks are recomputed. Only for
    hits in the workers' memory (`SchedulerSide`); every other load is asynchronous."""
    weights: str = ""
    """The weights identity the request was planned under (`kvpack.WeightsState.identity`):
    a worker holding other weights refuses the load and drops the save."""


@dataclass
class KVPackConnectorMetadata(KVConnectorMetadata):
    loads: list[TransferJob] = field(default_factory=list)
    saves: list[TransferJob] = field(default_factory=list)
    clear: ClearScope | None = None
    """A reset the scheduler applied: each worker applies it to its own tiers before this step's loads."""


StoredObject = ReportedObject
"""An object a worker put into its memory tier (`kvpack.ReportedObject`)."""


@dataclass
class KVPackWorkerMetadata(KVConnectorWorkerMetadata):
    stored: list[StoredObject] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    """Group keys (``GroupKey.as_str()``) evicted from memory."""
    failed_loads: list[str] = field(default_factory=list)
    """Requests with a block that could not be loaded: never offered again (vLLM recomputes)."""
    weights: WeightsState | None = None
    """The worker's weights, when they changed since its last report (None: no news)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVPackWorkerMetadata):
            weights = self.weights
            if other.weights is not None and (weights is None or other.weights.newer_than(weights)):
                weights = other.weights
            failed = self.failed_loads + other.failed_loads
            return KVPackWorkerMetadata(self.stored + other.stored, self.evicted + other.evicted, failed, weights)
        return self


def hit_refs(
    plan: HitPlan, block_ids: Sequence[Sequence[int]], external_tokens: int, block_size: int, state_groups: set[int]
) -> tuple[BlockRef, ...]:
    """The blocks vLLM allocated for the last `external_tokens` of `plan`'s hit, one `BlockRef`
    per chunk (its tiers and head split from the plan; the plan's tail as the last one).
    Per group (`block_ids`), every allocated block, except that Mamba state (`state_groups`)
    goes into the boundary block only."""
    first = (plan.matched - external_tokens) // block_size
    last = -(-plan.matched // block_size)  # ceil
    refs: list[BlockRef] = []
    for i in range(first, last):
        boundary = i == last - 1
        ids = tuple(
            NO_BLOCK if g in state_groups and not boundary else block_at(group, i) for g, group in enumerate(block_ids)
        )
        if i < plan.hit_chunks:
            tiers = plan.tiers[i] if i < len(plan.tiers) else ()
            source = plan.sources[i] if i < len(plan.sources) else 0
            with_draft = i < plan.full_chunks
            refs.append(BlockRef(plan.hashes[i], ids, block_size, with_draft=with_draft, tiers=tiers, source=source))
        else:
            assert plan.tail is not None and i == plan.hit_chunks
            t = plan.tail
            refs.append(BlockRef(t.chunk, ids, t.stored_tokens, t.token_ids, t.with_draft, source=t.source))
    return tuple(refs)
