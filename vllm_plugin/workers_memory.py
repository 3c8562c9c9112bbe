"""The workers' memory tiers as vLLM's scheduler process sees them.

The scheduler cannot read the workers' memory; it keeps an index of it
(`kvpack.ReportedMemoryIndex`) fed two ways: by the workers' reports (what they
stored and evicted, `KVPackWorkerMetadata`) and, ahead of them, by what this side
planned to save (`expect`): a save job is counted as in memory from the step that
plans it, so the next request with the same prefix hits while the first still
decodes. The index is wrong only towards a miss the worker counts
(``evicted_before_load``) and reads from another tier: a save that fails, an object
evicted since the last report.

A host memory tier (``memory.mode: host``) is every process's: this side reads it
directly, so the workers report nothing; a hit whose every object is there loads inside
the step as one from the workers' own memory does (`holds`, through the store's
`tiers.front`). What this side planned to save is not there until a worker wrote it, so
the index, behind the host store (`kvpack.KVStore.reader`), holds only those planned
saves, each for as long as a load may wait for it (``io_timeout_ms`` from the end of the
step that planned it: the save runs after that step's forward; `step_ended`): a request with
the same prefix in the next step hits, and its load (asynchronous: not in
the host store yet) waits for the save before it as with a per-process tier. After that
the host store alone answers (an object it lost since is a miss, never a stale hit).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from kvpack import (
    HitPlan,
    KVPackConfig,
    MemberRole,
    MemberSpec,
    MemoryMode,
    ReportedMemoryIndex,
    Session,
    StoreKey,
)

from .metadata import NO_BLOCK, StoredObject, TransferJob
from .scopes import Scope

KeyOf = Callable[[str, str, str], StoreKey]
"""(tenant, chunk, member) -> the store key (`kvpack.Session.key`)."""


class WorkersMemory:
    """The index of the workers' memory tiers and the two questions asked of it."""

    def __init__(self, config: KVPackConfig, scope: Scope, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = ReportedMemoryIndex()
        self.scope = scope
        self.reported = config.memory.enabled and config.memory.mode is not MemoryMode.HOST
        """Do the workers report their memory tier here? Only a per-process one."""
        host = config.memory.enabled and config.memory.mode is MemoryMode.HOST
        self.landing_s = config.io_timeout_ms / 1000.0 if host else 0.0
        """With a host store: seconds a planned save counts as held before the host store
        alone answers for it (0: no host store)."""
        self._clock = clock
        self._step = 0
        """Engine steps ended (`step_ended`)."""
        self._planned: list[tuple[int, list[str]]] = []
        """(step, group keys) of planned saves whose step has not ended when last looked."""
        self._landing: deque[tuple[float, list[str]]] = deque()
        """(when to forget, group keys) of the planned saves of ended steps, oldest first."""

    @property
    def tiers(self) -> list[ReportedMemoryIndex]:
        """The tiers this view puts before the store's own: the index, with a per-process
        memory tier or (its planned saves only) a host store; none without a memory tier."""
        return [self.index] if self.reported or self.landing_s else []

    def apply(self, stored: Sequence[StoredObject], evicted: Sequence[str]) -> None:
        """A worker's report: objects it stored, groups it evicted."""
        self.index.apply(stored, evicted)

    def expect(self, job: TransferJob, key: KeyOf) -> None:
        """Count what `job` saves as in the workers' memory now, not when their report comes
        (the same step's saves land before any later load: `WorkerSide` orders them). A
        save that fails costs a counted load miss and a recompute, never a wrong load.
        With a host store they count until `landing_s` passed (`step_ended`)."""
        if not (self.reported or self.landing_s):
            return
        expected = []
        groups: set[str] = set()
        for ref in job.blocks:
            for g, block in enumerate(ref.block_ids):
                if block == NO_BLOCK:
                    continue
                members = self.scope.group_members(g) + (self.scope.draft_members if g == 0 else ())
                keys = [key(job.tenant, ref.chunk, m) for m in members]
                expected += [StoredObject(k.as_str(), ref.token_count, 0, ref.token_ids) for k in keys]
                groups.update(k.group.as_str() for k in keys)
        if self.landing_s and groups:
            self._planned.append((self._step, sorted(groups)))
        self.index.apply(expected, ())

    def step_ended(self) -> None:
        """The scheduler planned a step (`build_connector_meta`). With a host store, the saves
        planned in the steps before ran after those steps' forwards: their `landing_s` starts
        now; those whose `landing_s` passed are forgotten (a group planned again since is
        forgotten with them: the host store answers for it from then on)."""
        now = self._clock()
        if self._planned and self._planned[0][0] < self._step:
            ended = [p for p in self._planned if p[0] < self._step]
            self._planned = [p for p in self._planned if p[0] >= self._step]
            self._landing.extend((now + self.landing_s, groups) for _, groups in ended)
        self._step += 1
        while self._landing and self._landing[0][0] <= now:
            _, groups = self._landing.popleft()
            self.index.apply((), groups)

    def holds(self, plan: HitPlan, tail_members: Sequence[MemberSpec], session: Session) -> bool:
        """Whether every object `plan` loads (its chunks, then its tail read as `tail_members`)
        is in the workers' memory: as far as their reports say, or, with a host memory tier,
        in the host store now (`session.tiers.front`)."""
        if self.reported:
            memory, contains = self.index.name, self.index.contains
        elif session.tiers.front is not None:
            memory, contains = session.tiers.front, session.tiers.in_front
        else:
            return False
        if plan.scope is None or len(plan.tiers) < plan.hit_chunks:
            return False
        if any(t != memory for chunk in plan.tiers for _m, t in chunk):
            return False
        if plan.tail is None:
            return True
        names = [
            m.name
            for m in tail_members
            if m.role is MemberRole.TARGET or (m.role is MemberRole.DRAFT and plan.tail.with_draft)
        ]
        return all(contains([session.key(plan.scope.tenant, plan.tail.chunk, m) for m in names]))
