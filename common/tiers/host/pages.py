"""The host store's shared memory: one arena file, mapped once per process, cut in fixed pages.

``<root>/.kvpack-store.arena`` (tmpfs) holds `Geometry.pages` stamps (8 bytes each),
padded to 4 KiB, then the pages, `Geometry.page_bytes` each. The file is allocated
whole when it is made (``posix_fallocate``: tmpfs holds the budget from then on, and
a later write through the mapping can never meet a full tmpfs, which would be a
SIGBUS), and every process maps it once (`SharedPages`): a load or a save is one
copy between the mapping and the caller's memory, with no system call per object.

An object is a record laid over its pages (`kvpack.tiers.host.catalog` allocates
them; any free page serves, so the byte budget never fragments): its encoded header
at byte 0, its payload at `payload_offset` (64-byte aligned). Consecutive pages are
copied as one region (`spans`).

Torn reads (what `HostTier.get_into` relies on): a page's stamp is the
generation of the object whose bytes it holds, 0 while it is being written.
A writer zeroes its pages' stamps before it writes them and sets its generation
after (`begin_writes`, `end_writes`); a reader checks that the stamps equal its
generation before it reads the header and again after it copied the payload
(`stamped_many`: a seqlock). The first check says the writer was done, the
second that nobody began rewriting the pages meanwhile (a rewrite zeroes them
first, and a stamp never returns to an old generation), so a load never returns
bytes of two objects: it answers a miss. Generations are random 63-bit numbers
(`new_generations`), never 0. On x86-64 stores become visible in program order
(the native copier fences its non-temporal stores before it returns). Elsewhere
(aarch64) the stamps' order is not guaranteed without fences Python cannot issue, so
there `ORDERED_STORES` is False and the host tier verifies every load's checksum: a torn
read is then a refusal, never wrong bytes.
"""

from __future__ import annotations

import mmap
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..private import open_file

ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")
"""Do this CPU's stores become visible in program order (x86-64's TSO)? See the module docstring."""
ARENA = ".kvpack-store.arena"
"""The arena file's name in the store folder (the marker's name plus a dot: the store's own, `fs`)."""
MIN_PAGE = 4096
MAX_PAGE = 1 << 20
TARGET_PAGES = 1 << 18
"""Pages per store the page size aims at: the free list and an object's page list stay short."""
ALIGN = 64
_STAMP_ALIGN = 4096
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)
_POPULATE_STEP = 64 << 20


@dataclass(frozen=True, slots=True)
class Geometry:
    """A store's arena: `pages` pages of `page_bytes` (a power of two, 4 KiB .. 1 MiB)."""

    page_bytes: int
    pages: int

    @staticmethod
    def for_capacity(capacity: int) -> Geometry:
        """The geometry of a store of `capacity` bytes: about `TARGET_PAGES` pages, whole pages only."""
        page = MIN_PAGE
        while page < MAX_PAGE and page * TARGET_PAGES < capacity:
            page *= 2
        return Geometry(page, max(0, capacity // page))

    @property
    def capacity(self) -> int:
        """Bytes of objects the store holds: its pages."""
        return self.page_bytes * self.pages

    @property
    def stamps_bytes(self) -> int:
        return -(-self.pages * 8 // _STAMP_ALIGN) * _STAMP_ALIGN

    @property
    def file_bytes(self) -> int:
        """The arena file's size: stamps, then pages."""
        return self.stamps_bytes + self.capacity

    def pages_for(self, record_bytes: int) -> int:
        """Pages a record of `record_bytes` takes (at least one)."""
        return max(1, -(-record_bytes // self.page_bytes))

    def charge(self, header_bytes: int, payload_bytes: int) -> int:
        """Bytes of the arena an object holds: the whole pages of its record (header, alignment, payload)."""
        return self.pages_for(payload_offset(header_bytes) + payload_bytes) * self.page_bytes


def payload_offset(header_bytes: int) -> int:
    """Where a record's payload starts, after a header of `header_bytes` (64-byte aligned)."""
    return -(-header_bytes // ALIGN) * ALIGN


def new_generations(n: int) -> list[int]:
    """`n` random generations (63-bit, never 0: a stamp of 0 means 'being written')."""
    raw = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(1)
    return [int(g) or 1 for g in raw]


def page_runs(pages: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """`pages` as (first page, count) runs of consecutive pages, in order."""
    if pages and pages[-1] - pages[0] == len(pages) - 1 and sorted(pages) == list(pages):
        return ((int(pages[0]), len(pages)),)  # the usual case: one run (no numpy)
    p = np.asarray(pages, dtype=np.int64)
    if not p.size:
        return ()
    cuts = np.flatnonzero(np.diff(p) != 1) + 1
    firsts = np.concatenate(([0], cuts))
    counts = np.diff(np.concatenate((firsts, [p.size])))
    return tuple((int(p[f]), int(c)) for f, c in zip(firsts, counts))


def spans(runs: Sequence[tuple[int, int]], page_bytes: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The bytes [lo, hi) of a record laid over the pages of `runs` (`page_runs`), as (offset in the
    page area, length) regions: one per run it touches."""
    out: list[tuple[int, int]] = []
    at = 0  # the record's byte where the current run starts
    for first, count in runs:
        end = at + count * page_bytes
        a, b = max(lo, at), min(hi, end)
        if a < b:
            out.append((first * page_bytes + a - at, b - a))
        if end >= hi:
            break
        at = end
    return out


def pair_up(dsts: Sequence[np.ndarray], srcs: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(destination piece, source piece) pairs covering two lists of flat uint8 regions of the
    same total length, in order (`kvpack.tiers.parallel.IOThreads.copy`'s pairs)."""
    pairs: list[tuple[np.ndarray, np.ndarray]] = []
    di = si = doff = soff = 0
    while di < len(dsts) and si < len(srcs):
        d, s = dsts[di], srcs[si]
        n = min(d.nbytes - doff, s.nbytes - soff)
        if n:
            pairs.append((d[doff : doff + n], s[soff : soff + n]))
        doff += n
        soff += n
        if doff == d.nbytes:
            di, doff = di + 1, 0
        if soff == s.nbytes:
            si, soff = si + 1, 0
    return pairs


def create_arena(root_fd: int, geometry: Geometry) -> None:
    """Make a new arena file of `geometry` under a temporary name, allocate it whole, and rename
    it into place (a process still mapping an older one keeps its own: no mapping is ever cut
    short). OSError (ENOSPC: tmpfs cannot hold it) leaves nothing behind."""
    temp = f"{ARENA}.{os.getpid()}-{os.urandom(4).hex()}.new"
    fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=root_fd)
    try:
        if geometry.file_bytes:
            os.posix_fallocate(fd, 0, geometry.file_bytes)
        os.rename(temp, ARENA, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    except BaseException:
        try:
            os.unlink(temp, dir_fd=root_fd)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)


def _pages_of(extents: Sequence[Sequence[tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray]:
    """(every page of the extents' runs, in order; how many pages each extent has), built with
    numpy: page ``k`` of a run starting at page ``f`` is ``f + k``."""
    firsts = [f for runs in extents for f, _ in runs]
    counts = np.asarray([c for runs in extents for _, c in runs], dtype=np.int64)
    per = np.asarray([sum(c for _, c in runs) for runs in extents], dtype=np.int64)
    starts = np.cumsum(counts) - counts
    idx = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(np.asarray(firsts, dtype=np.int64) - starts, counts)
    return idx, per


class SharedPages:
    """This process's mapping of a store's arena (see the module docstring). Not a lock: the
    index (`kvpack.tiers.host.catalog`) decides which pages an object owns."""

    def __init__(self, root_fd: int, geometry: Geometry) -> None:
        """Map the arena file of the store folder `root_fd`; OSError when it is missing, not a
        regular file of this user's alone (checked on the descriptor mapped: `private.open_file`),
        or not `geometry`'s size."""
        self.geometry = geometry
        fd = open_file(root_fd, ARENA, os.O_RDWR, ARENA, create=False)  # this user's alone (NotPrivate)
        try:
            st = os.fstat(fd)
            if st.st_size != geometry.file_bytes:
                raise OSError(f"{ARENA}: not a regular file of {geometry.file_bytes} bytes")
            size = max(geometry.file_bytes, 1)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._populate()
        whole = np.frombuffer(self._map, dtype=np.uint8)
        self.stamps = whole[: geometry.stamps_bytes].view(np.uint64)[: geometry.pages]
        self.area = whole[geometry.stamps_bytes : geometry.file_bytes]
        """The pages, as one flat uint8 array over the mapping."""

    def _populate(self) -> None:
        """Map every page now (in `_POPULATE_STEP` steps), so no load pays a page fault; skipped where
        the kernel has no ``MADV_POPULATE_WRITE`` (the first touch of each page maps it instead)."""
        if _MADV_POPULATE_WRITE is None:
            return
        size = len(self._map)
        for lo in range(0, size, _POPULATE_STEP):
            try:
                self._map.madvise(_MADV_POPULATE_WRITE, lo, min(_POPULATE_STEP, size - lo))
            except OSError:
                return

    # -- records ---------------------------------------------------------------------

    def regions(self, runs: Sequence[tuple[int, int]], lo: int, hi: int) -> list[np.ndarray]:
        """The bytes [lo, hi) of the record on the pages of `runs`, as views of the mapping (no copy)."""
        area = self.area
        return [area[off : off + n] for off, n in spans(runs, self.geometry.page_bytes, lo, hi)]

    def read_bytes(self, runs: Sequence[tuple[int, int]], lo: int, hi: int) -> bytes:
        """A copy of the bytes [lo, hi) of the record on the pages of `runs` (a header: small)."""
        return b"".join(r.tobytes() for r in self.regions(runs, lo, hi))

    def stamped_many(self, extents: Sequence[Sequence[tuple[int, int]]], generations: Sequence[int]) -> list[bool]:
        """Per extent (its runs; each of at least one page): do all its pages hold its generation now?
        A few numpy calls per batch."""
        idx, per = _pages_of(extents)
        if not idx.size:
            return [True] * len(extents)
        same = self.stamps[idx] == np.repeat(np.asarray(generations, dtype=np.uint64), per)
        return [bool(x) for x in np.logical_and.reduceat(same, np.cumsum(per) - per)]

    def begin_writes(self, extents: Sequence[Sequence[tuple[int, int]]]) -> None:
        """Mark every page of a batch's extents as being written (stamp 0): a reader of what they held
        before stops trusting them (its check after the copy fails)."""
        idx, _ = _pages_of(extents)
        self.stamps[idx] = 0

    def end_writes(self, extents: Sequence[Sequence[tuple[int, int]]], generations: Sequence[int]) -> None:
        """Every page of each extent now holds the whole record of that extent's generation."""
        idx, per = _pages_of(extents)
        self.stamps[idx] = np.repeat(np.asarray(generations, dtype=np.uint64), per)

    def stamped(self, runs: Sequence[tuple[int, int]], generation: int) -> bool:
        """Do all pages of `runs` hold generation `generation` now?"""
        stamps, gen = self.stamps, np.uint64(generation)
        return all(bool((stamps[first : first + count] == gen).all()) for first, count in runs)

    def close(self) -> None:
        """Unmap, once nothing of this process still views the mapping (else the kernel unmaps it at exit)."""
        self.stamps = np.empty(0, np.uint64)
        self.area = np.empty(0, np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass
