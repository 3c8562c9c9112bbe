"""Read-through over the tiers: each object from the fastest tier that has it and passes every check.

`TierReads.load` is the load half of `kvpack.store.KVStore` (`load`, `complete_load`): a batched
`get_into` per tier, planned tiers first (where a lookup found each object), then read-through for
what they lacked. A lower-tier hit is promoted into memory; a damaged object's group is removed
from the tier that held it (`INTEGRITY_REASONS`); every refusal is a counted miss, never an exception.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config.schema import ChecksumPolicy
from ..identity.keys import GroupKey, StoreKey
from ..identity.objects import Expectation, PageExpectation, Payload, RejectReason, payload_nbytes
from ..observe.metrics import Metrics
from ..tiers.base import GetResult, PutItem, Tier, TierStatus
from .integrity import IntegrityKey, check_loaded
from .lifecycle import count_gone

log = logging.getLogger("kvpack")

INTEGRITY_REASONS = frozenset(
    {
        RejectReason.CHECKSUM,
        RejectReason.TRUNCATED,
        RejectReason.BAD_MAGIC,
        RejectReason.HEADER_CHECKSUM,
        RejectReason.GROUP,
    }
)
"""Refusals that mean the stored bytes are damaged (not merely another
writer's valid object): the damaged group is removed from that tier, so it is
not looked up and refused again on every request, and the next store rewrites it."""


@dataclass(frozen=True, slots=True)
class LoadItem:
    """One object to restore into the caller's buffer(s) `dst` (exactly its payload size)."""

    key: StoreKey
    dst: Payload
    expected: Expectation


@dataclass(frozen=True, eq=False)
class PageReads:
    """Whole pages of one member as one batch: `keys[i]` restored into `dsts[i]`, its stored
    header required to match `expected` with the key's chunk (`PageExpectation.matches`).
    Invariant: every key is of `expected.tenant` and `expected.member`. The per-page
    `LoadItem`s are built only where asked (`items`): a lent load from the memory tier
    needs none (`kvpack.lent`)."""

    keys: list[StoreKey]
    dsts: list[Payload]
    expected: PageExpectation

    def __len__(self) -> int:
        return len(self.keys)

    def items(self, which: Sequence[int] | None = None) -> list[LoadItem]:
        """The `LoadItem` of every page (of pages `which`, in that order)."""
        keys = self.keys if which is None else [self.keys[i] for i in which]
        dsts = self.dsts if which is None else [self.dsts[i] for i in which]
        return list(map(LoadItem, keys, dsts, self.expected.of([k.chunk for k in keys])))


class TierReads:
    """Batched reads over `tiers` (fastest first); `memory` is the host-RAM tier among them, if any.

    `checksum`: which tiers' payload checksums are verified; `integrity`: the opt-in keyed MAC that
    replaces them; `after_batch`: called once per `load` (the store counts evictions there)."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        memory: Tier | None,
        metrics: Metrics,
        checksum: ChecksumPolicy,
        integrity: IntegrityKey | None,
        after_batch: Callable[[], None],
    ) -> None:
        self.tiers = tuple(tiers)
        self._memory = memory
        self.metrics = metrics
        self._checksum = checksum
        self._integrity = integrity
        self._after_batch = after_batch

    def verifies(self, tier: Tier) -> bool:
        """Whether a load from `tier` checks its payload checksums (`ChecksumPolicy`)."""
        if self._checksum is ChecksumPolicy.ALWAYS:
            return True
        if self._checksum is ChecksumPolicy.NEVER:
            return False
        return tier is not self._memory  # BOUNDARY: objects that crossed a process or persistence boundary

    def load(
        self, items: Sequence[LoadItem], first: Sequence[Tier | None], local_only: bool = False, promote: bool = True
    ) -> list[GetResult]:
        """Each item from `first[i]` when set, then read-through from the other tiers;
        `local_only`: never from a `Tier.remote` one (a load inside an engine step);
        `promote`: a lower tier's hit is also put into the memory tier (False: the caller's
        destination is a cache of the engine's own in host memory, which holds it now)."""
        results: list[GetResult | None] = [None] * len(items)
        tiers = [t for t in self.tiers if not (local_only and t.remote)]
        for tier in tiers:
            planned = [i for i, t in enumerate(first) if t is tier]
            if planned:
                self._load_from(tier, items, planned, results, promote)
        gone = [
            i
            for i, (t, r) in enumerate(zip(first, results))
            if t is not None and r is not None and r.status is TierStatus.MISS
        ]
        for tier in tiers:
            todo = [i for i, r in enumerate(results) if r is None or not r.ok]
            if not todo:
                break
            todo = [i for i in todo if first[i] is not tier]
            if todo:
                self._load_from(tier, items, todo, results, promote)
        self._after_batch()
        if gone:
            gone_from = [t.name for i in gone if (t := first[i]) is not None]  # every i in gone has a first tier
            count_gone(self.metrics, [items[i].key for i in gone], gone_from, [results[i] for i in gone])
        final = [r if r is not None else GetResult(TierStatus.MISS) for r in results]
        for item, res in zip(items, final):
            if not res.ok:
                self.metrics.inc("load_failures", tenant=item.key.tenant, status=res.status.value)
        return final

    def _load_from(
        self,
        tier: Tier,
        items: Sequence[LoadItem],
        todo: Sequence[int],
        results: list[GetResult | None],
        promote: bool = True,
    ) -> None:
        """One batched get of `items[todo]` from `tier` into `results` (counted); `promote`: its
        hits are put into the memory tier too (`load`)."""
        start = time.perf_counter()
        got = self._safe_get(tier, [items[i] for i in todo])
        self.metrics.observe("load_seconds", time.perf_counter() - start, tier=tier.name)
        promoted: list[PutItem] = []
        damaged: list[GroupKey] = []
        loaded: dict[str, int] = {}
        promoting = promote and tier is not self._memory and self._memory is not None
        for i, res in zip(todo, got):
            item = items[i]
            if res.ok:
                results[i] = res
                header = res.header
                tenant = item.key.tenant
                loaded[tenant] = loaded.get(tenant, 0) + (
                    header.payload_len if header is not None else payload_nbytes(item.dst)
                )
                if promoting and header is not None:
                    promoted.append(PutItem(item.key, header, item.dst))
                continue
            if res.status is TierStatus.REJECTED:
                reason = res.reason.value if res.reason else "unknown"
                self.metrics.inc("rejected_objects", tier=tier.name, reason=reason)
                log.warning("kvpack: refused %s from %s: %s %s", item.key.as_str(), tier.name, reason, res.detail)
                if res.reason in INTEGRITY_REASONS:
                    damaged.append(item.key.group)
            elif res.status is not TierStatus.MISS:
                self.metrics.inc("tier_errors", tier=tier.name, status=res.status.value)
            if results[i] is None or results[i].status is TierStatus.MISS:  # type: ignore[union-attr]
                results[i] = res
        for tenant, nbytes in loaded.items():
            self.metrics.inc("loaded_bytes", nbytes, tenant=tenant, tier=tier.name)
        if promoted and self._memory is not None:
            self._memory.put_from(promoted)
        if damaged:
            self._remove_quietly(tier, damaged)

    def _remove_quietly(self, tier: Tier, groups: Sequence[GroupKey]) -> None:
        try:
            tier.remove_groups(list(dict.fromkeys(groups)))
        except Exception as exc:
            log.warning("kvpack: removing damaged groups from %s failed: %s", tier.name, exc)

    def _safe_get(self, tier: Tier, items: Sequence[LoadItem]) -> list[GetResult]:
        try:
            verify = self.verifies(tier)
            keyed = self._integrity is not None  # the MAC replaces the tier's own xxh3 check
            dsts = [i.dst for i in items]
            out = tier.get_into([i.key for i in items], dsts, [i.expected for i in items], verify and not keyed)
            if len(out) != len(items):
                raise RuntimeError(f"{tier.name}.get_into returned {len(out)} results for {len(items)}")
            if self._integrity is not None:
                out = check_loaded(self._integrity, dsts, out, tier is not self._memory, verify)
            return out
        except Exception as exc:
            log.warning("kvpack: %s.get_into failed: %s", tier.name, exc)
            return [GetResult(TierStatus.ERROR, detail=str(exc)) for _ in items]
