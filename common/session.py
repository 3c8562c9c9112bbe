"""Session: the one door an engine adapter uses into the core.

An adapter hands a session engine facts only: which tenant, which chunks (SGLang's
page hashes, vLLM's chained block hashes), which member object it registered once
(`MemberObject`: member name, member fingerprint, tokens and bytes per chunk), and the
buffers to copy from or into. The session builds every `StoreKey`, `ObjectHeader`,
`Expectation`, `PutItem` and `LoadItem`; remembers where a lookup found each object
(`LocatedHints`, bounded) for the load that follows in the same process;
de-duplicates saves through `KVStore.prepare_store` -> `complete_store`; and runs an
engine process's start-up steps (`start_engine_process`). Adapters never build keys,
headers or expectations themselves (tests/common/test_structure.py holds it).

Two shapes of call, one behaviour:

- page batches (`save_pages`, `page_reads`): many chunks of one member with one
  token count and one payload size, built with the batch builders (one validation per
  batch, not one constructor call per object: SGLang sends hundreds of pages a call);
- objects (`save`, `reads`): chunks with their own token facts (`ChunkFacts`: a
  partial block's token count, a tail's token ids), vLLM's blocks and tails.

Hits are planned here too (`plan_hit`, `plan_handoff`, `lookups_held`; the rules live in
`kvpack.policy.hits`): an adapter states a request's facts (`HitQuery`) and reads the `HitPlan`.

Loads are two-phase, as the store's are: `prepare_load` pins what is in this
process's memory and fixes the tier to read each object from (the hints given, else
the ones this session's own lookups remembered); `complete_load` reads and releases.
An adapter may wait between the two (vLLM waits for earlier saves and for a
prefill instance's handoff); `release` gives the pins back without reading.

Thread-safe: the hints are behind a lock; everything else is the store's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .client_input import Refusals
from .config.schema import KVPackConfig
from .cpu_features import request_amx_permission
from .identity.keys import StoreKey, chunk_hashes, validate_chunk_hashes
from .identity.objects import Expectation, ObjectHeader, PageExpectation, Payload, payload_nbytes
from .observe.adapter_events import AdapterEvent, AdapterRefusal
from .observe.metrics import Metrics
from .observe.router_facts import RouterFacts
from .observe.tier_events import TierEventFeed
from .ops import load_extension, object_reader, object_remover, object_writer, region_copier
from .policy.budget import WaitBudget
from .policy.clearing import ClearReport, ClearScope, engine_scope
from .policy.groups import GroupLookup, MemberSpec
from .policy.hits import HandoffClaim, HitPlan, HitQuery, plan_handoff, plan_lookup
from .policy.tails import TailMatch
from .policy.tenancy import RequestScope
from .store import KVStore, LentLoad, LoadItem, LoadPlan, PageReads
from .store.hit_sources import HitSources, hit_sources
from .store.located import LocatedHints
from .store.page_loads import PagePart, load_pages, located_splits
from .store.pins import PinOutcome
from .tiers.base import GetResult, PutItem, Tier, TierStatus

log = logging.getLogger("kvpack")

_ADAPTER_REFUSALS = "tier_errors"
"""The counter of engine calls an adapter answered as a miss itself (`AdapterRefusal`)."""


def start_engine_process() -> None:
    """An engine process's start-up steps, before its first forward (idempotent).

    Ask Linux for AMX tile state (a short step over restored KV may be the
    process's first AMX use, which the kernel refuses with SIGILL otherwise:
    `kvpack.cpu_features`), and build or load the copy kernels now, not inside
    the first load's time bound (`kvpack.ops.load_extension`: cached per machine,
    never raises; without it the torch fallback copies). Imports torch: `import
    kvpack` itself stays light for the operator tools."""

    request_amx_permission()
    load_extension()


@dataclass(frozen=True, slots=True)
class MemberObject:
    """One member's object per chunk, as an adapter registered it once.

    `fingerprint` is the member fingerprint every header carries and every load
    requires; `chunk_tokens` the tokens of a whole page (the page calls' token count;
    the object calls take each chunk's own, `ChunkFacts`); `payload_len` the bytes of
    one object (None: the caller's buffer says, e.g. a head range of another TP size)."""

    member: str
    fingerprint: str
    chunk_tokens: int = 0
    payload_len: int | None = None


@dataclass(frozen=True, slots=True)
class ChunkFacts:
    """One chunk of a save or load with its own token facts.

    `token_count`: tokens the object holds (a whole chunk, or a partial block's
    computed part). `token_ids`: a tail's ids (stored in its header; a load requires
    the stored ids to start with them); None for a whole chunk. `announce`: on save, what
    a shared tier records for other instances' routers (`kvpack.observe.router_facts`)."""

    chunk: str
    token_count: int
    token_ids: tuple[int, ...] | None = None
    announce: RouterFacts | None = None


@dataclass(frozen=True, slots=True)
class ObjectIO:
    """One object to save or load: a chunk's facts, the member's object and the buffer
    (the payload to store, or the destination of exactly the object's payload size)."""

    facts: ChunkFacts
    obj: MemberObject
    buffer: Payload


@dataclass
class LoadBatch:
    """A prepared load: the items (one per object, in the caller's order) and the store's plan."""

    items: list[LoadItem]
    plan: LoadPlan


class Session:
    """One engine process's door into the core (see the module docstring).

    `group_fingerprint` scopes every key (the layout's group fingerprint); an adapter
    that learns it at registration sets it with `bind_group` before its first call."""

    def __init__(self, store: KVStore, group_fingerprint: str = "", hints: LocatedHints | None = None) -> None:
        self.store = store
        self.group_fingerprint = group_fingerprint
        self.hints = hints if hints is not None else LocatedHints()
        self._held_logged = threading.Event()
        self._last_keys: tuple[str, str, str, list[str], list[StoreKey]] | None = None
        """(tenant, fingerprint, member, chunks, keys) of the last `keys` batch (`keys`)."""

    @classmethod
    def start(
        cls, config: KVPackConfig, group_fingerprint: str = "", *, copy_threads: int = 1, write_back: bool = True
    ) -> Session:
        """An engine process's session: `start_engine_process`, then the store the config
        enables, whose memory-tier copies use the native region copy and whose host and disk
        tiers the native batch file write, read and removal, once the kernels loaded."""

        start_engine_process()
        store = KVStore.from_config(
            config,
            copy_threads=copy_threads,
            region_copier=region_copier,
            object_writer=object_writer,
            object_remover=object_remover,
            object_reader=object_reader,
            write_back=write_back,
        )
        return cls(store, group_fingerprint)

    @classmethod
    def reader(cls, config: KVPackConfig, leading: Sequence[Tier], group_fingerprint: str = "") -> Session:
        """A lookup-only session (vLLM's scheduler process): `leading` tiers (a view of
        another process's memory) before the lower tiers the config enables, behind the host
        store if any (`KVStore.reader`); stores refused.
        It remembers no locations: its lookups' `GroupLookup.located` travel to the
        processes that load (as `prepare_load` hints)."""
        return cls(KVStore.reader(config, leading), group_fingerprint, LocatedHints(capacity=0))

    def bind_group(self, group_fingerprint: str, label: str = "") -> None:
        """Scope every key by `group_fingerprint` from now on; `label` (`KVLayoutSpec.label`) names it
        in the shared indexes for ``kvpack usage``."""
        self.group_fingerprint = group_fingerprint
        if label:
            self.store.name_group(group_fingerprint, label)

    def reset(self, who: str) -> ClearReport | None:
        """The engine's reset verb (vLLM ``reset_cache``, SGLang ``clear``): the config's ``reset``
        rule over the fingerprints bound *now* (`kvpack.policy.clearing.engine_scope`), logged in one
        line; None (logged) when ``reset.scope`` is off."""
        scope = engine_scope(self.store.config.reset, (self.group_fingerprint,))
        if scope is None:
            log.info("kvpack: %s: reset.scope is off; nothing removed", who)
            return None
        return self.clear(scope, who=who)

    def clear(self, scope: ClearScope, dry_run: bool = False, who: str = "clear") -> ClearReport:
        """Remove what `scope` names from this process's tiers (`KVStore.clear`), logged in one line."""
        report = self.store.clear(scope, dry_run)
        log.log(logging.INFO if report.ok else logging.WARNING, "kvpack: %s", report.line(who))
        return report

    # -- keys -----------------------------------------------------------------------

    def key(self, tenant: str, chunk: str, member: str) -> StoreKey:
        return StoreKey(tenant, self.group_fingerprint, chunk, member)

    def keys(self, tenant: str, chunks: Sequence[str], member: str) -> list[StoreKey]:
        """Validated keys of `chunks` for one member (ValueError names a bad field). The
        last batch is kept: a load asks for the same keys twice (where its chunks were
        found, then what to read), and comparing the chunks (the same strings) is cheaper
        than validating and building every key again. A fresh list every call."""
        last, fingerprint = self._last_keys, self.group_fingerprint
        if last is not None and last[:3] == (tenant, fingerprint, member) and last[3] == chunks:
            return list(last[4])
        keys = StoreKey.batch(tenant, fingerprint, chunks, member)
        self._last_keys = (tenant, fingerprint, member, list(chunks), keys)  # one assignment: thread-safe
        return list(keys)

    @staticmethod
    def check_chunks(chunks: Sequence[str]) -> None:
        """Raise ValueError (naming it) for a chunk that is not a valid chunk hash."""
        validate_chunk_hashes(chunks)

    # -- lookup ---------------------------------------------------------------------

    def contains_members(self, tenant: str, chunks: Sequence[str], members: Sequence[str]) -> list[dict[str, bool]]:
        """Per chunk, per member: stored on any tier (`KVStore.contains_members`)."""
        return self.store.contains_members(tenant, self.group_fingerprint, chunks, members)

    def lookup(
        self,
        tenant: str,
        chunks: Sequence[str],
        members: Sequence[MemberSpec],
        chunk_tokens: int,
        budget: WaitBudget | None = None,
        alternatives: Sequence[Sequence[MemberSpec]] = (),
    ) -> GroupLookup:
        """`KVStore.lookup` in this session's group; remembers where each key of the hit
        was found, for a `prepare_load` in this process without hints of its own."""
        result = self.store.lookup(
            tenant, self.group_fingerprint, chunks, members, chunk_tokens, budget, alternatives=alternatives
        )
        self.hints.remember(result.located)
        return result

    def _were_located(self, tenant: str, chunks: Sequence[str], member: str) -> list[bool]:
        """Per chunk: whether a lookup of this session found `member` of it and no load took it
        yet (keys batch-built, one lock; none built while no lookup's hints are kept)."""
        if not self.hints:
            return [False] * len(chunks)
        return self.hints.contain(self.keys(tenant, chunks, member))

    # -- hit planning (the rules: `kvpack.policy.hits`) ------------------------------------

    def plan_hit(self, query: HitQuery, budget: WaitBudget | None = None) -> HitPlan:
        """The hit of `query`: one lookup of its whole chunks (`lookup`), then the stored tail
        after the last hit chunk, within `budget` for remote tiers (`kvpack.policy.hits`)."""
        hashes = tuple(chunk_hashes(query.token_ids, query.chunk_tokens, parent=query.scope.seed))
        tenant = query.scope.tenant
        result = self.lookup(tenant, hashes, query.members, query.chunk_tokens, budget, query.alternatives)
        config = self.store.config

        def find_tail(parent: str | None, tokens: Sequence[int], members: Sequence[MemberSpec]) -> TailMatch | None:
            return self.store.tails.find(
                tenant, self.group_fingerprint, parent, tokens, members, config.prefix_match_unit, budget
            )

        return plan_lookup(query, hashes, result, find_tail, config, self.store.metrics)

    def pin(self, query: HitQuery) -> PinOutcome | None:
        """Pin the whole chunks of `query`'s prompt that the store holds (`kvpack.store.pins`); None: pins off."""
        hashes = chunk_hashes(query.token_ids, query.chunk_tokens, parent=query.scope.seed)
        return self.store.pin_prefix(query.scope.tenant, self.group_fingerprint, hashes)

    def accept_hit(self, plan: HitPlan, external_tokens: int, chunk_tokens: int) -> HitSources:
        """The engine took the last `external_tokens` of `plan`'s hit: counted (per tenant,
        ``external_hit_tokens``; by tier, ``hit_tier_tokens``), and split by tier (`kvpack.store.hit_sources`)."""
        if plan.scope is not None:
            self.record(AdapterEvent.EXTERNAL_HIT_TOKENS, external_tokens, tenant=plan.scope.tenant)
        sources = hit_sources(plan, external_tokens, chunk_tokens, self.store.tiers)
        for tier, n in sources.by_tier.items():
            self.store.metrics.inc("hit_tier_tokens", n, tier=tier)
        return sources

    def plan_handoff(self, query: HitQuery, claim: HandoffClaim) -> HitPlan:
        """The hit of a request another instance computed and stored (`HandoffClaim`), without
        a lookup: the loads wait for objects still landing (`wait_until_stored`)."""
        hashes = tuple(chunk_hashes(query.token_ids, query.chunk_tokens, parent=query.scope.seed))
        return plan_handoff(query, hashes, claim, self.store.config, self.store.metrics)

    def lookups_held(self, scope_of: Callable[[], RequestScope | None]) -> bool:
        """True when a request is to be held: a tier makes its first connect
        (`KVStore.warming_up`), so a lookup now would miss what it holds, and the request
        uses the cache (`scope_of()`, asked only then: None for a request without it). The
        caller holds the request and asks again later, never the engine (the tier's
        ``connect_wait_ms`` bounds it). Counted as ``lookups_held``; logged once per session."""
        if not self.store.warming_up():
            return False
        scope = scope_of()
        if scope is None:
            return False
        if not self._held_logged.is_set():
            self._held_logged.set()
            log.warning("kvpack: holding requests until a tier's first connect completes (at most its connect_wait_ms)")
        self.store.metrics.inc("lookups_held", tenant=scope.tenant)
        return True

    def place_tail(
        self,
        tenant: str,
        parent: str | None,
        members: Sequence[str],
        token_ids: Sequence[int],
        budget: WaitBudget | None = None,
    ) -> tuple[str, bool]:
        """Where the tail `token_ids` after chunk `parent` goes, and whether every member of it
        is stored there already (`TailSlots.place`)."""
        return self.store.tails.place(tenant, self.group_fingerprint, parent, members, token_ids, budget)

    def tier_events(self) -> TierEventFeed:
        """From now on, report what this process's tiers take and let go (`kvpack.observe.tier_events`:
        a bounded feed the adapter drains, e.g. into vLLM's KV events for routers)."""
        return self.store.tier_events()

    def record(self, event: AdapterEvent, amount: float = 1, tenant: str | None = None) -> None:
        """Count what an adapter reports (`AdapterEvent`: the core names the metric)."""
        if tenant is None:
            self.store.metrics.inc(event.value, amount)
        else:
            self.store.metrics.inc(event.value, amount, tenant=tenant)

    def refusals(self, event: AdapterEvent, what: str, logger: logging.Logger) -> Refusals:
        """A `Refusals` of client input of one kind, counted under `event`'s metric by reason."""
        return Refusals(self.store.metrics, event.value, what, logger)

    def refused(self, engine: str, why: AdapterRefusal) -> None:
        """Count an engine call the adapter answered as a miss itself (`AdapterRefusal`): a
        ``tier_errors`` count with `engine` as the tier and the reason as the status."""
        self.store.metrics.inc(_ADAPTER_REFUSALS, tier=engine, status=why.value)

    def engine_refusals(self, engine: str, what: str, logger: logging.Logger) -> Refusals:
        """A `Refusals` of engine calls the adapter answers as a miss itself (`AdapterRefusal`):
        each counted as `refused` counts it, the first of each reason logged as a warning."""
        return Refusals(
            self.store.metrics,
            _ADAPTER_REFUSALS,
            what,
            logger,
            label="status",
            labels={"tier": engine},
            level=logging.WARNING,
        )

    def metrics_snapshot(self) -> dict[str, dict[str, float]]:
        """Every counter's and gauge's value by label set (`Metrics.snapshot`)."""
        return self.store.metrics.snapshot()

    @property
    def tier_names(self) -> list[str]:
        """The store's tiers by name, fastest first."""
        return [t.name for t in self.store.tiers]

    @property
    def front_tier(self) -> str | None:
        """The tier in host memory the store asks first, None without one (`KVStore.front_tier`)."""
        return self.store.front_tier

    def in_front(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Per key: held by the `front_tier` now (`KVStore.in_front`)."""
        return self.store.in_front(keys)

    def wait_warm(self) -> bool:
        """At once, unless a tier makes its first connect: then until it is up, at most that
        tier's ``connect_wait_ms`` (a lookup before would miss what the tier holds)."""
        return self.store.wait_warm()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` seconds until tiers that connect in the background are up."""
        return self.store.wait_ready(timeout_s)

    def flush(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` seconds until every accepted object reached every tier."""
        return self.store.flush(timeout_s)

    def located_splits(self, tenant: str, chunks: Sequence[str], members: Sequence[str]) -> list[int]:
        """Per chunk, the index into `members` of the first member this session's last lookup found
        it under (0 also for chunks no lookup found: `kvpack.store.page_loads.located_splits`)."""
        return located_splits(lambda some, member: self._were_located(tenant, some, member), chunks, members)

    def load_pages(
        self, parts: Sequence[PagePart], pages: int, *, lent: bool, tenant: str, page_tokens: int = 0
    ) -> list[bool]:
        """One load of several objects per page, each from the tier this session's lookup found it
        in; a page is restored only when all of its objects loaded (`kvpack.store.page_loads`).
        Never raises: a miss or a refused object is a page not restored. `page_tokens` tokens per
        restored page are counted as ``loaded_tokens`` of `tenant` (0: the caller counts them)."""
        located = self.hints.take([key for part in parts for key in part.reads.keys])
        ok = load_pages(self.store.reads, located, parts, pages, lent=lent, tenant=tenant)
        if page_tokens:
            self.record(AdapterEvent.LOADED_TOKENS, sum(ok) * page_tokens, tenant=tenant)
        return ok

    @property
    def metrics(self) -> Metrics:
        """The store's counters and histograms (what an adapter counts goes here too)."""
        return self.store.metrics

    def close(self, flush_timeout_s: float | None = None) -> None:
        """Close the store (`KVStore.close`: its write-back drained within `flush_timeout_s`)."""
        self.store.close(flush_timeout_s=flush_timeout_s)

    # -- load -----------------------------------------------------------------------

    def page_reads(
        self, tenant: str, obj: MemberObject, chunks: Sequence[str], dsts: Sequence[Payload]
    ) -> list[LoadItem]:
        """Load items of whole pages of one member (batch-built), one per chunk and `dsts` entry."""
        return self.page_batch(tenant, obj, chunks, dsts).items()

    def page_batch(self, tenant: str, obj: MemberObject, chunks: Sequence[str], dsts: Sequence[Payload]) -> PageReads:
        """`page_reads` as one batch (`PageReads`: keys, buffers, one expectation), for a
        `PagePart`: no `LoadItem` per page until one is read the ordinary way."""
        keys = self.keys(tenant, chunks, obj.member)
        size = obj.payload_len if obj.payload_len is not None else (payload_nbytes(dsts[0]) if dsts else 0)
        return PageReads(keys, list(dsts), PageExpectation(obj.fingerprint, tenant, obj.member, obj.chunk_tokens, size))

    def reads(self, tenant: str, objects: Sequence[ObjectIO]) -> list[LoadItem]:
        """Load items of objects with their own token facts: a tail requires its stored
        ids to start with `ChunkFacts.token_ids` (any count), a block its exact count."""
        return [
            LoadItem(
                self.key(tenant, o.facts.chunk, o.obj.member),
                o.buffer,
                Expectation(
                    fingerprint=o.obj.fingerprint,
                    tenant=tenant,
                    chunk=o.facts.chunk,
                    member=o.obj.member,
                    token_count=None if o.facts.token_ids is not None else o.facts.token_count,
                    payload_len=payload_nbytes(o.buffer),
                    token_ids_prefix=o.facts.token_ids,
                ),
            )
            for o in objects
        ]

    def prepare_load(self, items: Sequence[LoadItem], hints: Mapping[StoreKey, str] | None = None) -> LoadBatch:
        """Pin and place `items` (`KVStore.prepare_load`): each read first from the tier in
        `hints` (another process's lookup: vLLM's scheduler), else the tier this session's
        lookup remembered; pair with `complete_load` or `release`."""
        located = hints if hints is not None else self.hints.take([it.key for it in items])
        return LoadBatch(list(items), self.store.prepare_load(located))

    def complete_load(self, batch: LoadBatch, local_only: bool = False) -> list[GetResult]:
        """Read every item of `batch` into its buffer (a miss or a refused object is a
        result, never an exception) and release its pins. `local_only`: from host memory and
        disk only, never a remote tier (`KVStore.complete_load`): a load inside an engine step."""
        return self.store.complete_load(batch.plan, batch.items, local_only)

    def complete_load_lent(self, batch: LoadBatch, local_only: bool = False) -> LentLoad:
        """`complete_load`, except that an object this process's memory tier or the host store
        holds is not copied into its buffer: ``views[i]`` of the `LentLoad` is its stored payload,
        read-only; None where the item was read into its buffer as `complete_load` reads it. For a
        caller that converts the bytes on their way into the engine anyway (the conversion is then
        the only copy). Once it copied out of the views it runs `LentLoad.lost`: the items whose
        copy is not the object (a host-store view rewritten meanwhile: treat it as a miss).
        `Reader.complete_load_lent` has the rules; `local_only` as for `complete_load`."""
        return self.store.reads.complete_load_lent(batch.plan, batch.items, local_only)

    def release(self, batch: LoadBatch) -> None:
        self.store.release(batch.plan)

    def load(self, items: Sequence[LoadItem], hints: Mapping[StoreKey, str] | None = None) -> list[GetResult]:
        """`prepare_load` then `complete_load`, nothing to wait for in between."""
        return self.complete_load(self.prepare_load(items, hints))

    # -- save -----------------------------------------------------------------------

    def _to_store(self, keys: Sequence[StoreKey]) -> list[int]:
        """The de-duplication rule, once for every save verb: the indices of `keys` to store now
        (`KVStore.prepare_store`: on no tier and not being stored by another caller), each claimed
        until the `complete_store` (or `complete_store_lent`) of the caller that stores it. The
        others are reported stored."""
        wanted = set(self.store.prepare_store(keys))
        return [i for i, key in enumerate(keys) if key in wanted]

    def save_pages(
        self,
        tenant: str,
        obj: MemberObject,
        chunks: Sequence[str],
        payloads_of: Callable[[Sequence[int]], Sequence[Payload]],
    ) -> list[bool]:
        """Store whole pages of one member, de-duplicated: `KVStore.prepare_store` picks the
        pages on no tier and not being stored by another caller; `payloads_of(indices)`
        gives just those pages' payloads (in place, e.g. host-pool regions); one
        `complete_store`. Per page: True when stored now or already stored."""
        n = len(chunks)
        if n == 0:
            return []
        keys = self.keys(tenant, chunks, obj.member)
        todo = self._to_store(keys)
        ok = [True] * n
        if not todo:
            return ok
        payloads = payloads_of(todo)
        size = obj.payload_len if obj.payload_len is not None else payload_nbytes(payloads[0])
        headers = ObjectHeader.batch(
            obj.fingerprint, tenant, [chunks[i] for i in todo], obj.member, obj.chunk_tokens, size
        )
        items = list(map(PutItem, [keys[i] for i in todo], headers, payloads))
        for i, st in zip(todo, self.store.complete_store(items)):
            ok[i] = st is TierStatus.OK
        return ok

    @property
    def lends_slots(self) -> bool:
        """Whether `save_pages_lent` and `complete_load_lent` lend the memory tier's own slots
        (`KVStore.lends_memory`); when False they copy as `save_pages` and `complete_load` do."""
        return self.store.lends_memory

    def save_pages_lent(
        self,
        tenant: str,
        obj: MemberObject,
        chunks: Sequence[str],
        fill: Callable[[Sequence[int], list[np.ndarray]], None],
    ) -> list[bool]:
        """`save_pages` whose payloads are written in place: `fill(todo, dsts)` writes page
        ``todo[j]``'s object (exactly ``obj.payload_len`` bytes) into ``dsts[j]``, the memory
        tier's own slot where it lends one (`KVStore.store_lent`), so a caller that converts
        the pages anyway makes no copy beside the tier's. Raises ValueError without
        ``obj.payload_len``. Per page: True when stored now or already stored."""
        n = len(chunks)
        if n == 0:
            return []
        if obj.payload_len is None:
            raise ValueError(f"save_pages_lent: member {obj.member} has no payload_len")
        keys = self.keys(tenant, chunks, obj.member)
        todo = self._to_store(keys)
        ok = [True] * n
        if not todo:
            return ok
        headers = ObjectHeader.batch(
            obj.fingerprint, tenant, [chunks[i] for i in todo], obj.member, obj.chunk_tokens, obj.payload_len
        )
        statuses = self.store.complete_store_lent([keys[i] for i in todo], headers, lambda dsts: fill(todo, dsts))
        for i, st in zip(todo, statuses):
            ok[i] = st is TierStatus.OK
        return ok

    def save(self, tenant: str, objects: Sequence[ObjectIO], *, dedupe: bool = True) -> SaveResult:
        """Store objects with their own token facts (vLLM's blocks and tails).

        `dedupe`: through `prepare_store` -> `complete_store` (what is stored, or being
        stored by another caller, is skipped and reported stored). False stores every
        object as given: a caller that decided itself what to save, or rewrites a tail
        slot in place. `SaveResult.in_memory`: per object, whether this process's
        memory tier holds it now (what a scheduler-side view is told)."""
        items = [
            PutItem(
                self.key(tenant, o.facts.chunk, o.obj.member),
                ObjectHeader(
                    fingerprint=o.obj.fingerprint,
                    tenant=tenant,
                    chunk=o.facts.chunk,
                    member=o.obj.member,
                    token_count=o.facts.token_count,
                    payload_len=payload_nbytes(o.buffer),
                    checksum=None,
                    token_ids=o.facts.token_ids,
                ),
                o.buffer,
                announce=o.facts.announce,
            )
            for o in objects
        ]
        statuses = [TierStatus.OK] * len(items)
        if dedupe:
            todo = self._to_store([it.key for it in items])
            for i, st in zip(todo, self.store.complete_store([items[i] for i in todo])):
                statuses[i] = st
        else:
            statuses = self.store.store(items)
        in_memory = self.store.in_memory([it.key for it in items])
        return SaveResult(items, statuses, in_memory)


@dataclass(frozen=True)
class SaveResult:
    """What `Session.save` did, per object in the caller's order."""

    items: list[PutItem]
    statuses: list[TierStatus]
    in_memory: list[bool]
