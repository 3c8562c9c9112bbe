"""`RecordingDevice`: a test double of `kvpack.staging.StagingDevice` that behaves like a
GPU where it matters for ordering, on the CPU.

- The compute stream has queued work (`queue_compute`: the forward writing blocks);
  it runs when a side stream waits on the compute stream (`wait_compute`), so a
  gather launched without that wait reads the blocks as they were before.
- A launch on a side stream is deferred: it runs when the event recorded after it is
  synchronized or queried complete, so the host reading rows before the event sees
  what they held before (the rows' allocation is filled with a poison byte).
- Rows released before their event completed are a violation (logged and counted).
- Host rows are "pinned" (flagged in `pinned_ptrs`); `ops` lists every operation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .staging import Direction

POISON = 0xA5
"""Byte every fresh staging row holds until a launch writes it."""


@dataclass
class FakeEvent:
    direction: Direction
    pending: list[Callable[[], object]]
    done: bool = False


@dataclass
class RecordingDevice:
    """See the module docstring. `ops` entries: ``("host_rows", rows, width)``,
    ``("device_rows", ...)``, ``("wait_compute", dir)``, ``("launch", dir)``, ``("run", dir)``,
    ``("record", dir)``, ``("sync", dir)``, ``("release", dir)``."""

    kind: str = "fake"
    ops: list[tuple[object, ...]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    pinned_ptrs: set[int] = field(default_factory=set)
    compute_queue: list[Callable[[], object]] = field(default_factory=list)
    _queues: dict[Direction, list[Callable[[], object]]] = field(default_factory=dict)

    def queue_compute(self, fn: Callable[[], object]) -> None:
        """Work of the forward not yet run (it runs when a side stream waits on compute)."""
        self.compute_queue.append(fn)

    def host_rows(self, rows: int, width: int) -> torch.Tensor:
        self.ops.append(("host_rows", rows, width))
        t = torch.full((rows, width), POISON, dtype=torch.uint8)
        self.pinned_ptrs.add(t.data_ptr())
        return t

    def device_rows(self, rows: int, width: int) -> torch.Tensor:
        self.ops.append(("device_rows", rows, width))
        return torch.full((rows, width), POISON, dtype=torch.uint8)

    def stream(self, direction: Direction) -> None:
        return None

    def wait_compute(self, direction: Direction) -> None:
        self.ops.append(("wait_compute", direction))
        queued, self.compute_queue = self.compute_queue, []
        for fn in queued:
            fn()

    def launch(self, direction: Direction, fn: Callable[[], object]) -> None:
        self.ops.append(("launch", direction))
        self._queues.setdefault(direction, []).append(fn)

    def record(self, direction: Direction) -> FakeEvent:
        self.ops.append(("record", direction))
        pending, self._queues[direction] = self._queues.get(direction, []), []
        return FakeEvent(direction, pending)

    def _complete(self, event: FakeEvent) -> None:
        if not event.done:
            for fn in event.pending:
                self.ops.append(("run", event.direction))
                fn()
            event.done = True

    def synchronize(self, event: FakeEvent) -> None:
        self.ops.append(("sync", event.direction))
        self._complete(event)

    def query(self, event: FakeEvent) -> bool:
        return event.done

    def released(self, tensors: list[torch.Tensor], event: FakeEvent) -> None:
        self.ops.append(("release", event.direction))
        if not event.done:
            self.violations.append(f"released {len(tensors)} tensors before their {event.direction.value} event")

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether `t` is (a view starting at) rows this device handed out."""
        return t.data_ptr() in self.pinned_ptrs

    def unlaunched(self) -> int:
        """Launches queued and never recorded (a launch outside a lane's event)."""
        return sum(len(q) for q in self._queues.values())
