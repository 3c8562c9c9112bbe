"""kvpack.tiers.parallel: copies and I/O spread over threads keep order and surface errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvpack.tiers.parallel import IOThreads


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_moves_every_region(threads: int) -> None:
    rng = np.random.default_rng(0)
    srcs = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(1, 5000, 40)]
    dsts = [np.zeros_like(s) for s in srcs]
    io = IOThreads(threads, min_bytes_per_thread=1)
    io.copy(list(zip(dsts, srcs)))
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    io.close()


def test_split_keeps_order_and_uses_workers() -> None:
    io = IOThreads(2, min_items_per_thread=1)
    seen: set[int] = set()

    def part(lo: int, hi: int) -> list[int]:
        seen.add(threading.get_ident())
        return list(range(lo, hi))

    assert io.split(10, part) == list(range(10))
    assert len(seen) == 2
    assert io.split(0, part) == []
    io.close()
    assert io.split(5, part) == list(range(5))  # after close: on the caller


def test_worker_error_reaches_the_caller() -> None:
    io = IOThreads(2, min_items_per_thread=1)

    def part(lo: int, hi: int) -> list[int]:
        if lo:
            raise RuntimeError("boom")
        return list(range(lo, hi))

    with pytest.raises(RuntimeError, match="boom"):
        io.split(4, part)
    io.close()


def test_small_batches_stay_on_the_caller() -> None:
    io = IOThreads(2)  # default thresholds: 4 MiB / 8 items per thread
    me = threading.get_ident()
    assert io.split(3, lambda lo, hi: [threading.get_ident()] * (hi - lo)) == [me] * 3
    io.close()


def test_a_split_gives_each_thread_its_bytes_floor() -> None:
    """Enough items for two threads but too few bytes (`nbytes` under two threads'
    `min_bytes_per_thread`): all on the caller; at the floor, split in two."""
    io = IOThreads(2, min_items_per_thread=1, min_bytes_per_thread=1000)
    me = threading.get_ident()

    def threads_of(lo: int, hi: int) -> list[int]:
        return [threading.get_ident()] * (hi - lo)

    assert io.split(10, threads_of, nbytes=1999) == [me] * 10
    assert io.split(10, threads_of) != [me] * 10  # no bytes given: the item count decides
    split = io.split(10, threads_of, nbytes=2000)
    assert split[:5] == [me] * 5 and me not in split[5:]
    io.close()


def test_conversion_threads_are_io_threads_only_off_the_hosts_cpu() -> None:
    """An engine computing on an accelerator gets `io_threads` conversion threads (at least
    one); one computing on the host's CPU gets one, whatever `io_threads` says."""
    from kvpack import conversion_threads

    assert [conversion_threads(n, engine_on_host_cpu=False) for n in (0, 1, 2, 5)] == [1, 1, 2, 5]
    assert [conversion_threads(n, engine_on_host_cpu=True) for n in (0, 1, 2, 5)] == [1, 1, 1, 1]
