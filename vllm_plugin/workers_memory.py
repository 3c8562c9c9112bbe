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
directly, so the workers report nothing and the index stays out of the store; a hit
whose every object is there loads inside the step as one from the workers' own memory
does (`holds`, through the store's `front_tier`).
"""

from __future__ import annotations

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

    def __init__(self, config: KVPackConfig, scope: Scope) -> None:
        self.index = ReportedMemoryIndex()
        self.scope = scope
        self.reported = config.memory.enabled and config.memory.mode is not MemoryMode.HOST
        """Do the workers report their memory tier here? Only a per-process one."""

    @property
    def tiers(self) -> list[ReportedMemoryIndex]:
        """The tiers this view puts in front of the store's own (none with a host memory tier)."""
        return [self.index] if self.reported else []

    def apply(self, stored: Sequence[StoredObject], evicted: Sequence[str]) -> None:
        """A worker's report: objects it stored, groups it evicted."""
        self.index.apply(stored, evicted)

    def expect(self, job: TransferJob, key: KeyOf) -> None:
        """Count what `job` saves as in the workers' memory now, not when their report comes
        (the same step's saves land before any later load: `WorkerSide` orders them). A
        save that fails costs a counted load miss and a recompute, never a wrong load."""
        if not self.reported:
            return
        expected = []
        for ref in job.blocks:
            for g, block in enumerate(ref.block_ids):
                if block == NO_BLOCK:
                    continue
                members = self.scope.group_members(g) + (self.scope.draft_members if g == 0 else ())
                expected += [
                    StoredObject(key(job.tenant, ref.chunk, m).as_str(), ref.token_count, 0, ref.token_ids)
                    for m in members
                ]
        self.index.apply(expected, ())

    def holds(self, plan: HitPlan, tail_members: Sequence[MemberSpec], session: Session) -> bool:
        """Whether every object `plan` loads (its chunks, then its tail read as `tail_members`)
        is in the workers' memory: as far as their reports say, or, with a host memory tier,
        in the host store now (`session.front_tier`)."""
        if self.reported:
            memory, contains = self.index.name, self.index.contains
        elif session.front_tier is not None:
            memory, contains = session.front_tier, session.in_front
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
