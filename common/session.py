"""Session: the adapters' contract, the one door an engine adapter uses into the core.

An adapter hands a session engine facts only: which tenant, which chunks (SGLang's
page hashes, vLLM's chained block hashes), which member object it registered once
(`MemberObject`: member name, member fingerprint, tokens and bytes per chunk), and the
buffers to copy from or into. The session builds every `StoreKey`, `ObjectHeader`,
`Expectation`, `PutItem` and `LoadItem`; remembers where a lookup found each object
(`LocatedHints`, bounded) for the load that follows in the same process; and
de-duplicates saves. Adapters never build keys, headers or expectations themselves
(tests/common/test_structure.py holds it).

Failure, for every verb unless its docstring says otherwise: a broken, slow or full tier
is a miss (a lookup finds less, a load restores less and the engine recomputes, a save
reports False), counted in the metrics; the engine is never handed an exception. What
raises is the caller's own mistake (a bad chunk hash, a buffer of the wrong size):
ValueError naming the field.

The verbs, grouped:

- lifecycle: `start`, `reader` (constructors), `bind_group`, `reset`, `wait_ready`,
  `flush`, `close`;
- lookup and hits: `key`, `lookup` (SGLang's page lookups, one page included), `plan_hit` (a
  handoff and a pin included), `accept_hit`, `lookups_held`, `place_tail` (the rules live in
  `kvpack.policy.hits`);
- load: `reads` (objects with their own token facts: vLLM's blocks and tails),
  `page_reads` (whole pages of one member: SGLang), `prepare_load` -> `complete_load`
  (or `release`), `located_splits` and `load_pages` (SGLang's pages, several objects a
  page). Loads are two-phase, as the store's are: `prepare_load` pins what is in this
  process's memory and fixes the tier to read each object from; an adapter may wait
  between the two (vLLM waits for earlier saves and for a prefill instance's handoff);
- save: `save` (objects), `save_pages` (whole pages, copied or filled in place);
- reporting: `report` (`kvpack.observe.reporting.Reporting`: counting, refusals, the
  metrics and their snapshot, tier events) and `tiers` (`kvpack.store.tier_view.TierView`:
  the tiers' names, the front tier, whether slots are lent).

Thread-safe: the hints are behind a lock; everything else is the store's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from .config.schema import KVPackConfig
from .cpu_features import request_amx_permission
from .identity.keys import StoreKey, chunk_hashes
from .identity.objects import Expectation, ObjectHeader, PageExpectation, Payload, payload_nbytes
from .observe.adapter_events import AdapterEvent
from .observe.reporting import Reporting
from .observe.router_facts import RouterFacts
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
from .store.tier_view import TierView
from .tiers.base import PutItem, Tier, TierStatus

log = logging.getLogger("kvpack")


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
        self.report = Reporting(store.metrics, store.tier_events)
        """What the adapter counts and reads back (`Reporting`)."""
        self.tiers = TierView(store)
        """The store's tiers as an adapter may know them (`TierView`)."""
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
        """Scope every key by `group_fingerprint` from now on (call before the first lookup or
        save); `label` (`KVLayoutSpec.label`) names it in the shared indexes for ``kvpack usage``
        (a tier that cannot record the name logs it and goes on)."""
        self.group_fingerprint = group_fingerprint
        if label:
            self.store.name_group(group_fingerprint, label)

    @overload
    def reset(self, who: str) -> ClearReport | None: ...

    @overload
    def reset(self, who: str, scope: ClearScope) -> ClearReport: ...

    def reset(self, who: str, scope: ClearScope | None = None) -> ClearReport | None:
        """The engine's reset verb (vLLM ``reset_cache``, SGLang ``clear``): remove what `scope`
        names from this process's tiers (`KVStore.clear`), logged in one line under `who`.
        Without a `scope`, the config's ``reset`` rule over the fingerprints bound *now*
        (`kvpack.policy.clearing.engine_scope`); None (logged) when ``reset.scope`` is off.
        A tier that fails to clear is named in the report (`ClearReport.ok` False, logged as a
        warning), never raised."""
        if scope is None:
            scope = engine_scope(self.store.config.reset, (self.group_fingerprint,))
            if scope is None:
                log.info("kvpack: %s: reset.scope is off; nothing removed", who)
                return None
        report = self.store.clear(scope, False)
        log.log(logging.INFO if report.ok else logging.WARNING, "kvpack: %s", report.line(who))
        return report

    # -- keys -----------------------------------------------------------------------

    def key(self, tenant: str, chunk: str, member: str) -> StoreKey:
        """The store key of `member`'s object of `chunk` for `tenant`, in this session's group
        (what a scheduler-side view of another process's memory is asked about). ValueError
        names a bad field."""
        return StoreKey(tenant, self.group_fingerprint, chunk, member)

    def _keys(self, tenant: str, chunks: Sequence[str], member: str) -> list[StoreKey]:
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

    # -- lookup ---------------------------------------------------------------------

    def lookup(
        self,
        tenant: str,
        chunks: Sequence[str],
        members: Sequence[MemberSpec],
        chunk_tokens: int,
        budget: WaitBudget | None = None,
        alternatives: Sequence[Sequence[MemberSpec]] = (),
    ) -> GroupLookup:
        """`KVStore.lookup` in this session's group: the hit of `chunks` (each of `chunk_tokens`
        tokens) that every one of `members` (or of one of `alternatives`) holds, remote tiers
        asked within `budget`. Remembers where each key of the hit was found, for a
        `prepare_load` or `load_pages` in this process without hints of its own. A tier that
        fails or runs out of budget is a shorter hit, counted."""
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
        return self.hints.contain(self._keys(tenant, chunks, member))

    # -- hit planning (the rules: `kvpack.policy.hits`) ------------------------------------

    def plan_hit(
        self,
        query: HitQuery,
        budget: WaitBudget | None = None,
        *,
        claim: HandoffClaim | None = None,
        pin: bool = False,
    ) -> HitPlan:
        """The hit of `query` (`kvpack.policy.hits`): one lookup of its whole chunks (`lookup`),
        then the stored tail after the last hit chunk, within `budget` for remote tiers. With a
        `claim` (another instance computed and stored the request: a prefill instance's
        handoff), the claimed hit without a lookup: its loads wait for objects still landing.
        `pin`: also pin the whole chunks of the prompt the store holds (`kvpack.store.pins`;
        nothing when pins are off). A failing tier is a shorter hit (a miss at worst)."""
        hashes = tuple(chunk_hashes(query.token_ids, query.chunk_tokens, parent=query.scope.seed))
        tenant = query.scope.tenant
        config = self.store.config
        if claim is not None:
            plan = plan_handoff(query, hashes, claim, config, self.store.metrics)
        else:
            result = self.lookup(tenant, hashes, query.members, query.chunk_tokens, budget, query.alternatives)

            def find_tail(parent: str | None, tokens: Sequence[int], members: Sequence[MemberSpec]) -> TailMatch | None:
                return self.store.tails.find(
                    tenant, self.group_fingerprint, parent, tokens, members, config.prefix_match_unit, budget
                )

            plan = plan_lookup(query, hashes, result, find_tail, config, self.store.metrics)
        if pin:
            self.store.pin_prefix(tenant, self.group_fingerprint, hashes)
        return plan

    def accept_hit(self, plan: HitPlan, external_tokens: int, chunk_tokens: int) -> HitSources:
        """The engine took the last `external_tokens` of `plan`'s hit: counted (per tenant,
        ``external_hit_tokens``; by tier, ``hit_tier_tokens``), and split by tier
        (`kvpack.store.hit_sources`). Only counts; never fails."""
        if plan.scope is not None:
            self.report.record(AdapterEvent.EXTERNAL_HIT_TOKENS, external_tokens, tenant=plan.scope.tenant)
        sources = hit_sources(plan, external_tokens, chunk_tokens, self.store.tiers)
        for tier, n in sources.by_tier.items():
            self.store.metrics.inc("hit_tier_tokens", n, tier=tier)
        return sources

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
        is stored there already (`TailSlots.place`: a slot id, stable for the same tail). A tier
        that fails or runs out of `budget` reads as not stored: the tail is saved again."""
        return self.store.tails.place(tenant, self.group_fingerprint, parent, members, token_ids, budget)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until tiers that connect in the background (Mooncake) are up; True when all
        are usable, False (never an exception) when one is not by then. `timeout_s` seconds at
        most, also waiting past a failed first attempt (tests, tools, an operator's start-up
        check); None: at once unless a tier makes its first connect, then until it is up, at
        most that tier's own ``connect_wait_ms`` (a lookup before would miss what it holds:
        SGLang's prefetch thread). Never on an engine's step."""
        if timeout_s is None:
            return self.store.wait_warm()
        return self.store.wait_ready(timeout_s)

    def flush(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` seconds until every accepted object reached every tier; False
        when some had not by then (they stay queued; a tier that failed them counted them)."""
        return self.store.flush(timeout_s)

    def located_splits(self, tenant: str, chunks: Sequence[str], members: Sequence[str]) -> list[int]:
        """Per chunk, the index into `members` of the first member this session's last lookup found
        it under (0 also for chunks no lookup found: `kvpack.store.page_loads.located_splits`).
        Reads only the remembered hints; never fails."""
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
            self.report.record(AdapterEvent.LOADED_TOKENS, sum(ok) * page_tokens, tenant=tenant)
        return ok

    def close(self, flush_timeout_s: float | None = None) -> None:
        """Close the store (`KVStore.close`: its write-back drained within `flush_timeout_s`
        seconds, what is left then is dropped and counted). Later calls answer misses."""
        self.store.close(flush_timeout_s=flush_timeout_s)

    # -- load -----------------------------------------------------------------------

    def page_reads(self, tenant: str, obj: MemberObject, chunks: Sequence[str], dsts: Sequence[Payload]) -> PageReads:
        """Whole pages of one member to load, one per chunk into the `dsts` entry at its index,
        as one batch (`PageReads`: keys, buffers, one expectation; batch-built, no `LoadItem`
        per page until one is read the ordinary way): for a `PagePart` of `load_pages`, or
        `PageReads.items()` for `prepare_load`. ValueError names a bad chunk hash."""
        keys = self._keys(tenant, chunks, obj.member)
        size = obj.payload_len if obj.payload_len is not None else (payload_nbytes(dsts[0]) if dsts else 0)
        return PageReads(keys, list(dsts), PageExpectation(obj.fingerprint, tenant, obj.member, obj.chunk_tokens, size))

    def reads(self, tenant: str, objects: Sequence[ObjectIO]) -> list[LoadItem]:
        """Load items of objects with their own token facts: a tail requires its stored
        ids to start with `ChunkFacts.token_ids` (any count), a block its exact count; for
        `prepare_load`. ValueError names a bad chunk hash."""
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

    def prepare_load(
        self, items: Sequence[LoadItem] | PageReads, hints: Mapping[StoreKey, str] | None = None
    ) -> LoadBatch:
        """Pin and place `items` (`reads`, or a `page_reads` batch read item by item:
        `KVStore.prepare_load`): each read first from the tier in `hints` (another process's
        lookup: vLLM's scheduler), else the tier this session's lookup remembered; pair with
        `complete_load` or `release` (else the pins stay until evicted by time). Reads nothing
        yet; never fails."""
        items = items.items() if isinstance(items, PageReads) else list(items)
        located = hints if hints is not None else self.hints.take([it.key for it in items])
        return LoadBatch(items, self.store.prepare_load(located))

    def complete_load(self, batch: LoadBatch, local_only: bool = False, *, lend: bool = False) -> LentLoad:
        """Read every item of `batch` into its buffer and release its pins. Per item, a
        `GetResult` (`LentLoad.results`, `LentLoad.ok`): a miss, a refused object (wrong
        model, tenant, size or tokens) or a failing tier is a result, never an exception; the
        engine recomputes it. `local_only`: from host memory and disk only, never a remote
        tier (`KVStore.complete_load`): a load inside an engine step.

        `lend`: an object this process's memory tier or the host store holds is not copied into
        its buffer: ``views[i]`` is its stored payload, read-only; None where the item was read
        into its buffer. For a caller that converts the bytes on their way into the engine anyway
        (the conversion is then the only copy). Once it copied out of the views it runs
        `LentLoad.lost`: the items whose copy is not the object (a host-store view rewritten
        meanwhile: treat it as a miss). `Reader.complete_load_lent` has the rules."""
        if lend:
            return self.store.reads.complete_load_lent(batch.plan, batch.items, local_only)
        return LentLoad.copied(self.store.complete_load(batch.plan, batch.items, local_only))

    def release(self, batch: LoadBatch) -> None:
        """Give `batch`'s pins back without reading (a load given up). Never fails."""
        self.store.release(batch.plan)

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
        payloads_of: Callable[[Sequence[int]], Sequence[Payload]] | None = None,
        *,
        fill: Callable[[Sequence[int], list[np.ndarray]], None] | None = None,
    ) -> list[bool]:
        """Store whole pages of one member, de-duplicated: only the pages on no tier and not
        being stored by another caller (`KVStore.prepare_store`) are asked for, ``todo`` (indices
        into `chunks`). Exactly one source of their bytes:

        - `payloads_of(todo)` gives those pages' payloads (in place, e.g. host-pool regions),
          stored by one `complete_store`;
        - `fill(todo, dsts)` writes page ``todo[j]``'s object (exactly ``obj.payload_len``
          bytes) into ``dsts[j]``, the memory tier's own slot where it lends one
          (`KVStore.store_lent`, `TierView.lends_slots`), so a caller that converts the pages
          anyway makes no copy beside the tier's.

        Per page: True when stored now or already stored, False when no tier took it (counted).
        Raises ValueError for a bad chunk hash, for both or neither source, and for `fill`
        without ``obj.payload_len``; an exception from the caller's own `payloads_of` or `fill`
        is the caller's, raised to it."""
        if (payloads_of is None) == (fill is None):
            raise ValueError("save_pages: give exactly one of payloads_of and fill")
        n = len(chunks)
        if n == 0:
            return []
        if fill is not None and obj.payload_len is None:
            raise ValueError(f"save_pages: member {obj.member} has no payload_len")
        keys = self._keys(tenant, chunks, obj.member)
        todo = self._to_store(keys)
        ok = [True] * n
        if not todo:
            return ok
        if fill is not None:
            assert obj.payload_len is not None
            headers = ObjectHeader.batch(
                obj.fingerprint, tenant, [chunks[i] for i in todo], obj.member, obj.chunk_tokens, obj.payload_len
            )
            statuses = self.store.complete_store_lent([keys[i] for i in todo], headers, lambda dsts: fill(todo, dsts))
        else:
            assert payloads_of is not None
            payloads = payloads_of(todo)
            size = obj.payload_len if obj.payload_len is not None else payload_nbytes(payloads[0])
            headers = ObjectHeader.batch(
                obj.fingerprint, tenant, [chunks[i] for i in todo], obj.member, obj.chunk_tokens, size
            )
            statuses = self.store.complete_store(list(map(PutItem, [keys[i] for i in todo], headers, payloads)))
        for i, st in zip(todo, statuses):
            ok[i] = st is TierStatus.OK
        return ok

    def save(self, tenant: str, objects: Sequence[ObjectIO], *, dedupe: bool = True) -> SaveResult:
        """Store objects with their own token facts (vLLM's blocks and tails).

        `dedupe`: through `prepare_store` -> `complete_store` (what is stored, or being
        stored by another caller, is skipped and reported stored). False stores every
        object as given: a caller that decided itself what to save, or rewrites a tail
        slot in place. `SaveResult.in_memory`: per object, whether this process's
        memory tier holds it now (what a scheduler-side view is told). A tier that fails is
        that object's status (`SaveResult.statuses`), counted; never an exception."""
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
