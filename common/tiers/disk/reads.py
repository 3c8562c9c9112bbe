"""Object-file reads of the disk tier, a batch at a time: the native reader for every full chunk.

`read_batch` reads a batch's objects with the extension's ``read_objects``
(`kvpack.ops.object_reader`): every file is opened beneath the store root
(``openat2``, no symlink followed), checked to be a regular file and, when its
size is exactly a header page plus the destination's bytes (the file of every
full chunk, whose header length the key decides), read whole with one ``preadv``,
all with the GIL released once. Then, per object with the GIL held, the header is
compared with the bytes its `Expectation` predicts (`HeaderFastPath`), then, if
asked, the checksums of the batch's payloads are verified in one `check_payloads`. Any other object (not found: a miss;
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

from ...keys import StoreKey
from ...objects import (
    HEADER_PREFIX_BYTES,
    Expectation,
    HeaderFastPath,
    ObjectRejected,
    Payload,
    check_payloads,
    header_length,
    payload_parts,
)
from ..base import GetResult, TierStatus
from . import fs
from .files import PAGE
from .paths import rel_file

ObjectReader = Callable[[int, Sequence[tuple[bytes, Sequence[memoryview]]]], list[tuple[int, int, int]]]
"""Native ``read_objects(root_fd, [(path, parts)])``: one (errno, size, bytes read or -1) per object."""

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
    for i, (err, size, got) in enumerate(native(root_fd, jobs)):
        if err == errno.ENOENT:
            out.append(_MISS)
            continue
        whole = err == 0 and got >= 0 and got == size
        out.append(_header_ok(heads[i * PAGE : (i + 1) * PAGE], parts[i], expected[i], fast) if whole else None)
    if verify_checksum:
        ok = [i for i, r in enumerate(out) if r is not None and r.ok]
        headers = [out[i].header for i in ok]  # type: ignore[union-attr]
        for i, bad in zip(ok, check_payloads(headers, [parts[i] for i in ok])):  # type: ignore[arg-type]
            if bad is not None:
                out[i] = None
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
