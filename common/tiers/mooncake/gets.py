"""Reads from Mooncake: contains, header peeks, and checked, staged loads into caller buffers.

`Gets.get_into` stages each object (header + payload) in the leader's slot
with one ``batch_get_into`` per step, checks it there (the header against
the reader's `Expectation`, the byte count against the header, the payload
checksum when asked) and only then copies accepted payloads into the
caller's regions, while the job is not abandoned. Mooncake's ``get`` (b''
for a miss and for any error alike) is never used. An object refused for an
integrity reason is marked so that the next put of its key overwrites it.

The staging budget of an object is its payload plus
`HeaderFastPath.read_budget` (a tail's header, which carries all its token ids,
is budgeted at the most a header can be). An object still larger than its
budget (Mooncake answers INVALID_PARAMS) is read once more at its exact size.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import methodcaller
from typing import Any

import numpy as np

from ...identity.keys import StoreKey
from ...identity.objects import (
    HEADER_PREFIX_BYTES,
    Expectation,
    HeaderFastPath,
    ObjectHeader,
    ObjectRejected,
    Payload,
    RejectReason,
    check_header,
    check_payload,
    decode_header,
    header_length,
    payload_nbytes,
)
from ..base import GetResult, TierStatus
from .codes import INVALID_PARAMS, NOT_CALLED, OBJECT_NOT_FOUND, code_info, describe
from .connection import Connection
from .puts import OverwriteKeys
from .runner import Job, Slot
from .staging import ALIGN, SLOTS, STEP_MAX_BYTES, Staging, copy_out, plan_steps, round_up, slot_buffers

PEEK_BYTES = 4096
"""Bytes read per key by a header peek's first round (a longer header gets a second)."""
RETRY_EXTRA_BYTES = 64 << 10
"""An object at most this much over its budget is read again at its exact size."""
OVERWRITE_REASONS = frozenset(
    {
        # The key names tenant, layout, chunk and member: an object under it that
        # disagrees, or is damaged, is garbage, and the next put replaces it.
        RejectReason.FINGERPRINT,
        RejectReason.TENANT,
        RejectReason.GROUP,
        RejectReason.MEMBER,
        RejectReason.TRUNCATED,
        RejectReason.BAD_MAGIC,
        RejectReason.VERSION,
        RejectReason.HEADER_CHECKSUM,
        RejectReason.LENGTH,
        RejectReason.CHECKSUM,
    }
)
"""Refusals after which the next put of that key overwrites (upserts) what Mooncake holds.
Wider than `kvpack.store.reads.INTEGRITY_REASONS` (damaged bytes, whose group the store removes):
under a content-addressed key, anything that disagrees with the key is garbage to replace."""


class Gets:
    """The read side of a `MooncakeTier` (see the module docstring)."""

    def __init__(self, conn: Connection, staging: Staging, overwrite: OverwriteKeys) -> None:
        self._conn = conn
        self._staging = staging
        self._overwrite = overwrite

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        conn = self._conn
        if not keys or conn.refusal() is not None:
            return [False] * len(keys)
        names = [k.as_str() for k in keys]

        def step(job: Job[list[int]], slot: Slot, i: int) -> None:
            codes = conn.call(lambda s: list(s.batch_is_exist(names)), default=[NOT_CALLED] * len(names))
            job.publish(i, [0], [codes])

        state, results = conn.run(Job(1, 1, step))
        codes = results[0]
        if codes is None or len(codes) != len(keys):
            return [False] * len(keys)
        conn.note_codes(codes)
        return [c == 1 for c in codes]

    def peek_headers(self, keys: Sequence[StoreKey]) -> list[ObjectHeader | None]:
        if not keys or self._conn.refusal() is not None:
            return [None] * len(keys)
        names = [k.as_str() for k in keys]
        n = len(names)

        def step(job: Job[ObjectHeader | None], slot: Slot, i: int) -> None:
            job.publish(i, list(range(n)), self._peek_on_worker(names, slot))

        state, results = self._conn.run(Job(n, 1, step))
        return list(results)

    def _peek_on_worker(self, names: list[str], lane: Slot) -> list[ObjectHeader | None]:
        conn = self._conn
        lane_bytes = self._staging.lane_bytes
        out: list[ObjectHeader | None] = [None] * len(names)
        # one batched look first: most keys peeked (tail slots) are absent, and each
        # get_size is a master round trip on the engine's scheduler thread
        there = conn.call(lambda s: list(s.batch_is_exist(names)), default=[NOT_CALLED] * len(names))
        conn.note_codes(there)
        sizes = [
            int(conn.call(methodcaller("get_size", k), default=NOT_CALLED)) if e == 1 else OBJECT_NOT_FOUND
            for k, e in zip(names, there)
        ]
        conn.note_codes([sz for sz, e in zip(sizes, there) if e == 1])
        todo = [i for i, sz in enumerate(sizes) if sz >= HEADER_PREFIX_BYTES]
        slot = PEEK_BYTES
        todo = todo[: max(1, lane_bytes // slot)]
        for _ in range(2):  # second round for headers longer than the first read
            if not todo:
                break
            want = [min(sizes[i], slot) for i in todo]
            rc = conn.call(
                lambda s: s.get_into_ranges(
                    [lane.address],
                    [[names[i] for i in todo]],
                    [[[j * slot] for j in range(len(todo))]],
                    [[[0] for _ in todo]],
                    [[[w] for w in want]],
                ),
                default=None,
            )
            if rc is None:
                return out
            retry: list[int] = []
            for j, i in enumerate(todo):
                got = rc[0][j][0]
                if got < 0:
                    continue
                raw = lane.view[j * slot : j * slot + got]
                try:
                    out[i] = decode_header(bytes(raw))
                except ObjectRejected as exc:
                    if exc.reason is RejectReason.TRUNCATED and got < sizes[i]:
                        retry.append(i)
            todo = retry
            slot = min(lane_bytes // max(1, len(todo)) // ALIGN * ALIGN, 64 << 10) if todo else slot
        return out

    def get_into(
        self,
        keys: Sequence[StoreKey],
        dsts: Sequence[Payload],
        expected: Sequence[Expectation],
        verify_checksum: bool,
    ) -> list[GetResult]:
        if not keys:
            return []
        refused = self._conn.refusal()
        if refused is not None:
            return [GetResult(refused, detail="mooncake tier not available") for _ in keys]
        names = [k.as_str() for k in keys]
        budgets = [round_up(payload_nbytes(d) + HeaderFastPath.read_budget(e)) for d, e in zip(dsts, expected)]
        slot_bytes = self._staging.slot_bytes(budgets)
        steps = plan_steps(budgets, budgets, slot_bytes, STEP_MAX_BYTES)
        staged: dict[int, tuple[list[Any], list[int], list[int]]] = {}
        """Per step, from its transfer to its finish: staging views, addresses, byte counts."""

        def transfer(job: Job[GetResult], slot: Slot, s: int) -> None:
            staged[s] = self._transfer(slot, steps[s], names, budgets)

        def finish(job: Job[GetResult], slot: Slot, s: int) -> None:
            views, addrs, got = staged.pop(s)
            self._finish(job, s, steps[s], views, addrs, got, dsts, expected, verify_checksum)

        job: Job[GetResult] = Job(len(keys), len(steps), transfer, finish=finish, slots=SLOTS, slot_bytes=slot_bytes)
        state, results = self._conn.run(job)
        timeout_ms = self._conn.config.timeout_ms
        out = [
            r if r is not None else GetResult(TierStatus.TIMEOUT, detail=f"no answer within {timeout_ms} ms")
            for r in results
        ]
        for key, res in zip(names, out):
            if res.status is TierStatus.REJECTED and res.reason in OVERWRITE_REASONS:
                self._overwrite.mark(key)
        return out

    def _transfer(
        self, slot: Slot, idx: list[int], names: list[str], budgets: Sequence[int]
    ) -> tuple[list[Any], list[int], list[int]]:
        """The Mooncake calls of one get step, into its slot: (views, addresses, codes or byte counts)."""
        conn = self._conn
        views, addrs = slot_buffers(slot, idx, budgets)
        step_names = [names[i] for i in idx]
        got = conn.call(
            lambda s: list(s.batch_get_into(step_names, addrs, [budgets[i] for i in idx])),
            default=[NOT_CALLED] * len(idx),
        )
        # Objects larger than their budget: once more at their exact size.
        small = [j for j, g in enumerate(got) if g == INVALID_PARAMS]
        for j in small:
            size = int(conn.call(lambda s: s.get_size(step_names[j]), default=NOT_CALLED))
            if 0 < size <= budgets[idx[j]] + RETRY_EXTRA_BYTES:
                own = np.empty(size, dtype=np.uint8)
                views[j] = own
                addrs[j] = own.ctypes.data
                got[j] = int(
                    conn.call(
                        lambda s: s.batch_get_into([step_names[j]], [own.ctypes.data], [size])[0], default=NOT_CALLED
                    )
                )
        conn.note_codes(got)
        return views, addrs, got

    def _finish(
        self,
        job: Job[GetResult],
        step: int,
        idx: list[int],
        views: list[Any],
        addrs: list[int],
        got: list[int],
        dsts: Sequence[Payload],
        expected: Sequence[Expectation],
        verify: bool,
    ) -> None:
        """Check every staged object of a step, copy the accepted ones out, publish."""
        # Every check runs on the staged bytes, before any caller memory is touched.
        fast = HeaderFastPath()
        results: list[GetResult] = []
        copies: list[tuple[int, int]] = []  # (position in step, payload offset in its staging view)
        for j, i in enumerate(idx):
            res, header_len = check_staged(got[j], views[j], dsts[i], expected[i], verify, fast)
            results.append(res)
            if res.status is TierStatus.OK:
                copies.append((j, header_len))
        if copies:
            if not job.begin_copy():
                return  # the caller gave up: caller buffers are not ours any more
            try:
                for j, header_len in copies:
                    copy_out(dsts[idx[j]], views[j], addrs[j] + header_len, header_len, got[j])
            finally:
                job.end_copy()
        job.publish(step, idx, results)


def check_staged(
    n: int, staged: Any, dst: Payload, exp: Expectation, verify: bool, fast: HeaderFastPath
) -> tuple[GetResult, int]:
    """The outcome of one staged object of `n` bytes (or a negative code) and its
    header length; OK means its payload may be copied into `dst`."""
    if n < 0:
        info = code_info(n)
        if n == INVALID_PARAMS:
            return GetResult(TierStatus.REJECTED, None, RejectReason.LENGTH, "object larger than its destination"), 0
        if info.status is TierStatus.REJECTED:
            return GetResult(TierStatus.REJECTED, None, RejectReason.CHECKSUM, describe(n)), 0
        return GetResult(info.status, detail=describe(n)), 0
    raw = memoryview(staged)[:n]
    hit = fast.check(raw, n, exp)
    if hit is not None:
        header, header_len = hit
    else:  # the full decode: names the exact reason when something differs
        try:
            header = decode_header(raw)
        except ObjectRejected as exc:
            return GetResult(TierStatus.REJECTED, None, exc.reason, str(exc)), 0
        reason = check_header(header, exp)
        if reason is not None:
            return GetResult(TierStatus.REJECTED, header, reason), 0
        header_len = header_length(raw)
        if n != header_len + header.payload_len:
            return GetResult(
                TierStatus.REJECTED,
                header,
                RejectReason.TRUNCATED,
                f"{n} bytes for a {header.payload_len}-byte payload",
            ), 0
    if payload_nbytes(dst) != header.payload_len:
        return (
            GetResult(
                TierStatus.REJECTED,
                header,
                RejectReason.LENGTH,
                f"payload {header.payload_len} bytes, destination {payload_nbytes(dst)}",
            ),
            0,
        )
    if verify and (bad := check_payload(header, raw[header_len:])) is not None:  # the staged bytes, before the copy
        return GetResult(TierStatus.REJECTED, header, bad), 0
    return GetResult(TierStatus.OK, header), header_len
