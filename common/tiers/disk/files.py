"""The bytes of one disk-tier object file: header, zero padding to `PAGE`, payload.

Reading checks everything a file can lie about before its payload is used:
the header (`kvpack.identity.objects.decode_header`, `check_header`), the destination
length, and the file's real size against ``data_offset + payload_len`` (a
header claiming more payload than the file holds is TRUNCATED).
"""

from __future__ import annotations

import os

from ...identity.objects import (
    HEADER_PREFIX_BYTES,
    Expectation,
    HeaderFastPath,
    ObjectHeader,
    RejectReason,
    check_header,
    decode_header,
    header_length,
)
from ..base import GetResult, TierStatus

SUFFIX = ".kvp"
PAGE = 4096


def data_offset(header_len: int) -> int:
    """Byte offset of the payload in a file whose header is `header_len` bytes."""
    return -(-header_len // PAGE) * PAGE


def read_header_fd(fd: int) -> ObjectHeader:
    prefix = os.pread(fd, HEADER_PREFIX_BYTES, 0)
    total = header_length(prefix)
    return decode_header(os.pread(fd, total, 0))


def read_verified(
    fd: int, parts: tuple[memoryview, ...], exp: Expectation, fast: HeaderFastPath | None = None
) -> GetResult:
    """Header and payload of one open file into the destination `parts`;
    raises ObjectRejected on a bad header.

    Objects without token ids (every full chunk) have a header length known
    from the key, so header and payload arrive in one `preadv`; their header is
    checked by `fast` (one per batch) when it is exactly the one `exp` predicts,
    else decoded and checked field by field."""
    size = os.fstat(fd).st_size
    want = sum([p.nbytes for p in parts])
    reason: RejectReason | None = None
    if size == PAGE + want:
        head = bytearray(PAGE)
        got = os.preadv(fd, [head, *parts], 0)
        raw = memoryview(head)
        hit = fast.check(raw, header_length(raw[:HEADER_PREFIX_BYTES]) + want, exp) if fast is not None else None
        header = hit[0] if hit is not None else decode_header(head)
        reason = None if hit is not None else check_header(header, exp)
        payload_got = got - PAGE
        offset = PAGE
    else:
        prefix = os.pread(fd, HEADER_PREFIX_BYTES, 0)
        total = header_length(prefix)
        header = decode_header(os.pread(fd, total, 0))
        reason = check_header(header, exp)
        payload_got = -1
        offset = data_offset(total)
    if reason is not None:
        return GetResult(TierStatus.REJECTED, header, reason)
    if want != header.payload_len:
        return GetResult(
            TierStatus.REJECTED, header, RejectReason.LENGTH, f"payload {header.payload_len} bytes, destination {want}"
        )
    if size != offset + header.payload_len:
        return GetResult(TierStatus.REJECTED, header, RejectReason.TRUNCATED, f"file of {size} bytes")
    if payload_got < 0:
        payload_got = preadinto_full(fd, parts, offset)
    if payload_got != header.payload_len:
        return GetResult(
            TierStatus.REJECTED, header, RejectReason.TRUNCATED, f"{payload_got} of {header.payload_len} bytes"
        )
    return GetResult(TierStatus.OK, header)


def preadinto_full(fd: int, parts: tuple[memoryview, ...], offset: int) -> int:
    got = 0
    for part in parts:
        done = 0
        while done < part.nbytes:
            n = os.preadv(fd, [part[done:]], offset + got + done)
            if not n:
                return got + done
            done += n
        got += done
    return got


IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
"""Most buffers one ``writev`` takes (more is EINVAL)."""


def write_all(fd: int, buffers: list[bytes | memoryview]) -> None:
    views = [memoryview(b) for b in buffers]
    while views:
        n = os.writev(fd, views[:IOV_MAX])
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
