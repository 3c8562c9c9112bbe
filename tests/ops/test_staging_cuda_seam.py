"""`kvpack.transfers.staging.CudaDevice` against a fake ``torch.cuda`` (streams and events that log
what is done to them): pinned host rows, one side stream per direction that waits on the
compute stream captured at construction, launches under that stream, an event recorded
on it and waited on. What a GPU adds (real asynchrony) is scripts/gpu_check.sh's job."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvpack.transfers.staging import CudaDevice, Direction, Staging

LOG: list[tuple[str, ...]] = []


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other: FakeStream) -> None:
        LOG.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        LOG.append(("wait_event", self.name, event.stream))


class FakeEvent:
    stream = ""

    def record(self, stream: FakeStream) -> None:
        self.stream = stream.name
        LOG.append(("record", stream.name))

    def synchronize(self) -> None:
        LOG.append(("event_sync",))

    def query(self) -> bool:
        return True


@pytest.fixture()
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    LOG.clear()
    names = iter(["side-a", "side-b"])
    current: list[FakeStream] = [FakeStream("compute")]

    @contextlib.contextmanager
    def on_stream(s: FakeStream) -> Iterator[None]:
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    real_empty = torch.empty

    def empty(*shape: Any, **kw: Any) -> torch.Tensor:
        if kw.pop("pin_memory", False):
            LOG.append(("pinned",))
        if str(kw.get("device", "cpu")).startswith("cuda"):
            LOG.append(("device_alloc",))
            kw.pop("device")
        return real_empty(*shape, **kw)

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: current[-1])
    monkeypatch.setattr(torch.cuda, "Stream", lambda d=None: FakeStream(next(names)))
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch, "empty", empty)


def test_cuda_device_orders_a_gather_after_compute_and_reads_after_its_event(fake_cuda: None) -> None:
    dev = CudaDevice(torch.device("cuda:0"))
    staging = Staging(dev)
    seen: list[str] = []

    def gather(rows: torch.Tensor, lane: Any) -> None:
        lane.launch(lambda: seen.append(torch.cuda.current_stream().name))
        rows.fill_(7)

    staged = staging.gather(2, 8, gather)
    assert LOG[0] == ("pinned",)
    side = dev.stream(Direction.SAVE).name
    assert LOG[1] == ("wait_stream", side, "compute")
    assert seen == [side]  # the launch ran with the side stream current
    assert LOG[2] == ("record", side)
    assert LOG[3] == ("wait_event", "compute", side)  # no later forward rewrites what the gather reads
    assert bool((torch.from_numpy(staged.host_rows()) == 7).all())
    assert LOG[4] == ("event_sync",)
    assert dev.stream(Direction.LOAD).name != side


def test_cuda_device_scratch_is_on_the_device_and_a_load_waits_on_compute(fake_cuda: None) -> None:
    dev = CudaDevice(torch.device("cuda:0"))
    staging = Staging(dev)
    rows = staging.rows(1, 4)
    loaded = staging.scatter(rows, lambda r, lane: lane.scratch(1, 4))
    loaded.release()
    load = dev.stream(Direction.LOAD).name
    assert LOG == [("pinned",), ("wait_stream", load, "compute"), ("device_alloc",), ("record", load), ("event_sync",)]
