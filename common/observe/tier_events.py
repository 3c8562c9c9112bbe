"""What kvpack's tiers now hold, as a feed of events (for KV-aware routers).

`KVStore` reports into a `TierEventFeed` (only when one is attached: `KVStore.tier_events`;
with none, every hook is one ``is None`` test) each group a tier took (`TierEventKind.STORED`:
the store's put into its memory tier, a lower tier's write-back, a write-through) and each
group a tier let go (`TierEventKind.REMOVED`: evicted by its capacity, or removed by a caller).
An engine adapter drains the feed and translates the groups into its engine's events (vLLM:
``BlockStored`` / ``BlockRemoved`` with a medium per tier, `kvpack.vllm_plugin.kv_events`).

Invariants:

- one event names one group (``GroupKey.as_str()``) on one tier (`Tier.name`); a put of
  several members of one group is one STORED event;
- the feed is bounded: when nobody drains it, the oldest events go and each one dropped is
  counted (``kvpack_tier_events_dropped``); it never blocks and never grows past `capacity`;
- REMOVED is what this process saw: a tier shared with other processes (disk, Mooncake, a
  host-shared tier) reports the removals made here, not those another process made.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..identity.keys import GroupKey, StoreKey

DEFAULT_CAPACITY = 65_536
"""Events kept undrained before the oldest are dropped (about 10 MB at most)."""


class TierEventKind(enum.Enum):
    STORED = "stored"
    """The tier holds the group's objects from now on (a put this process made)."""
    REMOVED = "removed"
    """The tier no longer holds the group (evicted or removed by this process)."""


@dataclass(frozen=True, slots=True)
class TierEvent:
    """One group on one tier; `group` is ``GroupKey.as_str()``, `tier` a `Tier.name`."""

    kind: TierEventKind
    tier: str
    group: str


class TierEventFeed:
    """A bounded ring of `TierEvent`s: writers never wait on readers; the oldest go first.

    `removed` may run under a tier's lock (its eviction callback): it only appends.
    Drops are counted through `on_drop(n)` from `stored` and `take` (never under a tier's lock).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, on_drop: Callable[[int], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"tier event capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._events: deque[TierEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._dropped_uncounted = 0
        self.dropped = 0
        """Events dropped since the feed began (the oldest, when it was full)."""
        self._on_drop = on_drop

    def __len__(self) -> int:
        return len(self._events)

    def stored(self, tier: str, keys: Iterable[StoreKey]) -> None:
        """`tier` took these objects: one STORED event per group among them (in first-seen order)."""
        groups = dict.fromkeys(k.group.as_str() for k in keys)
        self._add([TierEvent(TierEventKind.STORED, tier, g) for g in groups])
        self._count_drops()

    def stored_where(self, tier: str, keys: Sequence[StoreKey], ok: Sequence[bool]) -> None:
        """`stored` for the keys whose `ok` is true (a tier's per-item outcome)."""
        self.stored(tier, (k for k, good in zip(keys, ok) if good))

    def removed(self, tier: str, groups: Iterable[GroupKey]) -> None:
        """`tier` let these groups go. Cheap: safe under a tier's lock."""
        self._add([TierEvent(TierEventKind.REMOVED, tier, g.as_str()) for g in groups])

    def take(self) -> list[TierEvent]:
        """Every event since the last call, oldest first."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        self._count_drops()
        return events

    def _add(self, events: list[TierEvent]) -> None:
        if not events:
            return
        with self._lock:
            over = len(self._events) + len(events) - self.capacity
            if over > 0:
                self._dropped_uncounted += over
                self.dropped += over
            self._events.extend(events)

    def _count_drops(self) -> None:
        if not self._dropped_uncounted:
            return
        with self._lock:
            n, self._dropped_uncounted = self._dropped_uncounted, 0
        if n and self._on_drop is not None:
            self._on_drop(n)
