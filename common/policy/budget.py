"""How long the engine-facing calls of one engine step may wait on remote tiers.

Every remote call is bounded on its own (Mooncake's `timeout_ms`), but one
scheduler step makes many: a lookup per new request, save planning per
finished request. A tier that answers each call just inside its bound, or one
whose calls queue behind stuck ones, would still stall the step by the sum.
A `WaitBudget` bounds the sum: the step's first store call starts the clock;
once `seconds` have passed, `KVStore` skips every tier marked
``Tier.remote`` (answering "not stored", so the engine recomputes) until the
engine's next step renews the budget. Local tiers (memory, disk) are always
asked. The longest a step waits on storage is therefore `seconds` plus one
remote call already running when the budget ran out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class WaitBudget:
    """One engine step's allowance for waiting on remote tiers (seconds, monotonic clock).

    Used from one thread (the engine's scheduler); `renew()` once per step."""

    seconds: float
    _deadline: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.seconds <= 0:
            raise ValueError(f"WaitBudget.seconds must be > 0, got {self.seconds}")

    def renew(self) -> None:
        """A new step: the clock starts again at the next call."""
        self._deadline = None

    def start(self) -> None:
        """Start the clock if this step has not yet (idempotent within a step)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.seconds

    @property
    def spent(self) -> bool:
        """True once the step's allowance is used up (never before `start`)."""
        return self._deadline is not None and time.monotonic() >= self._deadline
