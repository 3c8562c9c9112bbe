"""The pinned staging pool and the transfer byte bounds, on their own: reuse, the bound,
what is turned away (`kvpack.transfers.staging_pool`, `kvpack.transfers.ByteBound`)."""

from __future__ import annotations

import pytest
import torch

from kvpack.transfers import ByteBound
from kvpack.transfers.staging_pool import MIN_BUFFER_BYTES, PinnedPool, StagingFull, capacity_class


def _pool(bound: int) -> tuple[PinnedPool, list[int]]:
    pinned: list[int] = []

    def allocate(n: int) -> torch.Tensor:
        pinned.append(n)
        return torch.empty(n, dtype=torch.uint8)

    return PinnedPool(bound, allocate), pinned


def test_rows_given_back_are_reused_without_pinning_again() -> None:
    pool, pinned = _pool(1 << 20)
    a = pool.take(1000)
    pool.give(a[:1000].view(10, 100))  # a view starting at the buffer gives it back
    b = pool.take(900)
    assert b.data_ptr() == a.data_ptr() and pinned == [MIN_BUFFER_BYTES]
    assert pool.pinned_bytes() == MIN_BUFFER_BYTES and pool.lent_bytes() == MIN_BUFFER_BYTES


def test_the_bound_turns_a_take_away_while_others_hold_rows() -> None:
    pool, _ = _pool(4 * MIN_BUFFER_BYTES)
    held = pool.take(2 * MIN_BUFFER_BYTES)
    with pytest.raises(StagingFull):
        pool.take(4 * MIN_BUFFER_BYTES)
    assert pool.pinned_bytes() == 2 * MIN_BUFFER_BYTES  # nothing pinned for the refused take
    pool.give(held)
    big = pool.take(4 * MIN_BUFFER_BYTES)  # the free buffer of another class is unpinned for it
    assert pool.pinned_bytes() == 4 * MIN_BUFFER_BYTES
    pool.give(big)


def test_one_transfer_larger_than_the_bound_runs_alone_and_is_not_kept() -> None:
    pool, _ = _pool(MIN_BUFFER_BYTES)
    big = pool.take(3 * MIN_BUFFER_BYTES)
    assert int(big.numel()) == capacity_class(3 * MIN_BUFFER_BYTES) == 4 * MIN_BUFFER_BYTES
    pool.give(big)
    assert pool.pinned_bytes() == 0


def test_a_byte_bound_admits_up_to_its_limit_and_one_oversized_job_alone() -> None:
    bound = ByteBound(100)
    assert bound.admit(60) and bound.admit(40)
    assert not bound.admit(1)
    bound.release(60)
    bound.release(40)
    assert bound.admit(500)  # nothing held: a job larger than the bound still runs
    assert not bound.admit(1)
