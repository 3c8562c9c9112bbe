"""Object-file reads of the disk tier, a batch at a time: the native reader for every full chunk.

`read_batch` reads a batch's objects with the extension's ``read_objects``
(`kvpack.ops.object_reader`): every file is opened beneath the store root
(``openat2``, no symlink followed), checked to be a regular file and, when its
size is exactly a header page plus the destination's bytes (the file of every
full chunk, whose header length the key decides), read whole with one ``preadv``,
and, when the checksum is to be verified, its payload hashed right after its read
(xxh3_64, while the bytes are still in the CPU's cache), all with the GIL released
once. Then, per object with the GIL held, the header is compared with the bytes its
`Expectation` predicts (`HeaderFastPath`) and the digest with the header's
checksum. Any other object (not found: a miss;
anything else: a tail with token ids, a header that is not the predicted one, a
checksum that does not match, a refused or odd file) goes to the caller's own
single-object read (`slow`), which decides, counts and refuses exactly as it
does without the native reader: this module only answers the objects that are
plainly whole and right.

Why: one object read from Python costs about 30 us of interpreter work (the
``openat2`` through ctypes, ``fstat``, ``preadv``, each giving the GIL up and
taking it back) against 1-2 us in C; SGLang's L3 gets are a dozen pages a call.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence

from ...identity.keys import StoreKey
from ...identity.objects import (
    HEADER_PREFIX_BYTES,
    Expectation,
    HeaderFastPath,
    ObjectRejected,
    Payload,
    header_length,
    payload_parts,
)
from ...ops.natives import ObjectReader
from ..base import GetResult, TierStatus
from . import fs
from .files import PAGE
from .paths import rel_file

_PAYLOAD_FROM = 1
"""Index of an object's first payload part in its read: part 0 is the header page."""

_MISS = GetResult(TierStatus.MISS)


def read_batch(
    root_fd: int,
    keys: Sequence[StoreKey],
    dsts: Sequence[Payload],
    expected: Sequence[Expectation],
    verify_checksum: bool,
    native: ObjectReader,
    slow: Callable[[int], GetResult],
) -> list[GetResult]:
    """One `GetResult` per key: read natively and checked here when whole and right, a miss when
    the file is not there, else ``slow(i)`` (see the module docstring). Never raises for a
    file-system failure (``slow`` answers those)."""
    if not fs.openat2_in_use():
        return [slow(i) for i in range(len(keys))]
    n = len(keys)
    heads = memoryview(bytearray(PAGE * n))
    parts = [payload_parts(d) for d in dsts]
    jobs = [(rel_file(k).encode(), (heads[i * PAGE : (i + 1) * PAGE], *parts[i])) for i, k in enumerate(keys)]
    fast = HeaderFastPath()
    out: list[GetResult | None] = []
    for i, (err, size, got, digest) in enumerate(native(root_fd, jobs, _PAYLOAD_FROM if verify_checksum else -1)):
        if err == errno.ENOENT:
            out.append(_MISS)
            continue
        whole = err == 0 and got >= 0 and got == size
        hit = _header_ok(heads[i * PAGE : (i + 1) * PAGE], parts[i], expected[i], fast) if whole else None
        if hit is not None and verify_checksum and hit.header is not None and hit.header.checksum not in (None, digest):
            hit = None  # damaged payload: the single-object read refuses and counts it
        out.append(hit)
    return [r if r is not None else slow(i) for i, r in enumerate(out)]


def _header_ok(
    head: memoryview, parts: tuple[memoryview, ...], exp: Expectation, fast: HeaderFastPath
) -> GetResult | None:
    """OK when `head` is the header `exp` predicts for a payload of `parts`' bytes, else None."""
    want = sum([p.nbytes for p in parts])
    try:
        hit = fast.check(head, header_length(head[:HEADER_PREFIX_BYTES]) + want, exp)
    except ObjectRejected:
        return None
    return GetResult(TierStatus.OK, hit[0]) if hit is not None else None
