"""Staging rows, side streams and events: the one path both adapters copy KV through.

An adapter hands the core the rows to copy; this module decides where they live and
when the host may touch them. The device behind it is a seam (`StagingDevice`):

- `CpuDevice` (a cache on the CPU): plain host tensors, launches run inline, events
  are already complete. Zero-copy and synchronous exactly as before this module.
- `CudaDevice` (a cache on a CUDA GPU): pinned host rows (torch's pinned caching
  allocator), one side stream per direction (save = device to host, load = host to
  device) that waits on the compute stream before each launch, a CUDA event
  recorded after it.
- `kvpack.staging_record.RecordingDevice`: a test double that runs launches only
  when their event is waited on (as a GPU would, later) and logs every operation.

Invariants the callers keep (and the tests check with the recording device):

1. A launch on a side stream is preceded by that stream waiting on the compute
   stream (the forward that wrote, or will read, the blocks): `Lane` does it.
2. The host reads gathered rows only after the gather's event completed:
   `Staged.host_rows` waits first.
3. A load is reported done only after its scatter's event completed: the adapter
   calls `Staged.wait` before it sets its done flag.
4. Staging (rows and the lane's scratch) is released, and so may be reused, only
   after its event completed: `Staged.release` waits first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import numpy as np
import torch


class Direction(str, Enum):
    """Which side stream: a save copies device -> host, a load host -> device."""

    SAVE = "save"
    LOAD = "load"


class StagingDevice(Protocol):
    """The device seam. `host_rows` are what the store reads and writes (pinned for a
    GPU), `device_rows` scratch on the cache's device (intermediate parts).
    `launch(direction, fn)` runs `fn` as work on that direction's side stream, whose
    handle `stream(direction)` gives to kvpack.ops (None: the current stream)."""

    kind: str

    def host_rows(self, rows: int, width: int) -> torch.Tensor: ...

    def device_rows(self, rows: int, width: int) -> torch.Tensor: ...

    def stream(self, direction: Direction) -> Any: ...

    def wait_compute(self, direction: Direction) -> None: ...

    def launch(self, direction: Direction, fn: Callable[[], object]) -> None: ...

    def record(self, direction: Direction) -> Any: ...

    def synchronize(self, event: Any) -> None: ...

    def query(self, event: Any) -> bool: ...

    def released(self, tensors: list[torch.Tensor], event: Any) -> None: ...


class CpuDevice:
    """A CPU cache: no streams, no events, plain host memory (the copy is done when
    `launch` returns)."""

    kind = "cpu"

    def host_rows(self, rows: int, width: int) -> torch.Tensor:
        return torch.empty((rows, width), dtype=torch.uint8)

    def device_rows(self, rows: int, width: int) -> torch.Tensor:
        return torch.empty((rows, width), dtype=torch.uint8)

    def stream(self, direction: Direction) -> None:
        return None

    def wait_compute(self, direction: Direction) -> None:
        return None

    def launch(self, direction: Direction, fn: Callable[[], object]) -> None:
        fn()

    def record(self, direction: Direction) -> None:
        return None

    def synchronize(self, event: Any) -> None:
        return None

    def query(self, event: Any) -> bool:
        return True

    def released(self, tensors: list[torch.Tensor], event: Any) -> None:
        return None


class CudaDevice:
    """A cache on CUDA device `device`. The compute stream is the current stream of the
    thread that builds this object (the engine's model runner at registration), so a
    side stream waits on the forward's stream even from a kvpack thread."""

    kind = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.compute = torch.cuda.current_stream(device)
            self._streams = {d: torch.cuda.Stream(device) for d in Direction}

    def host_rows(self, rows: int, width: int) -> torch.Tensor:
        return torch.empty((rows, width), dtype=torch.uint8, pin_memory=True)

    def device_rows(self, rows: int, width: int) -> torch.Tensor:
        return torch.empty((rows, width), dtype=torch.uint8, device=self.device)

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        return self._streams[direction]

    def wait_compute(self, direction: Direction) -> None:
        self._streams[direction].wait_stream(self.compute)

    def launch(self, direction: Direction, fn: Callable[[], object]) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self._streams[direction]):
            fn()

    def record(self, direction: Direction) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self._streams[direction])
        return event

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def query(self, event: torch.cuda.Event) -> bool:
        return bool(event.query())

    def released(self, tensors: list[torch.Tensor], event: Any) -> None:
        return None  # torch's caching allocators reuse them; the event completed before


def device_for(device: torch.device) -> StagingDevice:
    """The seam for a cache on `device`: CUDA for a GPU, else the CPU's no-op one."""
    if device.type == "cuda":
        return CudaDevice(device)
    return CpuDevice()


@dataclass
class Lane:
    """One batch of launches on a direction's side stream, ended by one event.

    `launch` queues work (the side stream has already waited on the compute stream);
    `scratch` gives device rows kept alive until the batch's event completed."""

    device: StagingDevice
    direction: Direction
    kept: list[torch.Tensor] = field(default_factory=list)

    @property
    def stream(self) -> Any:
        """The stream handle for kvpack.ops' ``stream=`` (None on the CPU)."""
        return self.device.stream(self.direction)

    def launch(self, fn: Callable[[], object]) -> None:
        self.device.launch(self.direction, fn)

    def scratch(self, rows: int, width: int) -> torch.Tensor:
        t = self.device.device_rows(rows, width)
        self.kept.append(t)
        return t

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """Keep `tensor` (read or written by a queued launch) alive until the event."""
        self.kept.append(tensor)
        return tensor


@dataclass
class Staged:
    """Rows handed to (or filled by) launches, and the event that ends them."""

    device: StagingDevice
    rows: torch.Tensor
    event: Any
    kept: list[torch.Tensor]
    done: bool = False

    def wait(self) -> None:
        """Block until the launches completed (a no-op on the CPU)."""
        if not self.done:
            self.device.synchronize(self.event)
            self.done = True

    def host_rows(self) -> np.ndarray:
        """The rows as numpy, readable by the host: waits for the event first."""
        self.wait()
        return self.rows.numpy()

    def release(self) -> None:
        """Give the rows and scratch back (after the event: never before)."""
        self.wait()
        self.device.released([self.rows, *self.kept], self.event)
        self.kept = []


class Staging:
    """The adapters' entry point: rows to fill or read, and gathers/scatters on a lane.

    gather: ``staged = staging.gather(n, width, lambda rows, lane: layout.gather(ids, rows, lane))``
    then, on the thread that stores them, ``staged.host_rows()`` and ``staged.release()``.
    scatter: ``rows = staging.rows(n, width)`` (the store fills them), then
    ``staging.scatter(rows, lambda rows, lane: layout.scatter(ids, rows, lane)).release()``
    before the load is reported done."""

    def __init__(self, device: StagingDevice) -> None:
        self.device = device

    @classmethod
    def for_tensor(cls, tensor: torch.Tensor) -> Staging:
        return cls(device_for(tensor.device))

    def rows(self, rows: int, width: int) -> torch.Tensor:
        """Host rows (pinned for a GPU cache) ``[rows, width]`` uint8."""
        return self.device.host_rows(rows, width)

    def copy_rows(self, src: torch.Tensor) -> torch.Tensor:
        """A host copy of host rows `src` (bytes already on the host: no launch is pending
        on them) into fresh staging rows: for a selection or a column slice of loaded rows."""
        out = self.device.host_rows(int(src.shape[0]), int(src.shape[1]))
        out.copy_(src)
        return out

    def zeros(self, rows: int, width: int) -> torch.Tensor:
        out = self.device.host_rows(rows, width)
        out.zero_()
        return out

    @contextlib.contextmanager
    def lane(self, direction: Direction) -> Iterator[Lane]:
        self.device.wait_compute(direction)
        yield Lane(self.device, direction)

    def gather(self, rows: int, width: int, fn: Callable[[torch.Tensor, Lane], None]) -> Staged:
        """Fresh host rows filled by `fn` on the save lane; read them through the result."""
        return self._batch(Direction.SAVE, self.device.host_rows(rows, width), fn)

    def scatter(self, rows: torch.Tensor, fn: Callable[[torch.Tensor, Lane], None]) -> Staged:
        """Host rows `rows` copied by `fn` on the load lane; wait or release the result
        before reporting the load done or reusing `rows`."""
        return self._batch(Direction.LOAD, rows, fn)

    def _batch(self, direction: Direction, rows: torch.Tensor, fn: Callable[[torch.Tensor, Lane], None]) -> Staged:
        with self.lane(direction) as lane:
            try:
                fn(rows, lane)
            except BaseException:
                # what was launched before the failure still runs: free nothing before it ends
                Staged(self.device, rows, self.device.record(direction), lane.kept).release()
                raise
            return Staged(self.device, rows, self.device.record(direction), lane.kept)


def cpu_lane(direction: Direction) -> Lane:
    """A lane that runs launches inline on the current stream, with no event (callers that
    pass none: CPU caches, tests, tools that synchronize themselves)."""
    return Lane(CpuDevice(), direction)
