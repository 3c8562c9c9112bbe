"""Another process's host-memory tier, seen through that process's reports.

An engine whose lookups run in one process and whose copies run in others
(vLLM: the scheduler in the engine-core process, the workers elsewhere) cannot
ask the workers' memory tiers directly. The workers report every object they put
into memory (`ReportedObject`) and every group their memory evicts; this `Tier`
answers `contains` and `peek_headers` from those reports, so `KVStore.lookup` and
`KVStore.tails` see memory like any other tier. Its name is the memory tier's
(``memory``): a lookup's located hint "memory" sends the worker's load to its own
memory tier. It never holds payloads: `get_into` answers MISS (loads run in the
processes that hold the data).

A stale entry (evicted after the report was sent) costs one failed load,
which the connector reports to vLLM as a load error (recompute), never a
wrong load.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ..identity.keys import GroupKey, StoreKey
from ..identity.objects import Expectation, ObjectHeader, Payload
from ..policy.clearing import Cleared, ClearScope
from .base import GetResult, Medium, PutItem, Tier, TierStatus, TierUsage


@dataclass(frozen=True)
class ReportedObject:
    """An object a process put into its memory tier (a tail carries its token ids).
    `key` is `StoreKey.as_str()`; `payload_len` in bytes."""

    key: str
    token_count: int
    payload_len: int
    token_ids: tuple[int, ...] | None = None


class ReportedMemoryIndex(Tier):
    """Index of other processes' memory tiers, fed by their reports. Bounded (oldest dropped)."""

    name = "memory"
    medium = Medium.HOST

    def __init__(self, max_objects: int = 1_000_000) -> None:
        self._lock = threading.Lock()
        self._headers: OrderedDict[StoreKey, ObjectHeader] = OrderedDict()
        self._by_group: dict[GroupKey, set[StoreKey]] = {}
        self._max = max_objects

    # -- reports -------------------------------------------------------------

    def apply(self, stored: Sequence[ReportedObject], evicted: Sequence[str]) -> None:
        with self._lock:
            for group_str in evicted:
                try:
                    group = GroupKey.parse(group_str)
                except ValueError:
                    continue
                for key in self._by_group.pop(group, set()):
                    self._headers.pop(key, None)
            for obj in stored:
                key = StoreKey.parse(obj.key)
                self._headers[key] = ObjectHeader(
                    fingerprint="0" * 32,
                    tenant=key.tenant,
                    chunk=key.chunk,
                    member=key.member,
                    token_count=obj.token_count,
                    payload_len=obj.payload_len,
                    checksum=None,
                    token_ids=obj.token_ids,
                )
                self._headers.move_to_end(key)
                self._by_group.setdefault(key.group, set()).add(key)
            while len(self._headers) > self._max:
                old, _ = self._headers.popitem(last=False)
                members = self._by_group.get(old.group)
                if members is not None:
                    members.discard(old)
                    if not members:
                        del self._by_group[old.group]

    # -- Tier ----------------------------------------------------------------

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        with self._lock:
            return [k in self._headers for k in keys]

    def peek_headers(self, keys: Sequence[StoreKey]) -> list[ObjectHeader | None]:
        with self._lock:
            return [self._headers.get(k) for k in keys]

    def get_into(
        self,
        keys: Sequence[StoreKey],
        dsts: Sequence[Payload],
        expected: Sequence[Expectation],
        verify_checksum: bool,
    ) -> list[GetResult]:
        return [GetResult(TierStatus.MISS) for _ in keys]

    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        return [TierStatus.UNAVAILABLE for _ in items]

    def remove_groups(self, groups: Sequence[GroupKey]) -> int:
        removed = 0
        with self._lock:
            for g in groups:
                for key in self._by_group.pop(g, set()):
                    removed += self._headers.pop(key, None) is not None
        return removed

    def clear(self, scope: ClearScope, dry_run: bool = False) -> Cleared:
        """Forget (or count) the reported objects `scope` matches (the processes that hold them
        drop their own copies: vLLM's workers, told in the next step's connector metadata)."""
        with self._lock:
            groups = [g for g in self._by_group if scope.matches(g.tenant, g.fingerprint)]
            keys = [k for g in groups for k in self._by_group[g]]
            nbytes = sum(self._headers[k].payload_len for k in keys if k in self._headers)
            if not dry_run:
                for g in groups:
                    for key in self._by_group.pop(g, set()):
                        self._headers.pop(key, None)
        return Cleared(len(keys), nbytes)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(0, 0, len(self._headers), len(self._by_group))
