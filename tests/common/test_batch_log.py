"""`BatchLog`: per-batch pages and GiB/s since the last take, bounded when nobody takes."""

from __future__ import annotations

from kvpack import BatchLog, Direction


def test_batches_are_taken_once_and_the_oldest_dropped_past_the_bound() -> None:
    log = BatchLog(max_batches=3)
    log.note(Direction.LOAD, 4, 4 << 30, 2.0)
    log.note(Direction.STORE, 2, 0, 1.0)  # no bytes known: pages only
    log.note(Direction.LOAD, 0, 1 << 30, 1.0)  # nothing moved: not a batch
    taken = log.take()
    assert (taken[Direction.LOAD].pages, taken[Direction.LOAD].gb_per_s) == ([4], [2.0])
    assert (taken[Direction.STORE].pages, taken[Direction.STORE].gb_per_s) == ([2], [])
    assert log.take()[Direction.LOAD].pages == []
    for pages in range(1, 11):  # metrics off: nobody takes; a fixed amount is kept
        log.note(Direction.LOAD, pages, 1 << 30, 1.0)
    assert log.take()[Direction.LOAD].pages == [8, 9, 10]
