"""Withdraw, for KV-aware routers, what other processes evicted from a shared tier.

A process reports the groups its own tiers let go (`TierEventFeed.removed`). On a tier
shared with other processes (the host store, ``memory.mode: host``; the disk tier, whose
``disk.path`` several processes share) another process's saves also evict, and nothing tells
this process: a router would keep sending it requests
for groups it can no longer load (a miss on load, never a wrong load, but a wrong view).
`SharedSweep` is the policy that corrects the view, one per shared tier (the same rule for
each; `shared_tier_sweeps`), run once per engine step by an adapter
(vLLM: the scheduler side, `kvpack.vllm_plugin.kv_events`), which translates its answer.

Invariants:

- only groups this process announced on the tier are followed (`announced`); one this
  process's own removal withdrew is forgotten (`forget`), so no group is withdrawn twice;
- one `sweep` checks at most `per_step` followed groups, those checked longest ago first
  (a rotation: every followed group is checked once per ``len / per_step`` steps), with one
  batched read of the tier's index (`groups_present`: one ``SELECT`` per 500 groups, no file
  opened, no write, the index's busy timeout its bound); it checks nothing while the index is
  not the tier's truth (`index_complete`: the disk index while a process still scans a large
  existing folder into it; re-read at most twice a second, one small read), and an index
  error skips the step (the next step retries): a step never waits on storage past that bound;
- a followed group the index no longer holds is answered once as a REMOVED `TierEvent` and
  forgotten (if another process stores it again, this process did not announce that copy);
- bounded: at most `limit` groups are followed: ``min(max_groups, capacity // smallest group
  bytes seen)``. Groups of one layout charge the same bytes, so the store cannot hold more of
  them at once: past the limit at least one followed group is gone already, and the one
  checked longest ago is withdrawn (a router losing a hint costs it a choice, never a load);
- every withdrawal is counted as ``kvpack_shared_withdrawals{tier}``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from ..identity.keys import GroupKey
from .metrics import Metrics
from .tier_events import TierEvent, TierEventKind


class SweptSession(Protocol):
    """What `shared_tier_sweeps` reads of a session: its metrics and its store's tiers."""

    @property
    def metrics(self) -> Metrics: ...

    @property
    def store(self) -> SweptStore: ...


class SweptStore(Protocol):
    @property
    def tiers(self) -> Sequence[Any]: ...


log = logging.getLogger("kvpack")

SWEPT_TIERS = ("host", "disk")
"""Tiers shared with other processes whose index answers presence in one read."""
PER_STEP = 64
"""Followed groups checked per engine step (one indexed read of at most this many rows)."""
MAX_GROUPS = 1 << 17
"""Followed groups at most, whatever the store's capacity (about 100 bytes each)."""


class PresenceIndex(Protocol):
    """What the sweep reads: a tier's index (`kvpack.tiers.disk.DiskTier` and the host tier)."""

    name: str

    def groups_present(self, groups: Sequence[GroupKey]) -> list[int | None]: ...

    def index_complete(self) -> bool: ...

    @property
    def capacity_bytes(self) -> int: ...


class SharedSweep:
    """The groups this process announced on one shared tier, checked a slice per step (module docstring).

    Not thread-safe: one adapter thread (vLLM's scheduler) calls every method."""

    def __init__(
        self,
        tier: PresenceIndex,
        metrics: Metrics | None = None,
        per_step: int = PER_STEP,
        max_groups: int = MAX_GROUPS,
    ) -> None:
        if per_step < 1 or max_groups < 1:
            raise ValueError(f"per_step and max_groups must be >= 1, got {per_step} and {max_groups}")
        self.tier = tier
        self.per_step = per_step
        self.max_groups = max_groups
        self._metrics = metrics
        self._followed: OrderedDict[GroupKey, None] = OrderedDict()
        """Checked longest ago first (a new one counts as just checked: it was just stored)."""
        self._group_bytes: int | None = None
        self.withdrawn = 0
        """Groups withdrawn since the start (what ``kvpack_shared_withdrawals`` counts)."""

    @property
    def limit(self) -> int:
        """The most groups followed at once (module docstring)."""
        if not self._group_bytes:
            return self.max_groups
        return max(1, min(self.max_groups, self.tier.capacity_bytes // self._group_bytes))

    def __len__(self) -> int:
        return len(self._followed)

    def announced(self, group: GroupKey) -> list[TierEvent]:
        """This process announced `group` on the tier; the withdrawals the limit forces (usually none)."""
        self._followed[group] = None
        self._followed.move_to_end(group)
        over = len(self._followed) - self.limit
        return self._withdraw([self._followed.popitem(last=False)[0] for _ in range(max(0, over))])

    def forget(self, group: GroupKey) -> None:
        """Stop following `group` (this process's own removal withdrew it, or its facts are gone)."""
        self._followed.pop(group, None)

    def sweep(self) -> list[TierEvent]:
        """One step's check: REMOVED events for the followed groups the tier no longer holds."""
        if not self._followed:
            return []
        batch = [g for g, _ in zip(self._followed, range(self.per_step))]
        try:
            if not self.tier.index_complete():
                return []
            present = self.tier.groups_present(batch)
        except Exception as exc:  # noqa: BLE001 - a busy or lost index: the next step retries
            log.debug("kvpack: shared sweep of %s skipped: %s", self.tier.name, exc)
            return []
        gone: list[GroupKey] = []
        for group, nbytes in zip(batch, present):
            if nbytes is None:
                gone.append(group)
                del self._followed[group]
            else:
                self._followed.move_to_end(group)
                self._group_bytes = nbytes if self._group_bytes is None else min(self._group_bytes, nbytes)
        return self._withdraw(gone)

    def _withdraw(self, groups: list[GroupKey]) -> list[TierEvent]:
        if not groups:
            return []
        self.withdrawn += len(groups)
        if self._metrics is not None:
            self._metrics.inc("shared_withdrawals", len(groups), tier=self.tier.name)
        return [TierEvent(TierEventKind.REMOVED, self.tier.name, g.as_str()) for g in groups]


def shared_tier_sweeps(session: SweptSession) -> list[SharedSweep]:
    """A sweep of each of `session`'s tiers named in `SWEPT_TIERS`, counted in its metrics (in
    the store's tier order; empty: no shared tier here)."""
    return [
        SharedSweep(tier, session.metrics)  # a DiskTier by its methods
        for tier in session.store.tiers
        if tier.name in SWEPT_TIERS and hasattr(tier, "groups_present")
    ]


def shared_tier_sweep(session: SweptSession, tier: str | None = None) -> SharedSweep | None:
    """The sweep of `session`'s first shared tier (named `tier` if given; None: no such tier here)."""
    return next((s for s in shared_tier_sweeps(session) if tier is None or s.tier.name == tier), None)
