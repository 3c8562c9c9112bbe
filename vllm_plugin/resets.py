"""vLLM's reset of external caches, between the scheduler and its workers (`PendingReset`).

vLLM calls ``reset_cache`` on the scheduler-side connector (the engine-core process), while each
worker's memory tier lives in the worker's process. The scheduler applies the core's reset rule
(`kvpack.Session.reset`) to the tiers it reaches, then hands the scope to the workers in the next
step's connector metadata; until that step no hit is planned, and each worker applies it before
that step's loads (`WorkerSide.start_step`).
"""

from __future__ import annotations

from collections.abc import Callable

from kvpack import ClearScope, Session


class PendingReset:
    """A reset applied on the scheduler side, waiting for the next step's metadata."""

    def __init__(self, session: Session, on_reset: Callable[[], None]) -> None:
        """`on_reset`: what the scheduler forgets when a reset applies (its memoised plans)."""
        self._session = session
        self._on_reset = on_reset
        self.scope: ClearScope | None = None
        """The scope not yet handed to the workers (None: none pending): no hit is planned meanwhile."""

    def apply(self) -> bool | None:
        """vLLM's ``reset_cache``: True when every tier in scope removed what it names, False when a
        tier failed, None when ``reset.scope`` is off: kvpack takes no part in resets, which vLLM
        counts as done (as for a connector without a cache), so its own cascades (a weight update,
        ``pause_generation(clear_cache=True)``) go on; False would make them raise."""
        report = self._session.reset("vLLM reset_cache")
        if report is None:
            return None
        self.scope = report.scope
        self._on_reset()
        return report.ok

    def take(self) -> ClearScope | None:
        """The pending scope, for this step's metadata (then none is pending)."""
        scope, self.scope = self.scope, None
        return scope
