"""Scheduler side: what to load for a new request, what to save for a finished one.

Lookup (`get_num_new_matched_tokens`): one batched `KVStore.lookup` over the
chained keys of every full block of the request, then the stored tail after
the last hit block (`KVStore.find_tail`): the longest common prefix with it,
rounded down to `prefix_match_unit`. The count may end inside a block: the
partial block is loaded whole and vLLM computes the rest into it. vLLM must
compute at least one token, so a prompt stored whole hits n - 1 tokens.
Loads are asynchronous (the request waits in WAITING_FOR_REMOTE_KVS while a
worker thread restores it).

Save (`request_finished`): every computed token (prompt and generated, never
beyond `num_computed_tokens`): full blocks not stored yet, plus the last
partial block as a tail object carrying its token ids. The request's blocks
stay allocated (delayed free) until the workers report the copy done.

Draft KV (speculative decoding): packed into the ``kv`` objects, or, as a
sidecar, a ``draft`` member (role DRAFT) of every chunk's group. Lookups
declare it, so the core's draft policy decides: ``recompute`` reports no hit
past the first chunk that lacks it, ``target_only`` loads the target member
only for those chunks (`BlockRef.with_draft`); both count
``partial_hits{missing_member="draft"}``.

The store seen here has the workers' memory tiers as a `ReportedMemoryIndex`
(fed by worker reports) in front of the shared tiers (disk, Mooncake).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpack.config import KVPackConfig
from kvpack.groups import MemberRole, MemberSpec
from kvpack.keys import ChunkHash, chunk_hashes
from kvpack.store import KVStore, build_tiers
from kvpack.tiers.base import Tier

from .index import ReportedMemoryIndex
from .metadata import BlockRef, KVPackConnectorMetadata, KVPackWorkerMetadata, TransferJob
from .settings import BadTenant, RequestScope, Scope, cacheable, request_scope

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger("kvpack.vllm")


@dataclass(frozen=True)
class LoadPlan:
    """The outcome of one request's lookup (memoised: vLLM may ask more than once)."""

    num_tokens: int
    scope: RequestScope | None
    hashes: tuple[ChunkHash, ...]
    hit_chunks: int
    matched: int
    """Tokens loadable from the store (capped at num_tokens - 1)."""
    tail: BlockRef | None
    """The tail object to load into block `hit_chunks`, when the match reaches into it."""
    full_chunks: int = 0
    """Leading hit chunks with every member; chunks `full_chunks..hit_chunks` lack
    the sidecar draft (target_only) and load the target member only."""


class SchedulerSide:
    def __init__(self, config: KVPackConfig, scope: Scope, can_load: bool, can_save: bool) -> None:
        self.config = config
        self.scope = scope
        self.can_load = can_load
        self.can_save = can_save
        self.index = ReportedMemoryIndex()
        tiers: list[Tier] = [self.index] if config.memory.enabled else []
        self.store = KVStore(config, tiers + build_tiers(config, include_memory=False))
        self.members = [MemberSpec(name, scope.fingerprint) for name in scope.members] + [
            MemberSpec(name, scope.fingerprint, MemberRole.DRAFT) for name in scope.draft_members
        ]
        self._plans: dict[str, LoadPlan] = {}
        self._load_issued: set[str] = set()
        """Requests whose load was handed to the workers: at most one load attempt each."""
        self._pending_loads: dict[str, TransferJob] = {}
        self._pending_saves: list[TransferJob] = []
        self._saving: set[str] = set()
        self._stats: dict[str, float] = {}
        self._bad_tenants_logged: set[str] = set()
        self._failed: set[str] = set()

    # -- lookup -----------------------------------------------------------------

    def _scope_of(self, request: Request) -> RequestScope | None:
        if not cacheable(request):
            return None
        try:
            return request_scope(request, self.config.tenant)
        except BadTenant as exc:
            if request.request_id not in self._bad_tenants_logged:
                self._bad_tenants_logged.add(request.request_id)
                log.warning("kvpack: request %s runs without the cache: %s", request.request_id, exc)
            self._count("bad_tenant")
            return None

    def plan(self, request: Request) -> LoadPlan:
        n = int(request.num_tokens)
        cached = self._plans.get(request.request_id)
        if cached is not None and cached.num_tokens == n:
            return cached
        rs = self._scope_of(request)
        if rs is None:
            plan = LoadPlan(n, None, (), 0, 0, None)
        elif request.request_id in self._failed:  # a load failed once: recompute, never retry
            plan = LoadPlan(n, rs, (), 0, 0, None)
        else:
            plan = self._lookup(request, rs, n)
        self._plans[request.request_id] = plan
        return plan

    def _lookup(self, request: Request, rs: RequestScope, n: int) -> LoadPlan:
        bs = self.scope.block_size
        tokens = list(request.all_token_ids[:n])
        hashes = tuple(chunk_hashes(tokens, bs, parent=rs.seed))
        result = self.store.lookup(rs.tenant, self.scope.fingerprint, hashes, self.members, bs)
        k = result.hit_chunks
        if result.partial:
            self._count("partial_hit_chunks", result.target_chunks - result.full_chunks)
        matched = k * bs
        tail: BlockRef | None = None
        if self.config.tail_reuse and k * bs < n - 1:
            parent = hashes[k - 1] if k else rs.seed
            rest = tokens[k * bs : min(n - 1, (k + 1) * bs)]
            tm = self.store.find_tail(
                rs.tenant, self.scope.fingerprint, parent, rest, self.members, self.config.prefix_match_unit
            )
            if tm is not None and tm.tokens > 0:
                with_draft = all(m in tm.members for m in self.scope.draft_members)
                tail = BlockRef(tm.chunk, -1, tm.stored_tokens, tuple(rest[: tm.tokens]), with_draft)
                matched = k * bs + tm.tokens
        matched = min(matched, n - 1)
        partial = matched % bs
        matched -= partial % self.config.prefix_match_unit
        if tail is not None:
            used = matched - k * bs
            if used <= 0:
                tail = None
            else:
                tail = BlockRef(tail.chunk, -1, tail.token_count, tail.token_ids[:used], tail.with_draft)  # type: ignore[index]
                self.store.metrics.inc("tail_hit_tokens", used, tenant=rs.tenant)
        return LoadPlan(n, rs, hashes, k, max(matched, 0), tail, min(result.full_chunks, k))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.can_load:
            return 0, False
        if request.request_id in self._load_issued:
            # vLLM asks again only after the load failed (bad object, tier error, timeout: the
            # blocks were reported and num_computed_tokens went back to 0) or after a
            # preemption. The store would give the same answer, so offering the hit again
            # would loop forever on a refused object: recompute instead.
            return 0, False
        plan = self.plan(request)
        if plan.matched <= num_computed_tokens:
            return 0, False
        return plan.matched - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        plan = self._plans.get(request.request_id)
        if plan is None or plan.scope is None:
            return
        bs = self.scope.block_size
        block_ids = blocks.get_block_ids()[0]
        first = (plan.matched - num_external_tokens) // bs
        last = -(-plan.matched // bs)  # ceil
        refs: list[BlockRef] = []
        for i in range(first, last):
            if i < plan.hit_chunks:
                refs.append(BlockRef(plan.hashes[i], block_ids[i], bs, with_draft=i < plan.full_chunks))
            else:
                assert plan.tail is not None and i == plan.hit_chunks
                t = plan.tail
                refs.append(BlockRef(t.chunk, block_ids[i], t.token_count, t.token_ids, t.with_draft))
        self._pending_loads[request.request_id] = TransferJob(request.request_id, plan.scope.tenant, tuple(refs))
        self._load_issued.add(request.request_id)
        self._count("hit_tokens", num_external_tokens)
        self._count("load_requests")

    def build_connector_meta(self) -> KVPackConnectorMetadata:
        meta = KVPackConnectorMetadata(list(self._pending_loads.values()), self._pending_saves)
        self._pending_loads = {}
        self._pending_saves = []
        return meta

    # -- save -------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        plan = self._plans.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        refresh = request.request_id in self._failed  # overwrite what could not be loaded
        self._failed.discard(request.request_id)
        self._load_issued.discard(request.request_id)
        self._bad_tenants_logged.discard(request.request_id)
        if not self.can_save:
            return False, None
        rs = plan.scope if plan is not None else self._scope_of(request)
        if rs is None:
            return False, None
        bs = self.scope.block_size
        n = min(int(request.num_computed_tokens), len(request.all_token_ids))
        if n <= 0:
            return False, None
        tokens = list(request.all_token_ids[:n])
        hashes = chunk_hashes(tokens, bs, parent=rs.seed)
        # chained keys: the plan's hit chunks are a prefix of these, already stored
        known = min(plan.hit_chunks, len(hashes)) if plan is not None else 0
        refs: list[BlockRef] = []
        todo = hashes[known:]
        if refresh:
            refs.extend(BlockRef(chunk, block_ids[i], bs) for i, chunk in enumerate(hashes) if i < len(block_ids))
        elif todo:
            presence = self.store.contains_members(rs.tenant, self.scope.fingerprint, todo, self.scope.all_members)
            for j, (chunk, present) in enumerate(zip(todo, presence)):
                if not all(present.values()):
                    i = known + j
                    if i < len(block_ids):
                        refs.append(BlockRef(chunk, block_ids[i], bs))
        t = n % bs
        if t and self.config.tail_reuse and len(hashes) < len(block_ids):
            tail_ids = tuple(int(x) for x in tokens[len(hashes) * bs :])
            chunk, stored = self.store.place_tail(
                rs.tenant,
                self.scope.fingerprint,
                hashes[-1] if hashes else rs.seed,
                (self.scope.members[0], *self.scope.draft_members),
                tail_ids,
            )
            if refresh or not stored:
                refs.append(BlockRef(chunk, block_ids[len(hashes)], t, tail_ids))
        if not refs:
            return False, None
        self._pending_saves.append(TransferJob(request.request_id, rs.tenant, tuple(refs)))
        self._saving.add(request.request_id)
        self._count("save_blocks", len(refs))
        return True, None

    # -- worker reports ---------------------------------------------------------

    def update_connector_output(self, finished_sending: set[str] | None, report: Any) -> None:
        for req_id in finished_sending or ():
            self._saving.discard(req_id)
        if isinstance(report, KVPackWorkerMetadata):
            self.index.apply(report.stored, report.evicted)
            for req_id in report.failed_loads:
                self._failed.add(req_id)
                self._plans.pop(req_id, None)

    def take_stats(self) -> dict[str, float]:
        stats, self._stats = self._stats, {}
        return stats

    def _count(self, name: str, amount: float = 1) -> None:
        self._stats[name] = self._stats.get(name, 0) + amount

    def close(self) -> None:
        self.store.close(flush_timeout_s=1.0)
