"""Staging rows, side streams and events: the one path both adapters copy KV through.

An adapter hands the core the rows to copy; this module decides where they live and
when the host may touch them. The device behind it is a seam (`StagingDevice`):

- `CpuDevice` (a cache on the CPU): plain host tensors, launches run inline, events
  are already complete. Zero-copy and synchronous exactly as before this module.
- `CudaDevice` (a cache on a CUDA GPU): pinned host rows taken from the process's
  one bounded pool (`kvpack.transfers.staging_pool`) and given back after their event, one
  side stream per direction (save = device to host, load = host to device) that
  waits on the compute stream before each launch, a CUDA event recorded after it;
  host memory registered with CUDA (`register_host`: the host store's mapping,
  `kvpack.transfers.host_registration`) that a load copies from in place (`reads_in_place`).
- ``tests/fixtures/recording_device.py``: a test double that runs launches only
  when their event is waited on (as a GPU would, later) and logs every operation.

Invariants (the tests check each with the recording device):

1. A launch on a side stream is preceded by that stream waiting on the compute
   stream (the forward that wrote, or will read, the blocks): `Lane` does it.
2. After a save's gather is launched, the compute stream waits on the gather's
   event (`StagingDevice.order_compute`): no forward queued after the save can
   rewrite a block the gather still reads, whenever the engine frees that block.
3. The host reads gathered rows only after the gather's event completed:
   `Staged.host_rows` waits first.
4. A load is reported done (or failed) only after its scatter's event completed:
   the transfer runner waits on `Staged` before it reports the load.
5. Staging (rows and the lane's scratch) is released, and so may be reused, only
   after its event completed: `Staged.release` waits first.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import numpy as np
import torch

from .host_registration import RegisteredRanges, Registration, register_with_cuda, unregister_with_cuda
from .staging_pool import PinnedPool

log = logging.getLogger(__name__)


class Direction(str, Enum):
    """Which side stream: a save copies device -> host, a load host -> device."""

    SAVE = "save"
    LOAD = "load"


class StagingDevice(Protocol):
    """The device seam. `host_rows` are what the store reads and writes (pinned for a
    GPU), `device_rows` scratch on the cache's device (intermediate parts).
    `launch(direction, fn)` runs `fn` as work on that direction's side stream, whose
    handle `stream(direction)` gives to kvpack.ops (None: the current stream).
    `order_compute(event)` makes work queued on the compute stream from now on wait
    for `event`. `released(tensors, event)` gives rows back once `event` completed
    (None: no launch used them)."""

    kind: str

    def host_rows(self, rows: int, width: int) -> torch.Tensor: ...

    def device_rows(self, rows: int, width: int) -> torch.Tensor: ...

    def stream(self, direction: Direction) -> Any: ...

    def wait_compute(self, direction: Direction) -> None: ...

    def launch(self, direction: Direction, fn: Callable[[], object]) -> None: ...

    def record(self, direction: Direction) -> Any: ...

    def order_compute(self, event: Any) -> None: ...

    def synchronize(self, event: Any) -> None: ...

    def query(self, event: Any) -> bool: ...

    def released(self, tensors: list[torch.Tensor], event: Any) -> None: ...

    def register_host(self, address: int, nbytes: int) -> bool:
        """Let copies read ``[address, address + nbytes)`` of host memory in place from now on
        (`reads_in_place`); False where the device cannot (nothing changed)."""
        ...

    def reads_in_place(self, address: int, nbytes: int) -> bool:
        """Whether a copy to the cache reads these host bytes where they lie (a CPU cache: any
        host memory; a GPU: pinned or registered memory), instead of from a staging row."""
        ...

    def unregister_host(self) -> None:
        """Undo `register_host` (before the memory is unmapped)."""
        ...

    @property
    def reads_host_in_place(self) -> bool:
        """Whether any host memory besides staging rows is read in place (`reads_in_place`): a
        load then asks the tiers to lend their payloads instead of copying them into rows."""
        ...


class CpuDevice:
    """A CPU cache: no streams, no events, plain host memory (the copy is done when
    `launch` returns). `scratch_on` is where `device_rows` lives: the cache's device, so an
    inline lane (`inline_lane`) over a GPU cache stages its intermediate parts on the GPU,
    on the current stream, whose caching allocator orders their reuse."""

    kind = "cpu"

    def __init__(self, scratch_on: torch.device | None = None) -> None:
        self.scratch_on = scratch_on if scratch_on is not None else torch.device("cpu")

    def host_rows(self, rows: int, width: int) -> torch.Tensor:
        return torch.empty((rows, width), dtype=torch.uint8)

    def device_rows(self, rows: int, width: int) -> torch.Tensor:
        return torch.empty((rows, width), dtype=torch.uint8, device=self.scratch_on)

    def stream(self, direction: Direction) -> None:
        return None

    def wait_compute(self, direction: Direction) -> None:
        return None

    def launch(self, direction: Direction, fn: Callable[[], object]) -> None:
        fn()

    def record(self, direction: Direction) -> None:
        return None

    def order_compute(self, event: Any) -> None:
        return None  # the copy finished inside `launch`

    def synchronize(self, event: Any) -> None:
        return None

    def query(self, event: Any) -> bool:
        return True

    def released(self, tensors: list[torch.Tensor], event: Any) -> None:
        return None

    def register_host(self, address: int, nbytes: int) -> bool:
        return False  # a CPU cache reads any host memory already

    def reads_in_place(self, address: int, nbytes: int) -> bool:
        return True

    def unregister_host(self) -> None:
        return None

    @property
    def reads_host_in_place(self) -> bool:
        return True


class CudaDevice:
    """A cache on CUDA device `device`. The compute stream is the current stream of the
    thread that builds this object (the engine's model runner at registration), so a
    side stream waits on the forward's stream even from a kvpack thread."""

    kind = "cuda"

    def __init__(self, device: torch.device, pool: PinnedPool | None = None) -> None:
        """`pool`: where pinned rows come from (default: the process's one pool)."""
        self.device = device
        self.pool = pool if pool is not None else PinnedPool.shared()
        with torch.cuda.device(device):
            self.compute = torch.cuda.current_stream(device)
            self._streams = {d: torch.cuda.Stream(device) for d in Direction}
        self.registered = RegisteredRanges()
        """Host ranges registered with CUDA (`kvpack.transfers.host_registration`): read in place by loads."""
        self._owned: list[int] = []

    def host_rows(self, rows: int, width: int) -> torch.Tensor:
        """Pinned rows from the pool; `StagingFull` when its bound is reached."""
        return self.pool.take(rows * width)[: rows * width].view(rows, width)

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

    def order_compute(self, event: torch.cuda.Event) -> None:
        self.compute.wait_event(event)

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def query(self, event: torch.cuda.Event) -> bool:
        return bool(event.query())

    def released(self, tensors: list[torch.Tensor], event: Any) -> None:
        """Pool rows go back to the pool (the event completed before: `Staged.release`);
        device scratch goes back to torch's caching allocator when dropped."""
        for t in tensors:
            self.pool.give(t)

    def register_host(self, address: int, nbytes: int) -> bool:
        """``cudaHostRegister`` the range once (a warning and False where CUDA refuses it)."""
        if self.registered.covers(address, nbytes):
            return True
        outcome, code = register_with_cuda(address, nbytes, torch.cuda.cudart(), self.device)
        if outcome is Registration.REFUSED:
            log.warning(
                "kvpack: CUDA refused to register %d MiB of host memory (error %d): loads from it stage through "
                "pinned rows",
                nbytes >> 20,
                code,
            )
            return False
        if outcome is Registration.REGISTERED:
            self._owned.append(address)
        self.registered.add(address, nbytes)
        return True

    def reads_in_place(self, address: int, nbytes: int) -> bool:
        return self.registered.covers(address, nbytes)

    @property
    def reads_host_in_place(self) -> bool:
        """Only once something was registered: a lent memory-tier slot (pageable) would be
        copied into its pinned row anyway, inside the load's scatter."""
        return bool(self.registered)

    def unregister_host(self) -> None:
        """Unregister what `register_host` registered (synchronizes the device first: no copy
        may still read it)."""
        if not self.registered:  # what this device registered itself is part of it
            return
        torch.cuda.synchronize(self.device)
        for address in self._owned:
            unregister_with_cuda(address, torch.cuda.cudart(), self.device)
        self.registered.clear()
        self._owned = []


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
        """Host rows (pinned for a GPU cache) ``[rows, width]`` uint8. Give them back with
        `give_back` when no launch used them, else through the `Staged` of the launch."""
        return self.device.host_rows(rows, width)

    def give_back(self, rows: list[torch.Tensor]) -> None:
        """Rows from `rows` that no launch read or wrote (a load given up before its scatter)."""
        self.device.released(rows, None)

    def copy_rows(self, src: torch.Tensor, lane: Lane) -> torch.Tensor:
        """A host copy of host rows `src` (bytes already on the host: no launch is pending
        on them) into staging rows `lane` keeps until its event: for a selection or a
        column slice of loaded rows."""
        out = lane.keep(self.device.host_rows(int(src.shape[0]), int(src.shape[1])))
        out.copy_(src)
        return out

    def zeros(self, rows: int, width: int, lane: Lane) -> torch.Tensor:
        """Zeroed staging rows `lane` keeps until its event."""
        out = lane.keep(self.device.host_rows(rows, width))
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
                self._ended(direction, rows, lane).release()
                raise
            return self._ended(direction, rows, lane)

    def _ended(self, direction: Direction, rows: torch.Tensor, lane: Lane) -> Staged:
        """The lane's event; after a gather the compute stream waits on it (invariant 2)."""
        event = self.device.record(direction)
        if direction is Direction.SAVE:
            self.device.order_compute(event)
        return Staged(self.device, rows, event, lane.kept)


def inline_lane(direction: Direction, device: torch.device) -> Lane:
    """A lane that runs launches inline on the current stream, with no event, its scratch on
    the cache's `device` (callers that pass none: CPU caches, tests, tools that synchronize
    themselves). A GPU copy kernel refuses unpinned host scratch, so the scratch follows
    the cache, never the host."""
    return Lane(CpuDevice(device), direction)
