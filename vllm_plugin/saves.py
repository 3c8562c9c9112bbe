"""A save's copies: blocks of each member gathered into staging rows on the save lane
(`kvpack.ops.Staging`), then, on the thread that stores them, read as the session's
objects (`kvpack.ObjectIO`: the core builds their keys and headers).

On a GPU the gather runs on the save side stream after the compute stream (the step's
forward) and the rows are pinned; `save_objects` reads them only after the gather's event.
On the CPU the gather ran inline and the rows are plain host memory (zero-copy)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from kvpack import ChunkFacts, ObjectIO
from kvpack.ops import Staged, Staging

from .metadata import NO_BLOCK, BlockRef, TransferJob
from .registration import MemberLayout


@dataclass(frozen=True, eq=False)
class Captured:
    """One member's gathered rows of a save: `staged` row i is chunk `refs[i]`."""

    slot: MemberLayout
    refs: list[BlockRef]
    staged: Staged


def gather_members(staging: Staging, slots: Sequence[MemberLayout], job: TransferJob) -> list[Captured]:
    """Launch the gather of `job`'s blocks of each member `slots` (in that order) into
    fresh staging rows; nothing is read here."""
    out: list[Captured] = []
    try:
        for slot in slots:
            refs = [ref for ref in job.blocks if ref.block_ids[slot.group] != NO_BLOCK]
            if not refs:
                continue
            ids = [ref.block_ids[slot.group] for ref in refs]
            layout = slot.layout
            staged = staging.gather(len(refs), layout.slot_bytes, partial(layout.gather, ids))
            out.append(Captured(slot, refs, staged))
    except BaseException:
        for c in out:  # launched already: their rows are freed only after their events
            c.staged.release()
        raise
    return out


def save_objects(captured: Sequence[Captured], job: TransferJob) -> list[ObjectIO]:
    """One object per chunk and member, over the rows (each waits for its gather's event)."""
    out: list[ObjectIO] = []
    for c in captured:
        rows = c.staged.host_rows()
        obj = c.slot.obj
        out += [
            ObjectIO(ChunkFacts(ref.chunk, ref.token_count, ref.token_ids), obj, memoryview(rows[i]))
            for i, ref in enumerate(c.refs)
        ]
    return out
