"""Every adapter copy path through `kvpack.transfers.staging`, proven on the CPU with the recording
device (`kvpack.staging_record.RecordingDevice`), which defers launches until their event
is waited on and runs the compute stream's queued work only when a side stream waits on it.

What a GPU cache needs and these tests check on each path (block layouts of one run,
several runs: hybrids and draft models, canonical objects):
(a) the copies read and write the device's staging rows (pinned on a GPU), and device
    scratch for intermediate parts, never a plain host tensor of their own;
(b) the host never sees the rows before the event (they still hold the poison byte);
(c) nothing is released before its event;
(d) the side stream waits on the compute stream before a gather (the forward's write is in).
"""

from __future__ import annotations

import torch

from fixtures.recording_device import POISON, RecordingDevice
from kvpack.canonical import paged_geometry
from kvpack.identity.heads import HeadRange
from kvpack.ops import PagedKV
from kvpack.transfers.staging import Direction, Staging
from kvpack.vllm_plugin.blocks import BlockLayout
from kvpack.vllm_plugin.canonical_blocks import CanonicalBlocks

NB, BS = 6, 4


def _flash(heads: int, dim: int) -> torch.Tensor:
    """A vLLM GPU flash-attention layer ``[2, blocks, block_size, heads, dim]``, here on the CPU."""
    return torch.randn((2, NB, BS, heads, dim), dtype=torch.float16)


def _order(dev: RecordingDevice, direction: Direction) -> list[str]:
    return [str(op[0]) for op in dev.ops if len(op) > 1 and op[1] == direction]


def _check_round_trip(copier: BlockLayout | CanonicalBlocks, writes: torch.Tensor, block: int) -> None:
    dev = RecordingDevice()
    staging = Staging(dev)
    reference = Staging.for_tensor(writes)  # the CPU's inline path
    fresh = torch.randn(writes[:, block].shape, dtype=writes.dtype)
    dev.queue_compute(lambda: writes[:, block].copy_(fresh))  # the forward's write, still queued
    ids = [block, 1]
    staged = staging.gather(len(ids), copier.slot_bytes, lambda rows, lane: copier.gather(ids, rows, lane))
    assert dev.is_pinned(staged.rows)  # (a)
    assert bool((staged.rows == POISON).all())  # (b): no launch has run before the event
    assert torch.equal(writes[:, block], fresh)  # (d): the side stream waited on compute first
    got = torch.from_numpy(staged.host_rows().copy())
    want = reference.gather(len(ids), copier.slot_bytes, lambda rows, lane: copier.gather(ids, rows, lane)).rows
    assert torch.equal(got, want)
    staged.release()
    save_ops = _order(dev, Direction.SAVE)
    assert save_ops[:2] == ["wait_compute", "launch"]
    assert save_ops.index("record") < save_ops.index("sync") < save_ops.index("run") < save_ops.index("release")

    rows = staging.rows(len(ids), copier.slot_bytes)
    rows.copy_(want)
    before = writes.clone()
    writes[:, 0].zero_()
    writes[:, 2].zero_()
    loaded = staging.scatter(rows, lambda r, lane: copier.scatter([0, 2], r, lane))
    assert torch.equal(writes[:, 0], torch.zeros_like(writes[:, 0]))  # not yet: its event has not completed
    loaded.release()
    assert torch.equal(writes[:, 0], before[:, block]) and torch.equal(writes[:, 2], before[:, 1])
    assert dev.violations == [] and dev.unlaunched() == 0  # (c)
    load_ops = _order(dev, Direction.LOAD)
    assert load_ops.index("wait_compute") < load_ops.index("launch") < load_ops.index("record")
    assert load_ops.index("sync") < load_ops.index("release")


def test_one_run_of_block_layouts_copies_on_the_lane_through_device_staging() -> None:
    k = _flash(2, 16)
    layers = [k, _flash(2, 16)]
    _check_round_trip(BlockLayout.from_tensors(layers, NB), k, 3)


def test_several_runs_hybrid_or_draft_layers_use_device_scratch_on_the_lane() -> None:
    target, draft = _flash(2, 16), _flash(1, 8)  # a drafter (or another group) with other head counts
    layout = BlockLayout.from_tensors([target, draft], NB)
    assert len(layout.runs) == 2
    _check_round_trip(layout, draft, 4)
    dev = RecordingDevice()
    Staging(dev).gather(1, layout.slot_bytes, lambda rows, lane: layout.gather([0], rows, lane)).release()
    assert sum(1 for op in dev.ops if op[0] == "device_rows") == 2  # one scratch part per run


def test_canonical_objects_copy_on_the_lane_through_device_staging() -> None:
    cache = _flash(2, 16)
    geometry = paged_geometry(PagedKV.from_layers([cache]))
    blocks = CanonicalBlocks(geometry, HeadRange(0, 2), NB)
    _check_round_trip(blocks, cache, 5)


def test_canonical_scatter_of_another_head_range_waits_for_its_event() -> None:
    cache = _flash(2, 16)
    blocks = CanonicalBlocks(paged_geometry(PagedKV.from_layers([cache])), HeadRange(0, 2), NB)
    staging = Staging(RecordingDevice())
    stored = HeadRange(0, 4)  # a writer at TP 1 of a 4-head model; this rank holds heads 0-1
    rows = staging.rows(1, geometry_bytes := blocks.object_bytes(stored))
    rows.copy_(torch.randint(0, 256, (1, geometry_bytes), dtype=torch.uint8))
    before = cache.clone()
    loaded = staging.scatter(rows, lambda r, lane: blocks.scatter_from([2], r, stored, HeadRange(0, 2), lane))
    assert torch.equal(cache, before)
    loaded.release()
    assert not torch.equal(cache[:, 2], before[:, 2]) and torch.equal(cache[:, 3], before[:, 3])
