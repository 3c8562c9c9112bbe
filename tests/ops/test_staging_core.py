"""`kvpack.transfers.staging.Staging` with the recording device: a batch that fails after launching
still waits for what it launched before its rows go; the CPU device is inline and zero-copy."""

from __future__ import annotations

import pytest
import torch

from fixtures.recording_device import RecordingDevice
from kvpack.transfers.staging import CpuDevice, Direction, Lane, Staging, inline_lane


def test_a_failed_batch_frees_its_rows_only_after_what_it_launched() -> None:
    dev = RecordingDevice()
    ran: list[int] = []

    def half(rows: torch.Tensor, lane: Lane) -> None:
        lane.launch(lambda: ran.append(1))
        raise RuntimeError("second member failed")

    with pytest.raises(RuntimeError):
        Staging(dev).gather(1, 8, half)
    assert ran == [1]
    assert [op[0] for op in dev.ops][-5:] == ["record", "order_compute", "sync", "run", "release"]
    assert dev.violations == []


def test_the_cpu_device_copies_inline_into_plain_host_rows() -> None:
    staging = Staging(CpuDevice())
    src = torch.arange(16, dtype=torch.uint8).view(2, 8)
    staged = staging.gather(2, 8, lambda rows, lane: lane.launch(lambda: rows.copy_(src)))
    assert torch.equal(staged.rows, src)  # done when gather returns: no event to wait for
    assert not staged.rows.is_pinned()
    assert staged.host_rows().ctypes.data == staged.rows.data_ptr()  # zero-copy
    with staging.lane(Direction.LOAD) as lane:
        assert lane.stream is None


def test_an_inline_lane_keeps_its_scratch_on_the_cache_device() -> None:
    """A layout copied with no lane (tests, tools) over a GPU cache stages its parts on the
    GPU: the CUDA copy kernel refuses unpinned host scratch (found by the GPU check)."""
    lane = inline_lane(Direction.SAVE, torch.device("meta"))
    assert lane.scratch(3, 8).device == torch.device("meta")
    assert lane.stream is None
    assert inline_lane(Direction.LOAD, torch.device("cpu")).scratch(1, 4).device == torch.device("cpu")
