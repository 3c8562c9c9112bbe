"""A vLLM load's copies: the staging rows each object of a `TransferJob` is read into, and
the scatter of the rows that loaded into the engine's blocks (member by member, head
ranges of another TP size cut to this rank's heads, target-only loads' draft state
zeroed). Built per job on the runner's load thread (`kvpack.TransferRunner` calls
`BlockLoads.plan` through `LoadJob.plan`); what a worker copies is fixed at registration
(`registration.WorkerLayout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from kvpack import ChunkFacts, HeadRange, LayoutError, MemberObject, ObjectIO, PlannedLoad, address_of
from kvpack.transfers import Lane, Staging

from .canonical_blocks import CanonicalBlocks
from .metadata import NO_BLOCK, BlockRef, TransferJob
from .registration import MemberLayout, WorkerLayout
from .scopes import Scope


@dataclass(frozen=True, eq=False)
class BlockLoads:
    """How one registered worker reads a load's objects and scatters them (module docstring)."""

    layout: WorkerLayout
    scope: Scope

    def plan(self, job: TransferJob, staging: Staging) -> PlannedLoad:
        """On the load thread: staging rows for every object `job` reads, and its scatter."""
        layout = self.layout
        plans: list[_MemberLoad] = []
        reads: list[ObjectIO] = []
        chunk_of: list[int] = []
        facts = [ChunkFacts(b.chunk, b.token_count, b.token_ids) for b in job.blocks]
        try:
            for slot in layout.members:
                wanted = [
                    i
                    for i, ref in enumerate(job.blocks)
                    if ref.block_ids[slot.group] != NO_BLOCK and (not slot.draft or ref.with_draft)
                ]
                for source in sorted({job.blocks[i].source for i in wanted}):  # a request may mix head splits
                    of_split = [i for i in wanted if job.blocks[i].source == source]
                    for part in self._member_loads(staging, slot, of_split, source, len(reads)):
                        plans.append(part)
                        rows, obj = part.staging.numpy(), MemberObject(part.member, part.fingerprint)
                        reads += [ObjectIO(facts[i], obj, memoryview(rows[j])) for j, i in enumerate(of_split)]
                        chunk_of += of_split
        except BaseException:
            staging.give_back([p.staging for p in plans])
            raise
        scatter = partial(self._scatter, staging, job, plans)
        lends = staging.device.reads_host_in_place and all(
            isinstance(m.layout, CanonicalBlocks) and m.layout.reads_addresses for m in layout.members
        )
        return PlannedLoad(reads, chunk_of, [p.staging for p in plans], scatter, lends)

    def _member_loads(
        self, staging: Staging, slot: MemberLayout, wanted: list[int], source: int, first: int
    ) -> list[_MemberLoad]:
        """The objects to read for `slot`'s chunks `wanted`: its own member, or (canonical
        objects stored at another TP size: `BlockRef.source`) every stored head range
        that overlaps this rank's heads, each with the part of it this rank keeps. Their
        reads are the plan's from `first` on, one range of ``len(wanted)`` per object set."""
        blocks = slot.layout
        if source == 0 or not slot.sources:
            rows = staging.rows(len(wanted), blocks.slot_bytes)
            return [_MemberLoad(slot, wanted, rows, slot.member, slot.fingerprint, first)]
        assert isinstance(blocks, CanonicalBlocks)
        out = []
        for k, obj in enumerate(slot.sources[source]):
            rows = staging.rows(len(wanted), blocks.object_bytes(obj.heads))
            at = first + k * len(wanted)
            out.append(_MemberLoad(slot, wanted, rows, obj.member, obj.fingerprint, at, (obj.heads, obj.part)))
        return out

    def _scatter(
        self,
        staging: Staging,
        job: TransferJob,
        plans: list[_MemberLoad],
        good: Sequence[bool],
        lent: Sequence[memoryview | None],
        lane: Lane,
    ) -> int:
        """Loaded rows -> blocks, member by member, launched on the load `lane` (the runner
        calls it under its lock, never after a cancel, and waits for the lane's event).
        A lent payload (``lent[i]`` for read i) is read where it lies when the member's
        layout reads objects at addresses (`CanonicalBlocks.scatter_at`: the conversion is
        the load's only copy); else it is first copied into its staging row. Returns the
        lent bytes read in place."""
        in_place = 0
        layout = self.layout
        for plan in plans:
            slot, wanted, rows = plan.slot, plan.wanted, plan.staging
            sel = [j for j, i in enumerate(wanted) if good[i]]
            if not sel:
                continue
            ids = [job.blocks[wanted[j]].block_ids[slot.group] for j in sel]
            views = lent[plan.first : plan.first + len(wanted)]
            if any(views[j] is not None for j in sel):  # only where every layout reads addresses (`lends`)
                assert isinstance(slot.layout, CanonicalBlocks)
                whole = plan.heads is None
                # a view the device cannot read where it lies (on a GPU: not registered) goes to its row first
                addrs = [_readable_address(staging, views[j], rows[j], whole) for j in sel]
                read_there = sum(view.nbytes for j, a in zip(sel, addrs) if (view := views[j]) is not None and a)
                if read_there:
                    slot.layout.scatter_at(ids, [a or rows[j].data_ptr() for j, a in zip(sel, addrs)], lane)
                    in_place += read_there
                    continue
            rows = staging.copy_rows(rows[sel], lane) if len(sel) < len(wanted) else rows
            if plan.heads is not None:
                assert isinstance(slot.layout, CanonicalBlocks)
                slot.layout.scatter_from(ids, rows, *plan.heads, lane=lane)
            else:
                slot.layout.scatter(ids, rows, lane)
        if layout.draft_member is None or layout.draft is None:
            return in_place
        # target_only: chunks loaded without their draft member get empty draft state
        empty = [
            ref.block_ids[0]
            for ref, ok in zip(job.blocks, good)
            if ok and not ref.with_draft and ref.block_ids[0] != NO_BLOCK
        ]
        if empty:
            layout.draft.scatter(empty, staging.zeros(len(empty), layout.draft.slot_bytes, lane), lane)
        return in_place


@dataclass(frozen=True, eq=False)
class _MemberLoad:
    """One object per chunk `wanted` of a load, read into `staging` rows: `member` (with
    `fingerprint`) restores `slot`; `heads` (stored range, the part this rank keeps) when
    the object is a canonical head range other than this rank's own."""

    slot: MemberLayout
    wanted: list[int]
    staging: torch.Tensor
    member: str
    fingerprint: str
    first: int
    """Index of its first read in the plan's reads (read ``first + j`` is row j)."""
    heads: tuple[HeadRange, HeadRange] | None = None


def _readable_address(staging: Staging, view: memoryview | None, row: torch.Tensor, whole: bool) -> int:
    """Where the scatter reads a lent payload `view` in place: its host address, when the
    scatter copies whole objects (`whole`) and the device reads that memory there
    (`StagingDevice.reads_in_place`); else 0, after copying the payload into its staging
    `row`. 0 for a read that was not lent (already in its row)."""
    if view is None:
        return 0
    address = address_of(view)
    if whole and staging.device.reads_in_place(address, view.nbytes):
        return address
    np.copyto(row.numpy(), np.frombuffer(view, dtype=np.uint8))
    return 0


def refused_plan(staging: Staging) -> PlannedLoad:
    """The load plan of a worker whose cache registration was refused: none (its disabled
    runner fails such loads before planning them)."""
    raise LayoutError("kvpack: this worker's KV cache was refused at registration")


def tokens_used(ref: BlockRef) -> int:
    """Tokens a loaded block contributes: a whole block, or a tail's matched prefix."""
    return ref.token_count if ref.token_ids is None else len(ref.token_ids)
