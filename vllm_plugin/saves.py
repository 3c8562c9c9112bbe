"""A save's copies: blocks of each member gathered into staging rows on the save lane
(`kvpack.transfers.Staging`), as the transfer runner's `kvpack.Gathered` (it reads them as the
session's objects on its save thread, after the gather's event: the core builds their
keys and headers).

On a GPU the gather runs on the save side stream after the compute stream (the step's
forward), the compute stream waits on its event, and the rows are pinned. On the CPU the
gather ran inline and the rows are plain host memory (zero-copy)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from kvpack import ChunkFacts, Gathered
from kvpack.transfers import Staging

from .metadata import NO_BLOCK, TransferJob
from .registration import MemberLayout


def gather_members(staging: Staging, slots: Sequence[MemberLayout], job: TransferJob) -> list[Gathered]:
    """Launch the gather of `job`'s blocks of each member `slots` (in that order) into
    fresh staging rows; nothing is read here."""
    out: list[Gathered] = []
    try:
        for slot in slots:
            refs = [ref for ref in job.blocks if ref.block_ids[slot.group] != NO_BLOCK]
            if not refs:
                continue
            ids = [ref.block_ids[slot.group] for ref in refs]
            layout = slot.layout
            staged = staging.gather(len(refs), layout.slot_bytes, partial(layout.gather, ids))
            facts = [ChunkFacts(ref.chunk, ref.token_count, ref.token_ids, ref.announce) for ref in refs]
            out.append(Gathered(slot.obj, facts, staged))
    except BaseException:
        for g in out:  # launched already: their rows are freed only after their events
            g.staged.release()
        raise
    return out


def save_bytes(slots: Sequence[MemberLayout], job: TransferJob) -> int:
    """Payload bytes `job` stores for `slots` (what the queued-save bound counts)."""
    return sum(slot.layout.slot_bytes for slot in slots for ref in job.blocks if ref.block_ids[slot.group] != NO_BLOCK)
