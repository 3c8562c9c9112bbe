"""kvpack's tiers as vLLM KV events (``--kv-events-config``), for KV-aware routers.

The core reports what each tier took and let go (`kvpack.TierEvent`: one group on one tier).
This module carries those events from the workers to the scheduler through vLLM's own
connector path (`get_kv_connector_kv_cache_events` -> ``KVConnectorOutput.kv_cache_events``
-> `update_connector_output`) and translates them there into vLLM's ``BlockStored`` /
``BlockRemoved``, which vLLM's scheduler publishes with its own (``take_events``).

Only the scheduler side knows a group's vLLM block hash: when it plans a save it has the
request, so `RouterEvents.note_saves` remembers, per saved chunk, the request's block hash(es),
the parent hash, the token ids, the block size and the LoRA adapter (bounded: the oldest go
first; one that goes while announced is announced removed, so a router never keeps a block
kvpack can no longer withdraw). A stored event is published once per tier; a removal only for
a tier it was announced on.

Medium per tier (vLLM's own names, as its offloading connector uses them), with the tier's
name as ``ownership`` and its locality:

=========  =========  ========  ==========================================
tier       medium     locality  removals reported
=========  =========  ========  ==========================================
memory     CPU        LOCAL     evictions and removals in this instance
host       CPU        LOCAL     those this instance made, and those other
                                processes made (swept: `kvpack.SharedSweep`)
disk       STORAGE    LOCAL     those this instance made, and those other
                                processes sharing the folder made (swept)
mooncake   STORAGE    REMOTE    none of the master's own evictions
=========  =========  ========  ==========================================

Another process's evictions of a shared tier (the host store, the disk folder): the core's
`kvpack.SharedSweep` of each such tier follows the blocks announced on it and, once per step
(`take`), checks a bounded slice of them in that tier's index; this module only turns the groups
it finds gone into ``BlockRemoved`` (the tier's medium), through the same translation as the
workers' own removals, so a block is withdrawn once whichever comes first.

Blocks other instances stored on a shared tier (this instance can load them): with such a tier,
`note_saves` hands each saved chunk's facts (not those of a salted request's chunk, which only
this instance announces: `kvpack.policy.tenancy.shares_facts`) to its save (`BlockRef.announce`,
encoded by `kvpack.vllm_plugin.block_facts`), which the tier records beside the group once the object is
ready (`kvpack.observe.router_facts`). Each step `take` reads at most 64 rows other instances wrote
(`kvpack.FactsTail`: one indexed read) and announces those of its own hash identity and model
layout as ``BlockStored`` on that tier (the writer's hashes), once; the tier's sweep then follows
them like its own, so they are withdrawn when evicted.

Not reported: partial-block tails (vLLM hashes whole blocks only), blocks promoted into memory
by a read from a lower tier, a chunk larger than vLLM's hash block that is not a multiple of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import BlockHash, ExternalBlockHash

from kvpack import (
    BadTenant,
    ChunkChain,
    FactsTail,
    GroupKey,
    KVPackConfig,
    RouterFacts,
    Session,
    SharedSweep,
    TierEvent,
    TierEventFeed,
    TierEventKind,
    new_origin,
    shared_fact_tails,
    shared_tier_sweeps,
    shares_facts,
)
from vllm import envs

from .block_facts import BlockFacts, decode, encode, identity_source
from .metadata import KVPackConnectorMetadata, TransferJob
from .request_scopes import request_scope

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from .scopes import Scope as EngineScope

MEDIUMS: dict[str, tuple[str, str]] = {
    "memory": (MEDIUM_CPU, "LOCAL"),
    "host": (MEDIUM_CPU, "LOCAL"),
    "disk": (MEDIUM_STORAGE, "LOCAL"),
    "mooncake": (MEDIUM_STORAGE, "REMOTE"),
}
"""kvpack tier name -> (vLLM event medium, locality). Any other tier: STORAGE, no locality."""

MAX_BLOCKS = 1 << 17
"""Saved chunks whose vLLM facts the scheduler keeps (about 300 bytes + token ids each)."""
_LOW64 = (1 << 64) - 1
MAX_REQUESTS = 4096
"""Live requests followed for their block hashes (vLLM's scheduler holds them anyway)."""


def medium_of(tier: str) -> tuple[str, str | None]:
    """(medium, locality) of a kvpack tier's events."""
    return MEDIUMS.get(tier, (MEDIUM_STORAGE, None))


class KVPackKVEvents(KVConnectorKVEvents):
    """One step's tier events of the workers (vLLM merges the ranks' into the first's)."""

    def __init__(self, events: Sequence[TierEvent] = (), workers: int = 1) -> None:
        self._events: list[TierEvent] = list(events)
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(e for e in events if isinstance(e, TierEvent))

    def aggregate(self) -> KVPackKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)  # type: ignore[arg-type]  # kvpack's own events, translated by RouterEvents

    def tier_events(self) -> list[TierEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []


def worker_events(feed: TierEventFeed | None) -> KVPackKVEvents | None:
    """What this worker's tiers took and let go since the last step (None: nothing, or events off)."""
    if feed is None:
        return None
    events = feed.take()
    return KVPackKVEvents(events) if events else None


@dataclass
class _Followed:
    request: Request
    chain: ChunkChain
    """Its chunk hashes (kvpack's chain from its scope's seed), extended as its blocks are hashed."""
    shares: bool
    """Its blocks' facts may go to a shared tier (`kvpack.policy.tenancy.shares_facts`: unsalted)."""
    index: dict[str, int] = field(default_factory=dict)


class RouterEvents:
    """Scheduler side: kvpack tier events -> vLLM ``BlockStored`` / ``BlockRemoved`` (module docstring).

    `block_size` is kvpack's chunk (the engine block) in tokens; `hash_block_size` the tokens per
    vLLM request block hash (a chunk carries ``block_size // hash_block_size`` of them)."""

    def __init__(
        self,
        config: KVPackConfig,
        fingerprint: str,
        block_size: int,
        hash_block_size: int,
        max_blocks: int = MAX_BLOCKS,
        sweeps: Sequence[SharedSweep] = (),
        tails: Sequence[FactsTail] = (),
        identity: Callable[[], str | None] = lambda: None,
    ) -> None:
        """`sweeps`: the core's check of each shared tier's blocks announced here (none: no shared
        tier); `tails`: its reader of each shared tier's facts rows (`FactsTail`, whose `origin`
        names this instance's rows); `identity`: this engine's hash identity (`hash_identity`)."""
        self._config = config
        self._fingerprint = fingerprint
        self._bs = block_size
        self._per_chunk = block_size // hash_block_size if hash_block_size and block_size % hash_block_size == 0 else 0
        self._max_blocks = max_blocks
        self._warned = threading.Event()
        self._warned.set()  # the scheduler already warned about the request's tenant
        self._requests: OrderedDict[str, _Followed] = OrderedDict()
        self._finished: set[str] = set()
        self._blocks: OrderedDict[tuple[str, str], BlockFacts] = OrderedDict()
        self._out: list[KVCacheEvent] = []
        self._sweeps = {s.tier.name: s for s in sweeps}
        self._tails = list(tails)
        self._identity = identity
        self._int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        """vLLM's event hash form (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), read once: vLLM's own
        `maybe_convert_block_hash` reads the environment per hash (most of a step's cost here)."""

    def rescope(self, fingerprint: str) -> None:
        """The engine's weights changed in place: other instances' facts of this group fingerprint
        are announced from now on (blocks already announced are withdrawn as the tiers evict them)."""
        self._fingerprint = fingerprint

    # -- requests and saves ---------------------------------------------------------

    def follow(self, request: Request) -> None:
        """Keep `request` until its saves are planned (its block hashes grow as it runs)."""
        rid = request.request_id
        if rid in self._requests or not self._per_chunk:
            return
        try:
            scope = request_scope(request, self._config, None, self._warned)
        except BadTenant:
            return
        self._requests[rid] = _Followed(request, ChunkChain(scope.seed, self._bs), shares_facts(scope))
        while len(self._requests) > MAX_REQUESTS:
            self._requests.popitem(last=False)

    def finished(self, req_id: str) -> None:
        """The request ended: forget it after the saves planned at its end."""
        if req_id in self._requests:
            self._finished.add(req_id)

    def note_saves(self, meta: KVPackConnectorMetadata) -> None:
        """Remember the vLLM facts of every whole chunk this step's saves store."""
        for job in meta.saves:
            followed = self._requests.get(job.req_id)
            if followed is None:
                continue
            for ref in job.blocks:
                if ref.token_ids is None and (job.tenant, ref.chunk) not in self._blocks:
                    self._remember(job.tenant, ref.chunk, followed)
        for rid in self._finished:
            self._requests.pop(rid, None)
        self._finished.clear()
        identity = self._identity() if self._tails else None
        if identity is not None:  # a shared tier records them for the other instances' routers
            meta.saves = [self._announcing(job, identity) for job in meta.saves]

    def _announcing(self, job: TransferJob, identity: str) -> TransferJob:
        """`job` with each whole chunk's facts (`BlockRef.announce`) where they are known."""
        origin = self._tails[0].origin
        refs = []
        for ref in job.blocks:
            block = self._blocks.get((job.tenant, ref.chunk)) if ref.token_ids is None else None
            if block is None or not block.shared:
                refs.append(ref)  # a tail, unknown, or a salted request's block: no facts row
                continue
            facts = RouterFacts(origin, identity, encode(block, self._bs // self._per_chunk))
            refs.append(replace(ref, announce=facts))
        return replace(job, blocks=tuple(refs))

    def _remember(self, tenant: str, chunk: str, f: _Followed) -> None:
        i = f.index.get(chunk)
        if i is None:
            i = self._extend(f, chunk)
            if i is None:
                return
        hashes = f.request.block_hashes[i * self._per_chunk : (i + 1) * self._per_chunk]
        if len(hashes) < self._per_chunk:
            return
        lora = getattr(f.request, "lora_request", None)
        self._keep(
            (tenant, chunk),
            BlockFacts(
                hashes=list(hashes),
                parent=f.request.block_hashes[i * self._per_chunk - 1] if i else None,
                token_ids=list(f.request.all_token_ids[i * self._bs : (i + 1) * self._bs]),
                lora_id=getattr(lora, "lora_int_id", None),
                lora_name=getattr(lora, "lora_name", None),
                shared=f.shares,
            ),
        )

    def _keep(self, key: tuple[str, str], block: BlockFacts) -> None:
        """Remember `block` (the oldest go past `max_blocks`, withdrawn where announced)."""
        self._blocks[key] = block
        while len(self._blocks) > self._max_blocks:
            _, old = self._blocks.popitem(last=False)
            self._out.extend(self._removed(old, sorted(old.tiers)))
            if old.group is not None:
                for sweep in self._sweeps.values():
                    sweep.forget(old.group)

    def _extend(self, f: _Followed, chunk: str) -> int | None:
        """Hash the request's whole chunks not hashed yet (kvpack's chain); `chunk`'s index or None."""
        have = len(f.chain.hashes)
        for i, h in enumerate(f.chain.extend(f.request.all_token_ids, len(f.request.block_hashes) // self._per_chunk)):
            f.index[str(h)] = have + i
        return f.index.get(chunk)

    # -- tier events -----------------------------------------------------------------

    def on_worker_events(self, events: KVConnectorKVEvents | None) -> None:
        """Translate the workers' tier events (``KVConnectorOutput.kv_cache_events``)."""
        if isinstance(events, KVPackKVEvents):
            self.translate(events.tier_events())

    def translate(self, events: Iterable[TierEvent]) -> None:
        for event in events:
            try:
                group = GroupKey.parse(event.group)
            except ValueError:
                continue
            if group.fingerprint == self._fingerprint:  # else another model's group on a shared tier
                self._apply(event.kind, event.tier, group)

    def _apply(self, kind: TierEventKind, tier: str, group: GroupKey) -> None:
        """One tier event of a group of this model: announce or withdraw its block, once."""
        block = self._blocks.get((group.tenant, group.chunk))
        if block is None:
            return  # not stored by this instance (or forgotten): never announced
        sweep = self._sweeps.get(tier)
        if kind is TierEventKind.STORED and tier not in block.tiers:
            block.tiers.add(tier)
            self._out.append(self._stored(block, tier))
            if sweep is not None:
                block.group = group
                self.translate(sweep.announced(group))
        elif kind is TierEventKind.REMOVED and tier in block.tiers:
            block.tiers.discard(tier)
            self._out.extend(self._removed(block, [tier]))
            if sweep is not None:
                sweep.forget(group)

    def take(self) -> list[KVCacheEvent]:
        """The vLLM events since the last call (vLLM's scheduler publishes them each step), with
        this step's blocks other instances stored on each shared tier (`kvpack.FactsTail`) and
        this step's sweep of each (`kvpack.SharedSweep`: a bounded, batched check)."""
        identity = self._identity() if self._tails else None
        if identity is not None:
            for tail in self._tails:
                for row in tail.take(identity):
                    self._foreign(tail.tier.name, row.group, row.facts.blob)
        for sweep in self._sweeps.values():
            self.translate(sweep.sweep())
        out, self._out = self._out, []
        return out

    def _foreign(self, tier: str, group: GroupKey, blob: bytes) -> None:
        """Announce a block another instance stored on shared `tier` (once: not if announced there)."""
        if group.fingerprint != self._fingerprint:
            return  # another model's group
        key = (group.tenant, group.chunk)
        block = self._blocks.get(key)
        if block is None:
            block = decode(blob, self._bs // self._per_chunk, self._per_chunk)
            if block is None:
                return
            self._keep(key, block)
        self._apply(TierEventKind.STORED, tier, group)

    def _external(self, h: BlockHash) -> ExternalBlockHash:
        """`h` as vLLM's events carry it: vLLM's `maybe_convert_block_hash` (its low 64 bits, big
        endian, as an int; the engine tests compare with vLLM's function)."""
        return int.from_bytes(h, byteorder="big") & _LOW64 if self._int_hashes else h

    def _stored(self, block: BlockFacts, tier: str) -> BlockStored:
        medium, locality = medium_of(tier)
        return BlockStored(
            block_hashes=[self._external(h) for h in block.hashes],
            parent_block_hash=self._external(block.parent) if block.parent is not None else None,
            token_ids=list(block.token_ids),
            block_size=self._bs // self._per_chunk,
            lora_id=block.lora_id,
            medium=medium,
            lora_name=block.lora_name,
            locality=locality,
            ownership=tier,
        )

    def _removed(self, block: BlockFacts, tiers: Iterable[str]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for tier in tiers:
            medium, locality = medium_of(tier)
            hashes = [self._external(h) for h in block.hashes]
            out.append(BlockRemoved(block_hashes=hashes, medium=medium, locality=locality, ownership=tier))
        return out


def events_enabled(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config '{"enable_kv_cache_events": true, ...}'``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


def router_events(
    vllm_config: VllmConfig, config: KVPackConfig, scope: EngineScope, session: Session
) -> RouterEvents | None:
    """The scheduler side's translator, or None when vLLM publishes no KV events (no cost);
    `session` is the scheduler's, whose shared tiers (if any) the sweeps read."""
    if not events_enabled(vllm_config):
        return None
    block_size = int(vllm_config.cache_config.block_size)
    sweeps = shared_tier_sweeps(session)
    tails = shared_fact_tails(session, new_origin())
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    return RouterEvents(
        config,
        scope.fingerprint,
        scope.block_size,
        block_size,
        sweeps=sweeps,
        tails=tails,
        identity=identity_source(algo, block_size),
    )


def tier_feed(vllm_config: VllmConfig, session: Session) -> TierEventFeed | None:
    """A worker's feed of its tiers' events, or None when vLLM publishes no KV events (no cost)."""
    return session.report.tier_events() if events_enabled(vllm_config) else None
