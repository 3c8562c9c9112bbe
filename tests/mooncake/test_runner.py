"""LaneRunner's phases without Mooncake: one leader makes every transfer, in order; slots are reused only after finish; abandonment."""

from __future__ import annotations

import threading
import time

import numpy as np

from kvpack.tiers.mooncake.runner import Job, JobState, Lane, LaneRunner, Slot


def _runner(workers: int = 2, lane_bytes: int = 1 << 16) -> LaneRunner:
    arena = np.zeros(workers * lane_bytes, dtype=np.uint8)
    lanes = [
        Lane(i, arena[i * lane_bytes : (i + 1) * lane_bytes], arena.ctypes.data + i * lane_bytes)
        for i in range(workers)
    ]
    return LaneRunner(workers, lanes)


def test_one_leader_transfers_in_order_and_slots_wait_for_finish() -> None:
    runner = _runner()
    log: list[tuple[str, int, int, str]] = []
    lock = threading.Lock()
    in_use: dict[int, int] = {}  # slot index -> step occupying it (prepare..finish)

    def note(kind: str, slot: Slot, k: int) -> None:
        with lock:
            log.append((kind, k, slot.index, threading.current_thread().name))

    def prepare(job: Job[int], slot: Slot, k: int) -> None:
        with lock:
            assert slot.index not in in_use, (
                f"slot {slot.index} reused by step {k} before step {in_use.get(slot.index)} finished"
            )
            in_use[slot.index] = k
        note("prepare", slot, k)
        time.sleep(0.002)

    def transfer(job: Job[int], slot: Slot, k: int) -> None:
        note("transfer", slot, k)
        time.sleep(0.003)

    def finish(job: Job[int], slot: Slot, k: int) -> None:
        note("finish", slot, k)
        with lock:
            assert in_use.pop(slot.index) == k
        job.publish(k, [k], [k * 10])

    try:
        job: Job[int] = Job(8, 8, transfer, prepare=prepare, finish=finish, slots=2, slot_bytes=1 << 12)
        state, started, results = runner.run(job, 10.0)
        assert state is JobState.DONE and started == 8
        assert results == [k * 10 for k in range(8)]
        transfers = [e for e in log if e[0] == "transfer"]
        assert [e[1] for e in transfers] == list(range(8))
        assert len({e[3] for e in transfers}) == 1, "every Mooncake call of a job comes from its leader"
        assert all(e[2] == e[1] % 2 for e in log), "step k uses slot k % slots"
    finally:
        runner.close(2.0)


def test_abandoned_job_undoes_the_running_step_and_starts_no_other() -> None:
    runner = _runner()
    release = threading.Event()
    transferred: list[int] = []
    undone: list[int] = []

    def transfer(job: Job[int], slot: Slot, k: int) -> None:
        transferred.append(k)
        if k == 1:
            release.wait(5)  # a stuck Mooncake call
        job.publish(k, [k], [k])

    try:
        job: Job[int] = Job(
            4, 4, transfer, prepare=lambda j, s, k: None, on_abandoned=lambda j, k: undone.append(k), slots=2
        )
        state, started, results = runner.run(job, 0.2)
        assert state is JobState.ABANDONED
        assert results[0] == 0 and results[1:] == [None, None, None]
        release.set()
        deadline = time.monotonic() + 5
        while not undone and time.monotonic() < deadline:
            time.sleep(0.01)
        assert undone == [1] and transferred == [0, 1]
        # The runner still works after the stuck call came back.
        ok: Job[int] = Job(1, 1, lambda j, s, k: j.publish(k, [0], [7]))
        assert runner.run(ok, 2.0)[2] == [7]
    finally:
        runner.close(2.0)


def test_a_failing_phase_fails_its_step_only() -> None:
    runner = _runner()

    def prepare(job: Job[int], slot: Slot, k: int) -> None:
        if k == 1:
            raise RuntimeError("boom")

    def transfer(job: Job[int], slot: Slot, k: int) -> None:
        job.publish(k, [k], [k])

    try:
        job: Job[int] = Job(3, 3, transfer, prepare=prepare, slots=2)
        state, _, results = runner.run(job, 5.0)
        assert state is JobState.DONE and results == [0, None, 2]
    finally:
        runner.close(2.0)
