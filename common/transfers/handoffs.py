"""Loads that wait for objects another instance is still storing (a prefill instance's
handoff), all on one thread of their own.

A decode instance's load of a handoff may reach the store before the prefill instance's
objects do; it waits for them, at most its ``handoff_wait_ms`` from its submission. The
waits run here, together, not on the runner's load thread: a handoff whose objects never
land (its prefill instance died, or stored elsewhere) holds up no other load. Before, the
load thread waited for it, and every load queued behind it waited too, past its own
``io_timeout_ms``, and was recomputed.

Each look asks every tier about the missing objects of all waiting loads at once; the
pause between looks doubles from `POLL_FIRST_S` to `POLL_MAX_S` (a quick landing is seen
within milliseconds; a long wait costs little CPU on a machine the storing process
shares) and starts again at `POLL_FIRST_S` when a load joins. A load is handed on (to the
load thread, `ready`) once all its objects are there, or its wait ran out (what is missing
then is a miss: the engine recomputes it); a load cancelled meanwhile is ended at once
(`ended`), having read nothing, and one still waiting when the runner closes is ended failed
(its blocks are never reported loaded).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..identity.keys import StoreKey
from ..observe.metrics import Metrics
from ..session import Session
from .jobs import LoadTask, PlannedLoad

log = logging.getLogger("kvpack.transfers")

POLL_FIRST_S = 0.005
"""First pause between two looks at the tiers (seconds)."""
POLL_MAX_S = 0.1
"""Longest pause: each pause doubles the last, up to this (seconds)."""


@dataclass(eq=False)
class _Waiting:
    """One load while it waits (its plan's staging rows held: ``task.plan``): the keys not yet found."""

    task: LoadTask
    missing: list[StoreKey]
    total: int
    deadline: float


@dataclass(eq=False)
class HandoffWaits:
    """See the module docstring. The runner's parts, all called on this thread: `plan(task)`
    plans a load as the load thread would (staging rows; raises when it cannot, counted);
    `ready(task)` hands one on to be read and scattered (``task.plan`` set); `ended(task,
    error)` ends one that never reaches the load thread: failed with `error` (its blocks
    recomputed), or, with None, cancelled (already reported failed)."""

    session: Session
    metrics: Metrics
    plan: Callable[[LoadTask], PlannedLoad]
    ready: Callable[[LoadTask], None]
    ended: Callable[[LoadTask, Exception | None], None]
    _arrived: list[LoadTask] = field(default_factory=list)
    _waiting: list[_Waiting] = field(default_factory=list)
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _closed: bool = False
    _thread: threading.Thread | None = None

    def start(self) -> HandoffWaits:
        self._thread = threading.Thread(target=self._loop, name="kvpack-handoff", daemon=True)
        self._thread.start()
        return self

    def add(self, task: LoadTask) -> None:
        """Wait for `task`'s objects (its job's ``handoff_wait_s`` from ``task.started``). Never blocks."""
        with self._changed:
            self._arrived.append(task)
            self._changed.notify()

    def close(self, timeout_s: float) -> None:
        """Stop waiting (at most `timeout_s` for the thread): loads still here are ended failed."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        pause = POLL_FIRST_S
        while True:
            with self._changed:
                if not self._closed and not self._arrived:
                    self._changed.wait(pause if self._waiting else None)
                arrived, self._arrived = self._arrived, []
                closed = self._closed
            if closed:
                for task in [w.task for w in self._waiting] + arrived:
                    self.ended(task, None if task.cancelled else RuntimeError("kvpack is shutting down"))
                return
            if arrived:
                pause = POLL_FIRST_S
                for task in arrived:
                    self._start_waiting(task)
            self._look()
            pause = min(2 * pause, POLL_MAX_S)

    def _start_waiting(self, task: LoadTask) -> None:
        """Plan a load that just arrived and note the keys it reads."""
        job = task.job
        try:
            task.plan = self.plan(task)
            keys = [it.key for it in self.session.reads(job.tenant, task.plan.reads)]
        except Exception as exc:  # a load that cannot be planned is a recompute, never an engine error
            self.ended(task, exc)
            return
        self._waiting.append(_Waiting(task, keys, len(keys), task.started + job.handoff_wait_s))

    def _look(self) -> None:
        """One look at the tiers for every waiting load's missing objects; hand on those done."""
        # once each: loads of one prefix wait for the same objects
        asked = list(dict.fromkeys(k for w in self._waiting if not w.task.cancelled for k in w.missing))
        try:
            found = dict(zip(asked, self.session.store.contains(asked))) if asked else {}
        except Exception as exc:  # not found this time (a tier's error): never the end of this thread
            log.warning("kvpack: looking for handoff objects failed: %s", exc)
            found = {}
        now = time.monotonic()
        still: list[_Waiting] = []
        for w in self._waiting:
            if w.task.cancelled:  # past its bound (`TransferRunner.finished` reported it): read nothing
                self.ended(w.task, None)
                continue
            w.missing = [k for k in w.missing if not found.get(k, False)]
            if w.missing and now < w.deadline:
                still.append(w)
            else:
                self._hand_on(w, now)
        self._waiting = still

    def _hand_on(self, w: _Waiting, now: float) -> None:
        job = w.task.job
        self.metrics.observe("handoff_wait_seconds", now - w.task.started, tenant=job.tenant)
        self.metrics.inc("handoff_loads", tenant=job.tenant)
        if w.missing:
            self.metrics.inc("handoff_missing", len(w.missing), tenant=job.tenant)
            log.warning(
                "kvpack: %d of %d objects of %s had not landed after handoff_wait_ms; recomputing from the first",
                len(w.missing),
                w.total,
                job.job_id,
            )
        self.ready(w.task)
