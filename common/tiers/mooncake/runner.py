"""Bounded execution of blocking Mooncake calls: worker lanes, a staging ring, abandonment.

Mooncake's client calls block for seconds when the master or a segment holder
is gone (its own retry timeouts), and a call cannot be
cancelled once it runs. kvpack must answer every engine-facing call within
`timeout_ms`, so the calls run here, on a fixed set of worker threads, and the
caller waits with a deadline:

- `LaneRunner` owns `workers` threads. Each thread owns one *lane*, a slice
  of the tier's registered staging arena. The number of threads never grows:
  a call stuck in Mooncake keeps its thread (and its lane) until Mooncake
  gives up by itself; new jobs wait in a bounded queue, and a job still
  queued at its deadline is skipped, never run.
- A `Job` is a sequence of steps (sub-batches), each in three phases:
  ``prepare`` (stage into a slot: headers, checksums, copies), ``transfer``
  (the Mooncake calls) and ``finish`` (checks, copy-out, publish). The first
  worker to take a job *leads* it: it makes every Mooncake call of the job,
  one step after another, from a ring of `slots` slots at the start of its
  own lane (step k uses slot k % slots), so the staged bytes stay cache-warm
  and no call waits for a turn hand-off between threads. Other workers that
  take the same job *help*: they prepare the next step and finish the last
  one while the leader's call runs. The leader does any phase nobody else
  has taken, so a job never depends on a helper. A slot is reused only
  after the step that used it is finished.
- Only the leader calls Mooncake and only into (or from) its own lane, and
  it returns to the queue only after every helper has left the job: a stuck
  call can never see its lane reused, and a helper never writes into a lane
  another job owns.
- The caller, at its deadline, takes what is published and *abandons* the
  rest. An abandoned job starts no further phase; a transfer that was
  running completes in the background and `on_abandoned` undoes, for each
  step whose results the caller never saw, what the caller was told did not
  happen (a put reported as TIMEOUT is removed again). Copies into caller
  buffers happen only while the job is not abandoned, under a counter the
  caller waits on, so a late transfer can never write into memory the caller
  has taken back.

- A call the caller gave up on keeps running, and Mooncake's TCP transport spins
  the calling thread on a core while it waits for an unresponsive segment holder
  (a put or a get, for as long as the holder does not answer). At abandonment the
  leader still inside its transfer gets the lowest CPU priority (`STUCK_NICE`),
  so the spin takes no core from the engine's threads; once its call returned and
  its job ended, that thread exits and the next caller starts a new one, at the
  caller's priority, for the same lane (a thread cannot raise its own priority back).

What a stall means for later calls (the circuit breaker) is decided by the
caller, `kvpack.tiers.mooncake.connection.Connection.run`.
"""

from __future__ import annotations

import enum
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger("kvpack")

R = TypeVar("R")

STUCK_NICE = 19
"""Nice value of a lane thread left inside a Mooncake call its caller gave up on: the lowest
CPU priority (see the module docstring)."""


def demote_thread(native_id: int) -> bool:
    """Give thread `native_id` of this process the lowest CPU priority; False where refused."""
    try:
        os.setpriority(os.PRIO_PROCESS, native_id, STUCK_NICE)
        return True
    except OSError:
        return False


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


@dataclass(frozen=True)
class Slot:
    """One slot of a leader's ring: `view` (uint8, `view.nbytes` bytes) at `address`."""

    index: int
    view: Any
    address: int


class _Phase(enum.IntEnum):
    TODO = 0
    CLAIMED = 1
    DONE = 2


StepFn = Callable[["Job[Any]", Slot, int], None]


@dataclass
class Job(Generic[R]):
    """A unit of work of `n_steps` steps filling `results` (see the module docstring).

    `transfer(job, slot, k)` makes step k's Mooncake calls (leader only, in
    step order); `prepare` (optional) stages step k into its slot before;
    `finish` (optional) checks and publishes after. A step's results are
    published with `job.publish(k, indices, values)` by whichever phase has
    them (`finish`, or `transfer` when there is no `finish`). Copies into
    caller memory go between `begin_copy` and `end_copy`. `slot_bytes` is
    the size of each of the `slots` ring slots (the tier plans steps that fit
    one; 0: the whole lane, one slot)."""

    n_items: int
    n_steps: int
    transfer: StepFn
    prepare: StepFn | None = None
    finish: StepFn | None = None
    on_abandoned: Callable[[Job[R], int], None] | None = None
    """Called on the leader for each step that called Mooncake but whose results the caller never took."""
    slots: int = 1
    slot_bytes: int = 0
    results: list[R | None] = field(default_factory=list)
    state: JobState = JobState.QUEUED
    started_steps: int = 0
    """Steps whose transfer began (they run, or ran, in Mooncake)."""
    progress: int = 0
    """Steps whose results are published."""
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _copying: int = 0
    _published: set[int] = field(default_factory=set)
    _called: set[int] = field(default_factory=set)
    _leader: bool = False
    _helpers: int = 0
    _prep: list[_Phase] = field(default_factory=list)
    _fin: list[_Phase] = field(default_factory=list)
    _failed: set[int] = field(default_factory=set)
    _transferred: int = 0
    """Steps 0.._transferred-1 have left Mooncake."""
    _ring: list[Slot] = field(default_factory=list)
    """The leader's slots, set when it takes the job (helpers work in them)."""
    _leader_thread: int = 0
    """Native id of the leader's thread (0: no leader yet)."""
    _transferring: bool = False
    """The leader is inside a transfer step (a Mooncake call) now."""
    demoted_thread: int = 0
    """Native id of the leader's thread when the caller gave up while it was inside a
    transfer and lowered its priority (`demote_thread`); 0 otherwise."""

    def __post_init__(self) -> None:
        self.results = [None] * self.n_items
        done_prep = _Phase.DONE if self.prepare is None else _Phase.TODO
        self._prep = [done_prep] * self.n_steps
        self._fin = [_Phase.TODO] * self.n_steps
        self.slots = max(1, self.slots)

    @property
    def wants_helpers(self) -> bool:
        return self.n_steps > 1 and (self.prepare is not None or self.finish is not None)

    # -- scheduling (under _cv) ------------------------------------------------

    def _slot_free(self, k: int) -> bool:
        j = k - self.slots
        return j < 0 or self._fin[j] is _Phase.DONE

    def _next_finish(self) -> int | None:
        for j in range(self._transferred):
            if self._fin[j] is _Phase.TODO:
                return j
        return None

    def _next_prepare(self) -> int | None:
        """The next step to stage: in order, one at a time, into a free slot
        (staging two steps at once would only delay the first call)."""
        for k in range(self._transferred, self.n_steps):
            if self._prep[k] is _Phase.TODO:
                return k if self._slot_free(k) else None
            if self._prep[k] is _Phase.CLAIMED:
                return None
        return None

    def _leader_action(self) -> tuple[str, int] | None:
        """What the leader does next: ("transfer"|"prepare"|"finish", step), or None (wait)."""
        k = self._transferred
        if k < self.n_steps:
            if self._prep[k] is _Phase.DONE and self._slot_free(k):
                return "transfer", k
            if self._prep[k] is _Phase.TODO and self._slot_free(k):
                return "prepare", k
        j = self._next_finish()
        if j is not None:
            return "finish", j
        return None

    def _helper_action(self) -> tuple[str, int] | None:
        j = self._next_finish()
        if j is not None:
            return "finish", j
        k = self._next_prepare()
        if k is not None:
            return "prepare", k
        return None

    def _all_finished(self) -> bool:
        return self._transferred >= self.n_steps and all(f is _Phase.DONE for f in self._fin)

    def _claim(self, action: tuple[str, int]) -> None:
        kind, k = action
        if kind == "prepare":
            self._prep[k] = _Phase.CLAIMED
        elif kind == "finish":
            self._fin[k] = _Phase.CLAIMED
        else:
            self.state = JobState.RUNNING
            self.started_steps += 1
            self._called.add(k)

    def _complete(self, action: tuple[str, int], ok: bool) -> None:
        kind, k = action
        if not ok:
            self._failed.add(k)
        if kind == "prepare":
            self._prep[k] = _Phase.DONE
        elif kind == "finish":
            self._fin[k] = _Phase.DONE
        else:
            self._transferred = k + 1
            if self.finish is None or k in self._failed:
                self._fin[k] = _Phase.DONE
        self._cv.notify_all()

    # -- worker side ---------------------------------------------------------

    def run(self, lane: Lane) -> None:
        """Run this job on a worker: as its leader (the first taker) or as a helper."""
        with self._cv:
            if self.state is JobState.ABANDONED or self._all_finished():
                return
            leader = not self._leader
            self._leader = True
            if leader:
                self._ring = self._slots_of(lane)
                self._leader_thread = threading.get_native_id()
            else:
                if not self.wants_helpers:
                    return
                self._helpers += 1
        if leader:
            self._lead()
        else:
            try:
                self._help()
            finally:
                with self._cv:
                    self._helpers -= 1
                    self._cv.notify_all()

    def _slots_of(self, lane: Lane) -> list[Slot]:
        view = lane.view
        if view is None:
            return [Slot(i, None, 0) for i in range(self.slots)]
        size = self.slot_bytes or view.nbytes // self.slots
        size = min(size, view.nbytes // self.slots) // 64 * 64
        return [Slot(i, view[i * size : (i + 1) * size], lane.address + i * size) for i in range(self.slots)]

    def _lead(self) -> None:
        ring = self._ring
        try:
            while True:
                with self._cv:
                    action = None
                    while self.state is not JobState.ABANDONED and not self._all_finished():
                        action = self._leader_action()
                        if action is not None:
                            break
                        self._cv.wait()
                    if action is None:
                        break
                    if action[0] == "transfer" and action[1] in self._failed:
                        self._claim(action)
                        self._complete(action, False)
                        self._publish_failed(action[1])
                        continue
                    self._claim(action)
                    self._transferring = action[0] == "transfer"
                ok = self._do(action, ring)
                with self._cv:
                    self._transferring = False
                    self._complete(action, ok)
                if action[0] == "transfer" and self.state is JobState.ABANDONED:
                    self._undo(action[1])
        finally:
            with self._cv:
                while self._helpers:  # helpers may be writing into this lane: wait (bounded work)
                    self._cv.wait()

    def _help(self) -> None:
        while True:
            with self._cv:
                action = None
                while self.state is not JobState.ABANDONED and not self._all_finished():
                    action = self._helper_action()
                    if action is not None:
                        break
                    self._cv.wait()
                if action is None:
                    return
                self._claim(action)
            ok = self._do(action, self._ring)
            with self._cv:
                self._complete(action, ok)

    def _do(self, action: tuple[str, int], ring: list[Slot]) -> bool:
        kind, k = action
        fn = {"prepare": self.prepare, "transfer": self.transfer, "finish": self.finish}[kind]
        if fn is None:
            return True
        if kind == "finish" and k in self._failed:
            self._publish_failed(k)
            return False
        try:
            fn(self, ring[k % len(ring)], k)
            return True
        except Exception as exc:  # a bug in a step must not kill the worker
            log.error("kvpack: Mooncake worker step %s failed: %r", kind, exc)
            self._publish_failed(k)
            return False

    def _publish_failed(self, k: int) -> None:
        self.publish(k, [], [])

    def _undo(self, k: int) -> None:
        if self.on_abandoned is not None and self.called(k) and not self.was_published(k):
            try:
                self.on_abandoned(self, k)
            except Exception as exc:
                log.error("kvpack: Mooncake clean-up after an abandoned call failed: %r", exc)

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
        abandoned. Returns the final state, the steps whose transfer had
        started and a snapshot of the published results (None: not done in time)."""
        with self._cv:
            while self.state in (JobState.QUEUED, JobState.RUNNING):
                left = deadline - time.monotonic()
                if left <= 0:
                    while self._copying:  # a memcpy into caller buffers: let it finish
                        self._cv.wait()
                    if self.state in (JobState.QUEUED, JobState.RUNNING):
                        self.state = JobState.ABANDONED
                        if self._transferring and demote_thread(self._leader_thread):
                            self.demoted_thread = self._leader_thread
                        self._cv.notify_all()  # workers waiting for a phase give up
                    break
                self._cv.wait(left)
            return self.state, self.started_steps, list(self.results)


class LaneRunner:
    """`workers` threads, one lane each, fed by a bounded queue. See the module docstring."""

    def __init__(self, workers: int, lanes: list[Lane], max_queued: int = 64, name: str = "kvpack-mooncake") -> None:
        if len(lanes) != workers:
            raise ValueError("one lane per worker")
        self._workers = workers
        self._name = name
        self._queue: queue.Queue[Job[Any] | None] = queue.Queue(maxsize=max_queued)
        self._closed = False
        self._busy = 0
        self._lock = threading.Lock()
        self._retired: list[Lane] = []
        """Lanes whose demoted thread exited; the next `submit` starts a thread for each."""
        self.replaced = 0
        """Lane threads started in place of demoted ones (since start)."""
        self._threads = [self._thread(lane) for lane in lanes]
        for t in self._threads:
            t.start()

    def _thread(self, lane: Lane) -> threading.Thread:
        return threading.Thread(target=self._loop, args=(lane,), name=f"{self._name}-{lane.index}", daemon=True)

    @property
    def lane_threads(self) -> list[int]:
        """Native ids of the lane threads running now (a demoted one until it exits)."""
        with self._lock:
            return [t.native_id for t in self._threads if t.native_id is not None]

    @property
    def busy(self) -> int:
        """Workers inside a job right now (stuck ones included)."""
        with self._lock:
            return self._busy

    def submit(self, job: Job[Any]) -> bool:
        """Queue `job` for a leader, and once more per worker that can help.

        Only the first entry must fit: the others are best effort (a worker
        that finds the job done, or nothing to help with, drops its entry)."""
        if self._closed:
            job.state = JobState.REFUSED
            return False
        self._replace_retired()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            job.state = JobState.REFUSED
            return False
        if job.wants_helpers:
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

    def _replace_retired(self) -> None:
        """Start a thread (at the caller's priority) for each lane whose demoted thread exited."""
        with self._lock:
            if not self._retired or self._closed:
                return
            lanes, self._retired = self._retired, []
            started = [self._thread(lane) for lane in lanes]
            self._threads += started
            self.replaced += len(started)
        for t in started:
            t.start()

    def _loop(self, lane: Lane) -> None:
        me = threading.get_native_id()
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._busy += 1
            try:
                job.run(lane)
            except Exception as exc:  # pragma: no cover - Job.run catches step errors itself
                log.error("kvpack: Mooncake worker failed: %r", exc)
            finally:
                with self._lock:
                    self._busy -= 1
                    if job.demoted_thread == me:  # this thread runs at the lowest priority now: retire it
                        self._threads.remove(threading.current_thread())
                        self._retired.append(lane)
            if job.demoted_thread == me:
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
