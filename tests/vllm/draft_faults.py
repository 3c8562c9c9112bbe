"""The field's draft-state failures, reproduced in an in-process vLLM engine for the tests.

kvpack always saves and restores a speculative decoder's draft state; to show that a suite
can see it lost, these wrap the worker's own copies (`kvpack.vllm_plugin.worker` looks them
up per step) for as long as the given monkeypatch context lasts:

- `without_draft_saves`: saves skip the sidecar ``draft`` member (target KV stored, draft lost);
- `without_draft_loads`: a load restores the target only, every loaded block's draft layers
  left as they were (a PACKED object's trailing draft bytes are read but not kept).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

pytest.importorskip("vllm")

import kvpack.vllm_plugin.worker as worker  # noqa: E402
from kvpack import PlannedLoad  # noqa: E402
from kvpack.transfers import Lane, Staging  # noqa: E402
from kvpack.vllm_plugin.loads import BlockLoads  # noqa: E402
from kvpack.vllm_plugin.metadata import NO_BLOCK, TransferJob  # noqa: E402
from kvpack.vllm_plugin.registration import MemberLayout  # noqa: E402
from kvpack.vllm_plugin.saves import gather_members, save_bytes  # noqa: E402


def _target_only(slots: Sequence[MemberLayout]) -> list[MemberLayout]:
    return [s for s in slots if not s.draft]


def without_draft_saves(mp: pytest.MonkeyPatch) -> None:
    """From now on (in `mp`'s context) saves write every member but the sidecar draft."""
    mp.setattr(worker, "gather_members", lambda staging, slots, job: gather_members(staging, _target_only(slots), job))
    mp.setattr(worker, "save_bytes", lambda slots, job: save_bytes(_target_only(slots), job))


@dataclasses.dataclass(frozen=True, eq=False)
class _DraftKeptLoads(BlockLoads):
    """`BlockLoads` whose scatter puts every loaded block's draft layers back as they were."""

    def plan(self, job: TransferJob, staging: Staging) -> PlannedLoad:
        planned = super().plan(job, staging)
        draft = self.layout.draft
        if draft is None:
            return planned

        def scatter(good: Sequence[bool], lent: Sequence[memoryview | None], lane: Lane) -> int:
            ids = [ref.block_ids[0] for ref, ok in zip(job.blocks, good) if ok and ref.block_ids[0] != NO_BLOCK]
            kept = torch.empty((len(ids), draft.slot_bytes), dtype=torch.uint8, device=draft.runs[0].device)
            if ids:
                draft.gather(ids, kept, lane)  # on the load lane, before the scatter it undoes
            in_place = planned.scatter(good, lent, lane)
            if ids:
                draft.scatter(ids, kept, lane)
            return in_place

        return dataclasses.replace(planned, scatter=scatter)


def without_draft_loads(mp: pytest.MonkeyPatch) -> None:
    """From now on (in `mp`'s context) a load leaves the loaded blocks' draft layers untouched."""
    mp.setattr(worker, "BlockLoads", _DraftKeptLoads)
