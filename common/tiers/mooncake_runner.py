"""Bounded execution of blocking Mooncake calls: worker lanes, abandonment, circuit breaker.

Mooncake's client calls block for seconds when the master or a segment holder
is gone (about 4.3 s each with the master dead), and a call cannot be
cancelled once it runs. kvpack must answer every engine-facing call within
`timeout_ms`, so the calls run here, on a fixed set of worker threads, and the
caller waits with a deadline:

- `LaneRunner` owns `workers` threads. Each thread owns one *lane*, a slice
  of the tier's registered staging arena, and runs one job at a time, so a
  job can use its lane without locks. The number of threads never grows: a
  call stuck in Mooncake keeps its thread (and its lane) until Mooncake gives
  up by itself; new jobs wait in a bounded queue, and a job still queued at
  its deadline is skipped, never run.
- A `Job` is a sequence of steps (sub-batches). Every idle worker claims
  the next unstarted step of the same job, so the sub-batches of one call
  are pipelined over the lanes: one step stages (or checks and copies out)
  in its lane while another is in Mooncake; the Mooncake calls themselves
  take turns, in step order (`Job.take_turn`). A worker publishes each step's
  results as it finishes; the caller, at its deadline, takes what is done
  and *abandons* the rest. An abandoned job starts no further step; steps
  that were running complete in the background and `on_abandoned` undoes,
  for each step whose results the caller never saw, what the caller was
  told did not happen (a put reported as TIMEOUT is removed again). Copies
  into caller buffers happen only while the job is not abandoned, under a
  counter the caller waits on, so a late transfer can never write into
  memory the caller has taken back.
- `CircuitBreaker`: after a stall or a connection-level failure the tier
  stops calling Mooncake for `backoff_s`; a background probe closes it again
  when the master answers (the engine never waits on a dead master).
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger("kvpack")

R = TypeVar("R")


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    ABANDONED = "abandoned"
    REFUSED = "refused"
    """Never queued: the queue was full or the runner is closed."""


@dataclass
class Lane:
    """One worker's private slice of the staging arena (a writable uint8 view)."""

    index: int
    view: Any  # numpy uint8 array or None when no arena is attached
    address: int


@dataclass
class Job(Generic[R]):
    """A unit of work made of `n_steps` steps, each filling part of `results`.

    `run_step(job, lane, i)` performs step i: its Mooncake calls go between
    `take_turn(i)` and `end_turn(i)`, a copy into caller memory between
    `begin_copy` and `end_copy`, and it ends with
    `job.publish(i, indices, values)`. Steps run concurrently on different
    workers."""

    n_items: int
    run_step: Callable[[Job[R], Lane, int], None]
    n_steps: int
    on_abandoned: Callable[[Job[R], int], None] | None = None
    """Called on the worker for each step that called Mooncake but whose results the caller never took."""
    results: list[R | None] = field(default_factory=list)
    state: JobState = JobState.QUEUED
    started_steps: int = 0
    """Steps claimed by a worker (they run, or ran, in Mooncake)."""
    progress: int = 0
    """Steps whose results are published."""
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _copying: int = 0
    _published: set[int] = field(default_factory=set)
    _turn: int = 0
    _called: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.results = [None] * self.n_items

    # -- worker side ---------------------------------------------------------

    def claim_step(self) -> int | None:
        """The next unstarted step, or None (all claimed, or the caller gave up)."""
        with self._cv:
            if self.state is JobState.ABANDONED or self.started_steps >= self.n_steps:
                return None
            self.state = JobState.RUNNING
            step = self.started_steps
            self.started_steps += 1
            return step

    def take_turn(self, step: int) -> bool:
        """Wait until the steps before `step` have finished their Mooncake calls.

        Steps stage (or check and copy out) in parallel, but call Mooncake one
        after another, in order: on two cores, concurrent transfers of one
        batch are slower than consecutive ones. False when the caller gave up
        meanwhile: the step must not call Mooncake at all."""
        with self._cv:
            while self._turn < step and self.state is not JobState.ABANDONED:
                self._cv.wait()
            if self.state is JobState.ABANDONED:
                return False
            self._called.add(step)
            return True

    def end_turn(self, step: int) -> None:
        """The step's Mooncake calls are over; the next step may call."""
        with self._cv:
            if self._turn <= step:
                self._turn = step + 1
                self._cv.notify_all()

    def called(self, step: int) -> bool:
        with self._cv:
            return step in self._called

    def begin_copy(self) -> bool:
        """Enter the copy-out phase of a step (caller buffers get written).

        Returns False when the job was abandoned: the worker must then not
        touch caller memory. While any step copies, an expiring caller waits
        for `end_copy` instead of abandoning (a memcpy, not an I/O wait)."""
        with self._cv:
            if self.state is JobState.ABANDONED:
                return False
            self._copying += 1
            return True

    def end_copy(self) -> None:
        with self._cv:
            self._copying -= 1
            self._cv.notify_all()

    def publish(self, step: int, indices: Sequence[int], values: Sequence[R]) -> bool:
        """Record a finished step's results. False (and ignored) once the caller
        gave up: it has already answered TIMEOUT for them."""
        with self._cv:
            if self.state is JobState.ABANDONED or step in self._published:
                return False
            self._published.add(step)
            for i, v in zip(indices, values):
                self.results[i] = v
            self.progress += 1
            if self.progress >= self.n_steps:
                self.state = JobState.DONE
            self._cv.notify_all()
            return True

    def was_published(self, step: int) -> bool:
        with self._cv:
            return step in self._published

    # -- caller side ---------------------------------------------------------

    def wait(self, deadline: float) -> tuple[JobState, int, list[R | None]]:
        """Wait until done or `deadline` (monotonic). On expiry the job is
        abandoned. Returns the final state, the steps that had started and a
        snapshot of the published results (None: not done in time)."""
        with self._cv:
            while self.state in (JobState.QUEUED, JobState.RUNNING):
                left = deadline - time.monotonic()
                if left <= 0:
                    while self._copying:  # a memcpy into caller buffers: let it finish
                        self._cv.wait()
                    if self.state in (JobState.QUEUED, JobState.RUNNING):
                        self.state = JobState.ABANDONED
                        self._cv.notify_all()  # steps waiting for their turn give up
                    break
                self._cv.wait(left)
            return self.state, self.started_steps, list(self.results)


class LaneRunner:
    """`workers` threads, one lane each, fed by a bounded queue. See the module docstring."""

    def __init__(self, workers: int, lanes: list[Lane], max_queued: int = 64, name: str = "kvpack-mooncake") -> None:
        if len(lanes) != workers:
            raise ValueError("one lane per worker")
        self._workers = workers
        self._queue: queue.Queue[Job[Any] | None] = queue.Queue(maxsize=max_queued)
        self._closed = False
        self._busy = 0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, args=(lane,), name=f"{name}-{i}", daemon=True)
            for i, lane in enumerate(lanes)
        ]
        for t in self._threads:
            t.start()

    @property
    def busy(self) -> int:
        """Workers inside a job right now (stuck ones included)."""
        with self._lock:
            return self._busy

    def submit(self, job: Job[Any]) -> bool:
        """Queue `job` once per worker that can help (at most one per step).

        Only the first entry must fit: the others are best effort (a worker
        that finds no unclaimed step left drops its entry)."""
        if self._closed:
            job.state = JobState.REFUSED
            return False
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            job.state = JobState.REFUSED
            return False
        for _ in range(min(job.n_steps, self._workers) - 1):
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                break
        return True

    def run(self, job: Job[R], timeout_s: float) -> tuple[JobState, int, list[R | None]]:
        """Submit and wait at most `timeout_s`; see `Job.wait`."""
        if not self.submit(job):
            return JobState.REFUSED, 0, [None] * job.n_items
        return job.wait(time.monotonic() + timeout_s)

    def _loop(self, lane: Lane) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._busy += 1
            try:
                self._run_job(job, lane)
            finally:
                with self._lock:
                    self._busy -= 1

    @staticmethod
    def _run_job(job: Job[Any], lane: Lane) -> None:
        while True:
            step = job.claim_step()
            if step is None:
                return  # all steps taken by other workers, or abandoned: nothing more runs
            try:
                job.run_step(job, lane, step)
            except Exception as exc:  # a bug in a step must not kill the worker
                log.error("kvpack: Mooncake worker step failed: %r", exc)
                job.publish(step, [], [])
            finally:
                job.end_turn(step)
            if job.state is JobState.ABANDONED:
                if job.on_abandoned is not None and job.called(step) and not job.was_published(step):
                    try:
                        job.on_abandoned(job, step)
                    except Exception as exc:
                        log.error("kvpack: Mooncake clean-up after an abandoned call failed: %r", exc)
                return

    def close(self, timeout_s: float) -> bool:
        """Stop the workers; True if every worker exited within `timeout_s`."""
        self._closed = True
        deadline = time.monotonic() + timeout_s
        for _ in self._threads:
            try:
                self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                break
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"


class CircuitBreaker:
    """Stops calls for `backoff_s` after a failure; `record_success` closes it.

    While open, `allow()` is False: callers answer UNAVAILABLE without
    touching Mooncake. `due_for_probe()` tells the tier's prober when the
    back-off has elapsed, so recovery is detected off the engine's path."""

    def __init__(self, backoff_s: float) -> None:
        self.backoff_s = backoff_s
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._opened_at = 0.0
        self.trips = 0
        self.last_reason = ""

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        with self._lock:
            return self._state is BreakerState.CLOSED

    def record_failure(self, reason: str) -> None:
        with self._lock:
            was_open = self._state is BreakerState.OPEN
            self._state = BreakerState.OPEN
            self._opened_at = time.monotonic()
            self.last_reason = reason
            if not was_open:
                self.trips += 1
        if not was_open:
            log.warning(
                "kvpack: Mooncake tier unavailable (%s); not calling it for %.1fs, engines recompute meanwhile",
                reason,
                self.backoff_s,
            )

    def record_success(self) -> None:
        with self._lock:
            was_open = self._state is BreakerState.OPEN
            self._state = BreakerState.CLOSED
        if was_open:
            log.warning("kvpack: Mooncake tier is available again")

    def due_for_probe(self) -> bool:
        with self._lock:
            return self._state is BreakerState.OPEN and time.monotonic() - self._opened_at >= self.backoff_s

    def rearm(self) -> None:
        """A probe failed: stay open for another back-off period."""
        with self._lock:
            self._opened_at = time.monotonic()
