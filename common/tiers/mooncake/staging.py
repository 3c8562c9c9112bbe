"""The staging arena of a Mooncake tier, and how a batch is cut into steps that fit it.

Every payload a Mooncake tier moves passes through memory the tier owns (or,
for large TCP puts, is read in place from the caller's regions): copied in
before a put, copied out after the checks of a get. So a call abandoned at
its deadline never writes into a caller's buffer later, and RDMA only sees
memory registered once at connect time.

`Staging` is one anonymous, page-aligned mapping cut into one *lane* per
worker (`runner.Lane`); a job's leader cuts its lane into `SLOTS` ring slots
(`runner.Slot`). `plan_steps` splits a batch into steps of about
`STEP_MAX_BYTES`, each fitting one slot. Sizes are bytes; every offset in a
slot is a multiple of `ALIGN`.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...identity.objects import Payload, copy_into_parts
from .runner import Lane, Slot

ALIGN = 64
"""Alignment (bytes) of every object's place in a slot."""
STEP_MAX_BYTES = 16 << 20
"""Target bytes a sub-batch (one Mooncake call) moves: a large healthy batch
shows progress well inside the deadline (not mistaken for a stall). Measured
on loopback (benchmarks/RESULTS.md): 4 and 8 MiB steps were slower than 16 MiB
(more calls), 64 MiB no faster."""
SLOTS = 2
"""Ring slots per job: the leader transfers one while a helper prepares the next
(put) or checks and copies out the previous one (get)."""


class Staging:
    """`workers` lanes of ``staging_size // workers`` bytes (rounded down to `ALIGN`).

    `address`/`nbytes` is what the connection registers with Mooncake. The
    mapping lives as long as this object: a tier whose client was leaked at
    close (a stuck call may still use it) must keep it alive."""

    def __init__(self, staging_size: int, workers: int) -> None:
        lane_bytes = staging_size // workers // ALIGN * ALIGN
        self._map = mmap.mmap(-1, lane_bytes * workers)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.address: int = self.array.ctypes.data
        self.nbytes: int = self.array.nbytes
        self.lane_bytes = lane_bytes
        self.lanes = [
            Lane(i, self.array[i * lane_bytes : (i + 1) * lane_bytes], self.address + i * lane_bytes)
            for i in range(workers)
        ]

    def slot_bytes(self, budgets: Sequence[int]) -> int:
        """Bytes of each ring slot for a call: a step's worth, or the largest object, within a lane."""
        want = max(STEP_MAX_BYTES + STEP_MAX_BYTES // 4, max(budgets, default=0))
        return min(want, self.lane_bytes // SLOTS) // ALIGN * ALIGN


def slot_buffers(slot: Slot, idx: Sequence[int], budgets: Sequence[int]) -> tuple[list[Any], list[int]]:
    """Per item of a step: a staging view of `budgets[i]` bytes and its address,
    packed from the slot's start (a private buffer for an item larger than the
    rest of the slot: TCP only, RDMA would need it registered)."""
    views: list[Any] = []
    addrs: list[int] = []
    off = 0
    cap = slot.view.nbytes
    view, base = slot.view, slot.address
    for i in idx:
        b = budgets[i]
        if off + b <= cap:
            views.append(view[off : off + b])
            addrs.append(base + off)
            off += b
        else:
            own = np.empty(b, dtype=np.uint8)
            views.append(own)
            addrs.append(own.ctypes.data)
    return views, addrs


def copy_out(dst: Payload, staged: Any, src_addr: int, header_len: int, n: int) -> None:
    """Copy a staged payload (at `src_addr`; bytes `header_len:n` of `staged`) into
    the caller's regions, in order."""
    parts = (dst,) if isinstance(dst, memoryview) else dst
    try:
        addrs = [ctypes.addressof(ctypes.c_char.from_buffer(p)) if p.nbytes else 0 for p in parts]
    except (TypeError, ValueError, BufferError):  # not a plain writable buffer: the general copy
        copy_into_parts(dst, np.asarray(staged)[header_len:n])
        return
    for p, a in zip(parts, addrs):
        nb = p.nbytes
        if nb:
            ctypes.memmove(a, src_addr, nb)
        src_addr += nb


def round_up(n: int) -> int:
    """`n` rounded up to a multiple of `ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_steps(
    slot_budgets: Sequence[int], xfer_bytes: Sequence[int], slot_cap: int, step_bytes: int
) -> list[list[int]]:
    """Split items (in order) into steps whose staging fits one slot of `slot_cap`
    bytes and whose transfers are about `step_bytes` each (even steps, up to a
    quarter over the target: 64 MiB of 64 KiB objects plus headers in 8 MiB
    steps is 8 calls, not 8 full ones and a tiny ninth). An item larger than a
    slot is a step of its own (it gets a private buffer)."""
    total = sum(xfer_bytes)
    parts = max(round(total / step_bytes), 1)
    if total > parts * step_bytes * 5 // 4:
        parts += 1
    step_cap = -(-total // parts) + max(xfer_bytes, default=0)
    steps: list[list[int]] = []
    cur: list[int] = []
    used = moved = 0
    for i, (b, x) in enumerate(zip(slot_budgets, xfer_bytes)):
        if cur and (used + b > slot_cap or moved + x > step_cap):
            steps.append(cur)
            cur, used, moved = [], 0, 0
        cur.append(i)
        used += b
        moved += x
    if cur:
        steps.append(cur)
    return steps
