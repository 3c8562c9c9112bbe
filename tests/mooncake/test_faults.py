"""Faults: master killed and restarted, segment holder killed, store full, start without a master."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fixtures.builders import expect_key, item, key, payload
from kvpack.store import KVStore, LoadItem
from kvpack.tiers.base import TierStatus
from kvpack.tiers.mooncake import BreakerState, MooncakeTier, TierState, runner
from kvpack.tiers.mooncake.runner import Job
from kvpack.tools.procfs import stat_fields

pytestmark = pytest.mark.mooncake

TIMEOUT_MS = 300
SLACK_S = 0.5
"""Scheduling slack on a loaded 2-core CI machine; an unbounded call takes ~4.3 s."""
BOUND_S = TIMEOUT_MS / 1000 + SLACK_S


def _timed(fn):  # type: ignore[no-untyped-def]
    start = time.monotonic()
    out = fn()
    return out, time.monotonic() - start


def _wait(pred, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_master_killed_mid_run_then_restarted(mooncake_cluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = mooncake_cluster_factory()
    tier = MooncakeTier(cluster.tier_config(timeout_ms=TIMEOUT_MS, backoff_s=0.5))
    assert tier.wait_ready(15)
    data = payload(1, 256 << 10)
    keys = [key(f"m-{i}") for i in range(4)]
    assert tier.put_from([item(k, data) for k in keys]) == [TierStatus.OK] * 4

    # An engine-like loop keeps calling while the master dies.
    durations: list[float] = []
    statuses: list[TierStatus] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def loop() -> None:
        dst = np.zeros(data.nbytes, dtype=np.uint8)
        i = 0
        while not stop.is_set():
            i += 1
            try:
                _, d1 = _timed(lambda: tier.contains(keys))
                res, d2 = _timed(lambda: tier.get_into(keys[:1], [memoryview(dst)], [expect_key(keys[0])], True))
                st, d3 = _timed(lambda: tier.put_from([item(key(f"loop-{i}"), data)]))
                durations.extend([d1, d2, d3])
                statuses.extend([res[0].status, st[0]])
            except BaseException as exc:  # noqa: BLE001 - the point is that nothing raises
                errors.append(exc)

    worker = threading.Thread(target=loop)
    worker.start()
    try:
        time.sleep(0.3)
        cluster.kill_master()
        time.sleep(3.0)
    finally:
        stop.set()
        worker.join(30)
    assert not errors, errors
    assert max(durations) <= BOUND_S, f"a call took {max(durations):.2f}s with the master dead"
    assert not tier.available
    assert set(statuses) & {TierStatus.UNAVAILABLE, TierStatus.TIMEOUT}
    # While down: answers are immediate and named, never data.
    dst = np.full(data.nbytes, 0xEE, dtype=np.uint8)
    (res,), took = _timed(lambda: tier.get_into(keys[:1], [memoryview(dst)], [expect_key(keys[0])], True))
    assert res.status in (TierStatus.UNAVAILABLE, TierStatus.TIMEOUT) and took <= BOUND_S
    assert (dst == 0xEE).all()

    cluster.restart_master()
    assert _wait(lambda: tier.available, 20), f"tier did not recover: {tier.state} {tier.breaker.state}"
    fresh = [key(f"after-{i}") for i in range(3)]
    assert _wait(lambda: tier.put_from([item(k, data) for k in fresh]) == [TierStatus.OK] * 3, 10)
    dsts = [np.zeros(data.nbytes, dtype=np.uint8) for _ in fresh]
    res = tier.get_into(fresh, [memoryview(d) for d in dsts], [expect_key(k) for k in fresh], True)
    assert all(r.ok for r in res) and all(np.array_equal(d, data) for d in dsts)
    _, took = _timed(tier.close)
    assert took < 10


def test_holder_killed_loads_fail_cleanly(mooncake_cluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = mooncake_cluster_factory()
    tier = MooncakeTier(cluster.tier_config(timeout_ms=TIMEOUT_MS))
    assert tier.wait_ready(15)
    try:
        keys = [key(f"h-{i}") for i in range(8)]
        datas = [payload(i, 512 << 10) for i in range(8)]
        assert tier.put_from([item(k, d) for k, d in zip(keys, datas)]) == [TierStatus.OK] * 8
        cluster.kill_holder()
        for _ in range(3):
            dsts = [np.full(d.nbytes, 0xEE, dtype=np.uint8) for d in datas]
            res, took = _timed(
                lambda: tier.get_into(keys, [memoryview(d) for d in dsts], [expect_key(k) for k in keys], True)
            )
            assert took <= BOUND_S
            assert all(not r.ok for r in res), [r.status for r in res]
            assert {r.status for r in res} <= {
                TierStatus.ERROR,
                TierStatus.MISS,
                TierStatus.UNAVAILABLE,
                TierStatus.TIMEOUT,
            }
            assert all((d == 0xEE).all() for d in dsts), "a failed load wrote into the destination"
        st, took = _timed(lambda: tier.put_from([item(key("h-new"), datas[0])]))
        assert st[0] is not TierStatus.OK and took <= BOUND_S
        # A new holder: the tier works again without a restart.
        cluster.start_holder()
        assert _wait(lambda: tier.put_from([item(key("h-new"), datas[0])]) == [TierStatus.OK], 15)
    finally:
        tier.close()


def test_calls_queued_behind_stuck_calls_open_the_breaker(mooncake_cluster) -> None:  # type: ignore[no-untyped-def]
    """Calls that never return (a put into a stopped segment holder blocks for as long as
    the holder is stopped) hold every worker. A call queued behind them must not wait its
    whole bound each time: the first one that cannot start opens the breaker, and every
    later call answers at once, named UNAVAILABLE, until Mooncake is free again.

    The stuck calls here block inside the tier's own call gate on an event, standing in
    for a Mooncake call that does not return (a real stopped holder also trips the
    breaker on the put itself, which would hide the queueing)."""
    tier = MooncakeTier(mooncake_cluster.tier_config(timeout_ms=TIMEOUT_MS, backoff_s=30.0, workers=2))
    assert tier.wait_ready(15)
    release = threading.Event()
    keys = [key(f"queued-{i}") for i in range(3)]
    try:
        assert tier.put_from([item(k, payload(3, 4096)) for k in keys]) == [TierStatus.OK] * 3

        def stuck(job: Job[int], slot, i: int) -> None:  # type: ignore[no-untyped-def]
            tier.connection.call(lambda s: release.wait(30), default=None)
            job.publish(i, [0], [0])

        for _ in range(2):
            assert tier.runner.submit(Job(1, 1, stuck))
        assert _wait(lambda: tier.runner.busy == 2 and tier.connection.gate.oldest_call_s() > TIMEOUT_MS / 1000, 5)
        assert tier.breaker.state is BreakerState.CLOSED
        timeouts = tier.events.timeouts

        answers, took = _timed(lambda: [tier.contains(keys) for _ in range(6)])
        assert answers == [[False] * 3] * 6
        assert tier.events.timeouts == timeouts + 1, "each queued call waited its whole bound"
        assert tier.breaker.state is BreakerState.OPEN
        assert took <= BOUND_S, f"six lookups took {took:.2f}s behind stuck calls"
    finally:
        release.set()
        tier.close()


def test_start_without_master_does_not_block(mooncake_cluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = mooncake_cluster_factory()
    cluster.kill_master()
    tier, took = _timed(lambda: MooncakeTier(cluster.tier_config(timeout_ms=TIMEOUT_MS, backoff_s=0.5)))
    try:
        assert took < 1.0, f"construction blocked {took:.2f}s"
        assert tier.state == TierState.CONNECTING
        st, took = _timed(lambda: tier.put_from([item(key("early"), payload(1, 100))]))
        assert st == [TierStatus.UNAVAILABLE] and took < 0.1
        assert tier.contains([key("early")]) == [False]
        cluster.restart_master()
        assert tier.wait_ready(30), tier.state
        assert _wait(lambda: tier.put_from([item(key("late"), payload(1, 100))]) == [TierStatus.OK], 10)
    finally:
        tier.close()


def test_full_store_reports_no_space_counted(mooncake_cluster_factory) -> None:  # type: ignore[no-untyped-def]
    """Puts beyond the cluster's memory answer NO_SPACE; KVStore counts them, nothing raises."""
    cluster = mooncake_cluster_factory(segment_size="16MB")
    tier = MooncakeTier(cluster.tier_config())
    assert tier.wait_ready(15)
    try:
        big = payload(5, 1 << 20)
        statuses = tier.put_from([item(key(f"full-{i}"), big) for i in range(40)])
        assert TierStatus.NO_SPACE in statuses, statuses
        assert set(statuses) <= {TierStatus.OK, TierStatus.NO_SPACE}
        assert tier.available, "no space is not an outage"
    finally:
        tier.close()

    store = KVStore.from_config(cluster.kvpack_config())
    try:
        assert store.tiers[0].wait_ready(15)  # type: ignore[attr-defined]
        accepted = store.store([item(key(f"kv-full-{i}"), big) for i in range(40)])
        assert all(s in (TierStatus.OK, TierStatus.NO_SPACE) for s in accepted)
        assert store.flush(60)
        dropped = store.metrics.value("store_dropped", tier="mooncake", reason="no_space")
        stored = store.metrics.value("stored_objects", tier="mooncake")
        assert dropped > 0 and dropped + stored == 40, store.metrics.snapshot()
    finally:
        store.close()


def test_corrupted_object_through_kvstore_is_rejected_and_counted(mooncake_cluster) -> None:  # type: ignore[no-untyped-def]
    from fixtures.mooncake import raw_client, raw_put

    k = key("kvstore-corrupt")
    data = payload(6, 4096)
    raw = raw_client(mooncake_cluster.master_address)
    try:
        blob = bytearray(item(k, data, checksum=True).header.encode() + data.tobytes())
        blob[-7] ^= 0x5A
        assert raw_put(raw, k.as_str(), bytes(blob)) == 0
    finally:
        raw.close()
    store = KVStore.from_config(mooncake_cluster.kvpack_config())
    try:
        assert store.tiers[0].wait_ready(15)  # type: ignore[attr-defined]
        dst = np.zeros(4096, dtype=np.uint8)
        (res,) = store.load([LoadItem(k, memoryview(dst), expect_key(k))])
        assert res.status is TierStatus.REJECTED
        assert store.metrics.value("rejected_objects", tier="mooncake", reason="checksum") == 1
    finally:
        store.close()


def test_lookups_while_the_tier_is_down_are_counted_misses(mooncake_cluster_factory) -> None:  # type: ignore[no-untyped-def]
    """A lookup that finds the tier down answers a miss without asking it, and counts
    ``tier_errors{status="unavailable"}`` as a refused load does: an outage is visible in
    metrics from the lookups alone. Once the tier answers again, lookups ask it (not counted)."""
    cluster = mooncake_cluster_factory()
    store = KVStore.from_config(cluster.kvpack_config(timeout_ms=TIMEOUT_MS, backoff_s=0.5))
    k = key("down-lookup")
    try:
        tier = store.tiers[0]
        assert tier.wait_ready(15)  # type: ignore[attr-defined]
        assert store.store([item(k, payload(7, 1024))]) == [TierStatus.OK] and store.flush(30)
        assert store.contains([k]) == [True]
        assert store.metrics.value("tier_errors", tier="mooncake") == 0
        cluster.kill_master()
        # calls to the dead master fail and open the breaker; lookups keep coming meanwhile
        assert _wait(lambda: store.contains([key("probe")]) == [False] and not tier.available, 20)
        before = store.metrics.value("tier_errors", tier="mooncake", status="unavailable")
        assert store.contains([k]) == [False]
        assert store.metrics.value("tier_errors", tier="mooncake", status="unavailable") == before + 1
        cluster.restart_master()
        assert _wait(lambda: tier.available, 30), f"tier did not recover: {tier.state}"  # type: ignore[attr-defined]
        counted = store.metrics.value("tier_errors", tier="mooncake", status="unavailable")
        store.contains([k])
        assert store.metrics.value("tier_errors", tier="mooncake", status="unavailable") == counted
    finally:
        store.close()


def _nice(native_id: int) -> int:
    """The nice value of thread `native_id` of this process (field 19 of its stat)."""
    fields = stat_fields(f"/proc/self/task/{native_id}/stat")
    assert fields is not None, f"thread {native_id} is gone"
    return int(fields[16])


def _sigstop(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP `pid` and return once every thread of it is stopped: the signal is sent at once,
    but each thread stops when the kernel next schedules it, and until then the process still
    answers (a put right after the kill may complete)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        fields = (stat_fields(task / "stat") for task in Path(f"/proc/{pid}/task").iterdir())
        states = [f[0] for f in fields if f is not None]  # (None: a thread that ended meanwhile)
        if states and all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped after {timeout_s}s: {states}"
        time.sleep(0.01)


def test_calls_stuck_on_a_stopped_holder_run_at_the_lowest_priority_then_their_lanes_come_back(
    mooncake_cluster_factory,
) -> None:  # type: ignore[no-untyped-def]
    """A put into a stopped segment holder stays inside Mooncake, whose TCP transport spins
    the calling thread on a core for as long as the holder is stopped. The caller's bound
    answers TIMEOUT, and the lane thread left in the call gets the lowest CPU priority, so the
    spin takes no core from an engine computing on the same CPUs. The master answers the
    tier's probes meanwhile, so later puts may get stuck too: each stuck one is demoted alike,
    and every put answers within its bound. Once the holder runs again, a new thread at normal
    priority takes over each demoted thread's lane and puts succeed."""
    cluster = mooncake_cluster_factory()
    tier = MooncakeTier(cluster.tier_config(timeout_ms=TIMEOUT_MS, backoff_s=0.2, workers=2))
    assert tier.wait_ready(15)
    normal = _nice(threading.get_native_id())
    holder = cluster.holder_pid
    assert holder is not None
    demoted: set[int] = set()
    try:
        assert tier.put_from([item(key("before"), payload(1, 4096))]) == [TierStatus.OK]
        _sigstop(holder)
        try:
            assert tier.put_from([item(key("stuck"), payload(2, 4096))]) == [TierStatus.TIMEOUT]
            lanes = tier.runner.lane_threads
            assert sorted(_nice(t) for t in lanes) == [normal, runner.STUCK_NICE]
            deadline = time.monotonic() + 10 * 0.2  # many probe periods
            n = 0
            while time.monotonic() < deadline:
                n += 1
                got, took = _timed(lambda: tier.put_from([item(key(f"during-{n}"), payload(3, 4096))]))
                assert got[0] in (TierStatus.TIMEOUT, TierStatus.UNAVAILABLE) and took <= BOUND_S, (got, took)
                demoted |= {t for t in tier.runner.lane_threads if _nice(t) == runner.STUCK_NICE}
            assert tier.runner.replaced == 0  # every demoted call is still inside Mooncake
        finally:
            os.kill(holder, signal.SIGCONT)
        # a put starts the new threads (on the caller's thread, at its priority)
        after_put = [item(key("after"), payload(4, 4096))]
        assert _wait(lambda: tier.put_from(after_put) == [TierStatus.OK] and tier.runner.replaced == len(demoted), 15)
        after = tier.runner.lane_threads
        assert len(after) == 2 and not demoted & set(after)
        assert [_nice(t) for t in after] == [normal, normal]
    finally:
        tier.close()
