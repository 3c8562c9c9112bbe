"""KVStore: the engine-neutral store the session talks to.

It owns the configured tiers (memory -> disk -> mooncake, fastest first)
and owns the policies that must hold on every tier:

- lookup: one batched `contains` per tier for every (chunk, member) of a
  request; the answer is a `GroupLookup` (full / partial by member, and the
  tier holding each key of the hit), counted.
- load (its `Reader`): `prepare_load` -> `complete_load` (`lifecycle`, `reads`): each object
  from the tier the lookup found it in (pinned there when that is this
  process's memory), else read-through; `load` is read-through alone. Each
  object comes from the fastest tier that has it and passes every check; a
  lower-tier hit is promoted into memory. Anything else is a miss with a
  counted reason, never an exception.
- store (its `Writer`): the memory tier takes a copy synchronously (a memcpy); every lower
  tier gets the object from a bounded write-back queue served by background
  threads. When the queue is full the store is dropped and counted rather
  than blocking the engine (back-pressure). Each queued object carries when
  `store` accepted it (`PutItem.accepted_ns`): a lower tier's eviction follows
  the order of the stores, not the order the threads reached it in. Without a
  memory tier there is nothing to queue from, so the lower tiers are written
  synchronously from the caller's buffers (no copy); the adapters call `store` off the forward path,
  and every tier bounds its own calls. `prepare_store` -> `complete_store`
  de-duplicates (what is stored or being stored is not stored again).
- tails (`store.tails`, `kvpack.policy.tails.TailSlots`): the computed tail of a
  partial block is stored with its token ids under `tail_chunk(parent)`;
  `tails.find` returns the longest common prefix with a new prompt, rounded
  down to the match unit, `tails.place` where a new tail goes.

Thread-safe. Construct with `KVStore.from_config`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np

from ..config.schema import METRICS_PORT_SPAN, ChecksumPolicy, KVPackConfig
from ..exit_flush import flush_on_exit, forget
from ..identity.keys import GroupKey, StoreKey
from ..identity.objects import ObjectHeader
from ..observe.metrics import Metrics
from ..observe.tier_events import DEFAULT_CAPACITY as DEFAULT_EVENTS
from ..observe.tier_events import TierEventFeed
from ..policy.budget import WaitBudget
from ..policy.clearing import ClearReport, ClearScope, clear_tiers
from ..policy.groups import GroupLookup, MemberSpec, resolve_lookup
from ..policy.split_lookup import lookup_sets
from ..policy.tails import TailSlots
from ..tiers.base import GetResult, PutItem, Tier, TierStatus
from ..tiers.disk.reads import ObjectReader
from ..tiers.disk.removes import ObjectRemover
from ..tiers.disk.writes import ObjectWriter
from ..tiers.factory import build_tiers
from ..tiers.host import HostTier
from ..tiers.memory import MemoryTier
from ..tiers.parallel import RegionCopier
from .integrity import IntegrityKey
from .lifecycle import LoadPlan, PlanBook, count_lookup
from .pinning import open_pins, pin_prefix
from .pins import PinOutcome
from .reader import Reader
from .reads import LoadItem, TierReads
from .writer import Writer

log = logging.getLogger("kvpack")


class KVStore:
    """See the module docstring. Composed of parts with one job each, held, never inherited:
    `writes` (`Writer`: store, write-through, write-back, the count of what is stored),
    `reads` (`Reader`: load plans, read-through, lending), `plans` (`PlanBook`: open load plans
    and prepared stores), `tails` (`TailSlots`). The store itself owns the tiers: lookups,
    evictions, clears, start and close."""

    def __init__(
        self,
        config: KVPackConfig,
        tiers: Sequence[Tier],
        metrics: Metrics | None = None,
        *,
        write_back: bool = True,
        read_only: bool = False,
        pin_timeout_s: float | None = None,
    ) -> None:
        """`write_back`: lower tiers get stores from the write-back queue (the caller
        returns after the copy into the front tier, `Tier.front`: the memory tier or the
        host store); False writes every tier before `store`
        returns, for engines that call it off their forward path and may kill the
        process without warning (SGLang). `read_only`: a lookup view (vLLM's
        scheduler side): no write-back threads, `store` refuses. `pin_timeout_s`:
        how long a `LoadPlan` pins memory at most (default: twice the longest a
        load may wait, ``io_timeout_ms + handoff_wait_ms``)."""
        if not tiers:
            raise ValueError("KVStore needs at least one tier")
        self.config = config
        self.read_only = read_only
        self.write_back = write_back and not read_only
        self.tiers = tuple(tiers)
        self.metrics = metrics or Metrics.for_config(config)
        ikey = config.integrity_key_bytes()
        integrity = IntegrityKey(ikey) if ikey else None
        """Opt-in keyed MAC (`kvpack.store.integrity`): seals every store to a lower tier, checks every load."""
        memory = next((t for t in self.tiers if isinstance(t, MemoryTier)), None)
        self._memory = memory
        front = self.tiers[0] if self.tiers[0].front else None
        """The tier in host memory a store reaches first (`Tier.front`: the memory tier, or the
        host store), if any; without it (or without `write_back`) a store is written through."""
        self._front = front
        lower = tuple(t for t in self.tiers if t is not memory and t is not front)
        self._by_name = {t.name: t for t in reversed(self.tiers)}  # the fastest of a name
        self.lends_memory = (
            memory is not None and not read_only and integrity is None and config.checksum is not ChecksumPolicy.ALWAYS
        )
        """Whether the lent verbs hand out the memory tier's slots: the store has one and
        stores, no keyed MAC (a sealed header needs its payload first), and its loads from
        memory are not checksummed (``checksum`` is not ``always``). Else they copy."""
        self.pins = open_pins(config, self.tiers)
        """The store folder's pinned prefixes (`kvpack.store.pins`), None when pins are off."""
        if pin_timeout_s is None:
            pin_timeout_s = max(1.0, 2 * (config.io_timeout_ms + config.handoff_wait_ms) / 1000.0)
        self.plans = PlanBook(pin_timeout_s)
        self._evict_listeners: list[Callable[[str, GroupKey, int], None]] = []
        self._evictions: list[tuple[str, str, int]] = []
        self.writes = Writer(
            config,
            self.metrics,
            self.tiers,
            memory=memory,
            front=front,
            lower=lower,
            integrity=integrity,
            write_back=self.write_back,
            read_only=read_only,
            lends_memory=self.lends_memory,
            after_batch=self._count_evictions,
        )
        tier_reads = TierReads(self.tiers, memory, self.metrics, config.checksum, integrity, self._count_evictions)
        host = front if isinstance(front, HostTier) and integrity is None else None  # read in place: no MAC
        self.reads = Reader(
            self.tiers, tier_reads, self.plans, self.metrics, memory=memory, host=host, lends_memory=self.lends_memory
        )
        for tier in self.tiers:
            if hasattr(tier, "on_evict"):
                tier.on_evict = self._evict_counter(tier.name)
        self._closed = False
        if self.writes.queues:
            flush_on_exit(self, config.shutdown_flush_s)
        self.tails = TailSlots(config, self.metrics, self.peek_located)
        self.metrics_port = self.metrics.serve_configured(config.metrics_port, METRICS_PORT_SPAN)

    @property
    def events(self) -> TierEventFeed | None:
        """What the tiers took and let go (`kvpack.observe.tier_events`); None (no cost) until `tier_events`."""
        return self.writes.events

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config: KVPackConfig,
        metrics: Metrics | None = None,
        *,
        copy_threads: int = 1,
        region_copier: Callable[[], RegionCopier | None] | None = None,
        object_writer: Callable[[], ObjectWriter | None] | None = None,
        object_remover: Callable[[], ObjectRemover | None] | None = None,
        object_reader: Callable[[], ObjectReader | None] | None = None,
        write_back: bool = True,
    ) -> KVStore:
        """Build the tiers the config enables (`build_tiers`), fastest first."""
        tiers = build_tiers(
            config,
            copy_threads=copy_threads,
            region_copier=region_copier,
            object_writer=object_writer,
            object_remover=object_remover,
            object_reader=object_reader,
        )
        return cls(config, tiers, metrics, write_back=write_back)

    @classmethod
    def reader(cls, config: KVPackConfig, leading: Sequence[Tier], metrics: Metrics | None = None) -> KVStore:
        """A lookup-only store: `leading` tiers (e.g. a view of another process's memory
        tier, vLLM's scheduler) before the lower tiers the config enables (no memory tier
        of its own), but behind the host store when there is one (it stays the `front_tier`:
        what it holds now is found there, a leading view answers for the rest); no
        write-back threads, `store` refuses."""
        own = build_tiers(config, include_memory=False)
        front = own[:1] if own and own[0].front else []
        return cls(config, [*front, *leading, *own[len(front) :]], metrics, read_only=True)

    @property
    def front_tier(self) -> str | None:
        """The name of the tier in host memory that this store asks first (`Tier.front`: the
        memory tier or the host store), None without one (a reader's view of another process's
        memory tier is not one: only that process can read it)."""
        return self._front.name if self._front is not None else None

    def in_front(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Per key: held by the `front_tier` now (all False without one). Never raises."""
        if self._front is None:
            return [False] * len(keys)
        return self._front.contains(keys)

    def in_memory(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Per key: held by this process's memory tier now (all False without one)."""
        if self._memory is None:
            return [False] * len(keys)
        return self._memory.contains(keys)

    def pin_prefix(self, tenant: str, fingerprint: str, chunks: Sequence[str]) -> PinOutcome | None:
        """Pin `tenant`'s prefix `chunks` as far as the disk folder holds it (`kvpack.store.pinning.pin_prefix`);
        None when pins are off. Groups refused past the budget are counted (``pins_refused``)."""
        if self.pins is None:
            return None
        done = pin_prefix(self.pins, self.tiers, tenant, fingerprint, chunks)
        self.metrics.inc("pins_refused", done.refused, tenant=tenant)
        return done

    def add_evict_listener(self, listener: Callable[[str, GroupKey, int], None]) -> None:
        """Call `listener(tier_name, group, nbytes)` for every group a bounded tier
        evicts (e.g. to tell another process's index). Runs under the tier's lock:
        keep it cheap and never call back into the store."""
        self._evict_listeners.append(listener)

    def _evict_counter(self, tier: str) -> Callable[[GroupKey, int], None]:
        def on_evict(group: GroupKey, nbytes: int) -> None:
            # Runs under the tier's lock, once per evicted group: note it now (an
            # atomic append), count it when the calling batch ends (`_count_evictions`).
            self._evictions.append((tier, group.tenant, nbytes))
            if self.events is not None:
                self.events.removed(tier, (group,))
            for listener in self._evict_listeners:
                listener(tier, group, nbytes)

        return on_evict

    def _count_evictions(self) -> None:
        if not self._evictions:
            return
        counts: dict[tuple[str, str], list[int]] = {}  # (tier, tenant) -> [groups, bytes]
        while self._evictions:
            try:
                tier, tenant, nbytes = self._evictions.pop()
            except IndexError:  # drained by another thread meanwhile
                break
            acc = counts.get((tier, tenant))
            if acc is None:
                counts[(tier, tenant)] = [1, nbytes]
            else:
                acc[0] += 1
                acc[1] += nbytes
        for (tier, tenant), (groups, nbytes) in counts.items():
            self.metrics.inc("evictions", groups, tier=tier, tenant=tenant)
            self.metrics.inc("evicted_bytes", nbytes, tier=tier, tenant=tenant)

    # -- lookup -------------------------------------------------------------------

    def contains_members(
        self,
        tenant: str,
        fingerprint: str,
        chunks: Sequence[str],
        members: Sequence[str],
        budget: WaitBudget | None = None,
    ) -> list[dict[str, bool]]:
        """Per chunk, per member: stored on any tier? One batched call per tier."""
        found = self.contains([StoreKey(tenant, fingerprint, c, m) for c in chunks for m in members], budget)
        n = len(members)
        return [{m: found[ci * n + mi] for mi, m in enumerate(members)} for ci in range(len(chunks))]

    def warming_up(self) -> bool:
        """A tier's first connect is in progress (`Tier.warming_up`): a lookup now would
        miss what it holds. Never blocks: vLLM holds the request, SGLang's prefetch
        thread calls `wait_warm` (bounded by each tier's own start-up bound)."""
        return any(t.warming_up() for t in self.tiers)

    def wait_warm(self) -> bool:
        return all([t.wait_warm() for t in self.tiers])

    def wait_ready(self, timeout_s: float) -> bool:
        """Every tier's `Tier.wait_ready` (each up to `timeout_s`); True when all are usable."""
        return all([t.wait_ready(timeout_s) for t in self.tiers])

    def contains(self, keys: Sequence[StoreKey], budget: WaitBudget | None = None) -> list[bool]:
        """Per key: stored on any tier (not yet verified)? One batched call per tier.
        With a `budget`, remote tiers are skipped once it is spent (see `kvpack.policy.budget`)."""
        return [t is not None for t in self.locate(keys, budget)]

    def locate(self, keys: Sequence[StoreKey], budget: WaitBudget | None = None) -> list[str | None]:
        """Per key: the name of the fastest tier holding it (None: none does). As `contains`."""
        found: list[str | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, f in enumerate(found) if f is None]
            if not todo:
                break
            if self._over_budget(tier, budget) or self._down(tier):
                continue
            answers = self._safe_contains(tier, keys if len(todo) == len(keys) else [keys[i] for i in todo])
            for i, ok in zip(todo, answers):
                if ok:
                    found[i] = tier.name
        return found

    def _safe_contains(self, tier: Tier, keys: Sequence[StoreKey]) -> list[bool]:
        try:
            answers = tier.contains(keys)
            if len(answers) != len(keys):
                raise RuntimeError(f"{tier.name}.contains returned {len(answers)} answers for {len(keys)} keys")
            return answers
        except Exception as exc:  # a tier must not raise; if it does, it is a miss, counted
            self.metrics.inc("tier_errors", tier=tier.name, status="exception")
            log.warning("kvpack: %s.contains failed: %s", tier.name, exc)
            return [False] * len(keys)

    def _down(self, tier: Tier) -> bool:
        """True (counted as ``tier_errors{status="unavailable"}``, as a load refused by a down
        tier is) when `tier` is down: its lookup would answer a miss without asking it."""
        if tier.available:
            return False
        self.metrics.inc("tier_errors", tier=tier.name, status=TierStatus.UNAVAILABLE.value)
        return True

    def _over_budget(self, tier: Tier, budget: WaitBudget | None) -> bool:
        """True (counted) when `tier` is remote and the step's budget is spent: skip it."""
        if budget is None or not tier.remote:
            return False
        budget.start()
        if not budget.spent:
            return False
        self.metrics.inc("budget_skips", tier=tier.name)
        return True

    def lookup(
        self,
        tenant: str,
        fingerprint: str,
        chunks: Sequence[str],
        members: Sequence[MemberSpec],
        chunk_tokens: int,
        budget: WaitBudget | None = None,
        alternatives: Sequence[Sequence[MemberSpec]] = (),
    ) -> GroupLookup:
        """Longest stored prefix of `chunks` (chained hashes) for `tenant`, by group.

        `alternatives`: other member sets one chunk may be stored as (canonical objects
        written at another TP size: `kvpack.identity.heads`). Plain sets mix per chunk
        (`split_lookup`: `GroupLookup.chunk_sets` says which set each chunk loads); others
        are tried in order when `members` hold no chunk, and `all_members` says which.
        Counts one lookup, its hit tokens, full hits and partial hits by missing member
        (`lifecycle.count_lookup`). `GroupLookup.located`: the tier of each key of the hit."""
        start = time.perf_counter()
        result = lookup_sets(
            lambda keys: self.locate(keys, budget),
            lambda ms: self._find(tenant, fingerprint, chunks, ms, budget),
            tenant,
            fingerprint,
            chunks,
            [members, *alternatives],
        )
        count_lookup(self.metrics, self.config.draft_policy, tenant, len(chunks) * chunk_tokens, result, chunk_tokens)
        self.metrics.observe("lookup_seconds", time.perf_counter() - start, tenant=tenant)
        return result

    def _find(
        self,
        tenant: str,
        fingerprint: str,
        chunks: Sequence[str],
        members: Sequence[MemberSpec],
        budget: WaitBudget | None,
    ) -> GroupLookup:
        names = [m.name for m in members]
        n = len(names)
        keys = [StoreKey(tenant, fingerprint, c, m) for c in chunks for m in names]
        where = self.locate(keys, budget)
        presence = [{m: where[ci * n + mi] is not None for mi, m in enumerate(names)} for ci in range(len(chunks))]
        result = resolve_lookup(presence, members, self.config.draft_policy)
        column = {m: mi for mi, m in enumerate(names)}
        located: dict[StoreKey, str] = {}
        for ci in range(result.hit_chunks):
            for m in result.members_to_load(ci):
                j = ci * n + column[m]
                if (tier_name := where[j]) is not None:
                    located[keys[j]] = tier_name
        return replace(result, located=located)

    def peek_headers(self, keys: Sequence[StoreKey], budget: WaitBudget | None = None) -> list[ObjectHeader | None]:
        """The header of each key from the fastest tier holding it (None: none does)."""
        return self.peek_located(keys, budget)[0]

    def peek_located(
        self, keys: Sequence[StoreKey], budget: WaitBudget | None = None
    ) -> tuple[list[ObjectHeader | None], list[str | None]]:
        """`peek_headers`, and the name of the tier each header came from (None: none).
        One `peek_headers` call per tier, for the keys no faster tier answered."""
        out: list[ObjectHeader | None] = [None] * len(keys)
        where: list[str | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, h in enumerate(out) if h is None]
            if not todo:
                break
            if self._over_budget(tier, budget):
                continue
            try:
                found = tier.peek_headers([keys[i] for i in todo])
                if len(found) != len(todo):
                    raise RuntimeError(f"{tier.name}.peek_headers returned {len(found)} headers for {len(todo)} keys")
            except Exception as exc:
                self.metrics.inc("tier_errors", tier=tier.name, status="exception")
                log.warning("kvpack: %s.peek_headers failed: %s", tier.name, exc)
                continue
            for i, header in zip(todo, found):
                out[i] = header
                where[i] = tier.name if header is not None else None
        return out, where

    # -- load (the reader's) ---------------------------------------------------------

    def prepare_load(
        self, what: Sequence[StoreKey] | Mapping[StoreKey, str] | GroupLookup, budget: WaitBudget | None = None
    ) -> LoadPlan:
        """Where each object to load is, its memory-tier copies pinned (`Reader.prepare_load`).

        `what`: keys (located now, one batched `contains` per tier), a lookup's
        `GroupLookup.located` or the lookup itself, or key -> tier names another
        process's lookup found (vLLM's scheduler). Pair with `complete_load` or `release`."""
        if isinstance(what, GroupLookup):
            what = what.located
        if isinstance(what, Mapping):
            return self.reads.prepare_load(what)
        keys = list(what)
        return self.reads.prepare_load({k: t for k, t in zip(keys, self.locate(keys, budget)) if t is not None})

    def complete_load(
        self, plan: LoadPlan, items: Sequence[LoadItem], local_only: bool = False, promote: bool = True
    ) -> list[GetResult]:
        """Restore each item, from the tier `plan` names first, then release the plan's pins
        (`Reader.complete_load`). Never raises."""
        return self.reads.complete_load(plan, items, local_only, promote)

    def release(self, plan: LoadPlan) -> None:
        """Release `plan`'s pins now (idempotent; `complete_load` calls it)."""
        self.reads.release(plan)

    def load(self, items: Sequence[LoadItem]) -> list[GetResult]:
        """Restore each item into its `dst`, fastest tier first (read-through). Never raises."""
        return self.reads.load(items)

    # -- store (the writer's) -----------------------------------------------------------

    def store(self, items: Sequence[PutItem]) -> list[TierStatus]:
        """Accept objects for storage (`Writer.store`); per item OK when accepted. Never raises."""
        return self.writes.store(items)

    def prepare_store(self, keys: Sequence[StoreKey], budget: WaitBudget | None = None) -> list[StoreKey]:
        """The keys still to store: on no tier, and not prepared by another caller that
        has not completed yet (`kvpack.store.lifecycle`): the one place saves are
        de-duplicated. Pair with `complete_store` or `complete_store_lent`."""
        return self.plans.claim_stores(keys, self.contains(keys, budget))

    def complete_store(self, items: Sequence[PutItem]) -> list[TierStatus]:
        """`store` the prepared items and end their preparation."""
        try:
            return self.writes.store(items)
        finally:
            self.plans.end_stores([it.key for it in items])

    def complete_store_lent(
        self, keys: Sequence[StoreKey], headers: Sequence[ObjectHeader], fill: Callable[[list[np.ndarray]], None]
    ) -> list[TierStatus]:
        """`Writer.store_lent` the items `prepare_store` gave (the caller writes each payload in
        place), and end their preparation (as `complete_store` does for `store`)."""
        try:
            return self.writes.store_lent(keys, headers, fill)
        finally:
            self.plans.end_stores(keys)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait (bounded) until every queued store reached its tiers. True if drained."""
        return self.writes.flush(timeout_s)

    def flush_before_exit(self, timeout_s: float, reason: str) -> bool:
        """The exit flush (`kvpack.exit_flush`): `flush` within `timeout_s`; what is
        still queued then is counted (``store_dropped{reason="shutdown"}`` per lower
        tier) and logged. True when everything reached its tiers."""
        if self.flush(timeout_s):
            return True
        left = self.writes.count_cut_off()
        log.warning(
            "kvpack: %d stores had not reached %s after shutdown_flush_s=%.1f (%s); they are lost",
            left,
            self.writes.lower_names,
            timeout_s,
            reason,
        )
        return False

    # -- misc ---------------------------------------------------------------------

    def remove_groups(self, groups: Sequence[GroupKey]) -> int:
        removed = 0
        for tier in self.tiers:
            n = tier.remove_groups(groups)
            if n and self.events is not None:
                self.events.removed(tier.name, groups)
            removed += n
        return removed

    def clear(self, scope: ClearScope, dry_run: bool = False) -> ClearReport:
        """Remove what `scope` names from every tier it covers (`kvpack.policy.clearing`), after the stores
        already accepted reached every tier (bounded by ``io_timeout_ms``: a store still queued
        then may land after the clear); counted as ``cleared_objects`` / ``cleared_bytes`` by tier."""
        if not dry_run and self.writes.queues:
            self.flush(self.config.io_timeout_ms / 1000.0)
        report = clear_tiers(self.tiers, scope, dry_run)
        if not dry_run:
            for name, cleared in report.removed.items():
                if self.events is not None and cleared.groups:  # routers hear of the memory tier's groups gone
                    self.events.removed(name, [GroupKey.parse(g) for g in cleared.groups])
                self.metrics.inc("cleared_objects", cleared.objects, tier=name)
                self.metrics.inc("cleared_bytes", cleared.nbytes or 0, tier=name)
            for name in report.failed:
                self.metrics.inc("clear_failures", tier=name)
        return report

    def name_group(self, fingerprint: str, label: str) -> None:
        """Record what `fingerprint` is in the tiers an operator reads (`Tier.name_group`)."""
        for tier in self.tiers:
            tier.name_group(fingerprint, label)

    def tier_events(self, capacity: int = DEFAULT_EVENTS) -> TierEventFeed:
        """Start reporting what the tiers take and let go into a bounded feed (idempotent: the
        same feed after the first call); drops are counted as ``tier_events_dropped``."""
        if self.writes.events is None:
            self.writes.events = TierEventFeed(capacity, lambda n: self.metrics.inc("tier_events_dropped", n))
        return self.writes.events

    def close(self, flush_timeout_s: float | None = None) -> None:
        """Drain the write-back queue (bounded by `flush_timeout_s`, default the config's
        ``shutdown_flush_s``; what it cuts off is counted), stop the workers, close the tiers."""
        if flush_timeout_s is None:
            flush_timeout_s = self.config.shutdown_flush_s
        if self._closed:
            return
        if self.writes.queues:
            self.flush_before_exit(flush_timeout_s, "close")
        forget(self)
        self._closed = True
        self.writes.close()
        self.metrics.stop_serving()
        if self.pins is not None:
            self.pins.close()
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as exc:  # pragma: no cover - best effort at shutdown
                log.warning("kvpack: closing %s failed: %s", tier.name, exc)
