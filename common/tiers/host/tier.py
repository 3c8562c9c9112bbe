"""The host memory tier: one store in the host's shared memory, shared by every kvpack process.

`HostTier` keeps the disk tier's index and policy (`kvpack.tiers.disk.DiskTier`: the shared
SQLite index with its one budget, LRU over groups, tenant shares) and puts the objects in one
arena file on tmpfs (`kvpack.tiers.host.pages`), allocated whole when the store is made and
mapped once by every process. So every process on the host reads and writes one set of objects
under one `capacity` (the arena's size: the budget is held from the start, never exceeded), and:

- a load is one copy, from the mapping straight into the destination, with no system call per
  object; a save is one copy, from the source into the object's pages (`IOThreads.copy`: native
  and GIL-free when the extension is loaded, on `io_threads` threads). Checksums
  (`ChecksumPolicy.BOUNDARY`: the objects cross processes) and the integrity key apply as on the
  disk tier;
- `capacity` counts whole pages (`Geometry.charge`): what an object holds of the arena;
- an object's pages are allocated in the index when it is admitted (`HostCatalog.admit_pages`),
  written (stamps 0, bytes, stamps = its generation), then marked ready in one transaction
  (`HostCatalog.finish`: only by its own writer). A load checks the pages' stamps before it
  reads and after it copied (`SharedPages.stamped_many`, a seqlock): an object whose pages were
  meanwhile given to another is a miss (counted in `torn`), never a mixed one, never a refusal;
- a process killed mid-store leaves no lock held (``flock`` and SQLite's locks die with it) and
  its pages come back when the next process opens the store or finds it full (`reclaim_dead`):
  the groups it was writing are unindexed, and the pages of its puts freed.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError
from ...identity.keys import GroupKey, StoreKey
from ...identity.objects import (
    HEADER_PREFIX_BYTES,
    Expectation,
    HeaderFastPath,
    ObjectHeader,
    ObjectRejected,
    Payload,
    RejectReason,
    check_header,
    check_payloads,
    decode_header,
    header_length,
    payload_parts,
)
from ..base import GetResult, Medium, PutItem, TierStatus, checksummed
from ..disk import DiskTier
from ..disk.catalog import Catalog, IndexBusy, open_catalog
from ..disk.fs import SHM, open_store_root
from ..disk.rows import Victim, group_id
from ..disk.tier import sort_puts
from ..parallel import CopyPair, RegionCopier
from .catalog import FIELD, Extent, HostCatalog, writer_name
from .owners import Owner, dead_owners
from .pages import ORDERED_STORES, Geometry, SharedPages, pair_up, payload_offset
from .place import host_root
from .stores import give_back, is_at, lock_folder

log = logging.getLogger("kvpack")

__all__ = ["FIELD", "HostTier"]


class HostTier(DiskTier):
    name = "host"
    medium = Medium.HOST
    front = True

    def __init__(
        self,
        host_name: str,
        capacity: int,
        quotas: dict[str, int] | None = None,
        io_threads: int = 1,
        *,
        shm: str = SHM,
        busy_timeout_s: float = 10.0,
        region_copier: Callable[[], RegionCopier | None] | None = None,
        give_back_unused: bool = False,
        asked_for: bool | None = None,
    ) -> None:
        """Open (or create) host store `host_name` in `shm` (`place.host_root`) with an arena of
        `capacity` bytes for every process on it (an existing store keeps the size it was made
        with: `capacity_bytes`); reclaims what dead processes held. ConfigError naming
        ``memory.mode`` when the folder is not one kvpack may use or tmpfs cannot hold the arena.
        `give_back_unused`: the last user to close the store drops it (`stores.give_back`; a
        store ``memory.mode: auto`` chose). `asked_for` (default: not `give_back_unused`): a user
        asked for the store (``memory.mode: host``), so it persists; False for a tool's visit."""
        self._owner: Owner | None = None
        self._unfinished: list[str] = []
        """Writers whose put's end (`HostCatalog.finish`) failed: ended by a later put."""
        self._name, self._shm, self._give_back = host_name, shm, give_back_unused
        self._asked = capacity
        self.reclaimed = 0
        """Groups this process took back from dead writers (`reclaim_dead`)."""
        self.torn = 0
        """Loads that found their object's pages given to another object meanwhile (answered a miss)."""
        super().__init__(
            host_root(host_name, shm),
            capacity,
            quotas,
            False,
            io_threads,
            busy_timeout_s=busy_timeout_s,
            region_copier=region_copier,
        )
        catalog = self._host_catalog
        if (not give_back_unused) if asked_for is None else asked_for:
            catalog.mark_kept()  # asked for: no last user of an `auto` process gives it back
        self._capacity_bytes = catalog.geometry.capacity
        if catalog.geometry.capacity != Geometry.for_capacity(capacity).capacity:
            log.warning(
                "kvpack: host store %s holds %d MiB (the size it was made with); memory.capacity %d MiB is not used",
                host_name,
                catalog.geometry.capacity >> 20,
                capacity >> 20,
            )
        try:
            self._pages = SharedPages(self._root_fd, catalog.geometry)
        except OSError as exc:
            self.close()
            raise ConfigError(FIELD, f"host store {host_name}: {exc} (drop it: kvpack host drop {host_name})") from None

    # -- DiskTier's hooks -----------------------------------------------------------

    def _open_root(self, path: str) -> tuple[str, int]:
        """The store folder, held under its shared ``flock`` until this process's owner file is in
        place (`_open_catalog`): a last user giving the store back (`stores.give_back`) waits for
        it, or has renamed the folder aside, and then this opens the path again."""
        for _ in range(8):
            real, fd = open_store_root(path, FIELD, shm=True)
            if lock_folder(fd, fcntl.LOCK_SH, 10.0) and is_at(fd, real):
                return real, fd
            os.close(fd)
        raise ConfigError(FIELD, f"{path}: the host store kept being dropped while this process opened it")

    def _open_catalog(self, busy_timeout_s: float) -> Catalog:
        root_fd, asked = self._root_fd, self._asked

        def make(path: str, timeout_s: float) -> Catalog:
            return HostCatalog(path, timeout_s, capacity=asked, root_fd=root_fd)

        catalog = open_catalog(self._root_str, self._root_fd, busy_timeout_s, FIELD, make, private_root=True)
        assert isinstance(catalog, HostCatalog)
        self._owner = Owner(self._root_fd, on_fork=self._register_child)
        fcntl.flock(self._root_fd, fcntl.LOCK_UN)  # a user now: `_open_root`'s shared lock is done
        catalog.owner = self._owner.token
        return catalog

    def _register_child(self) -> None:
        """In a forked child (`owners.Owner.in_child`): register the child as a user of its own, so
        its writes are its own pending rows and a dead parent is not kept live by it."""
        catalog = self._host_catalog
        try:
            self._owner = Owner(self._root_fd, on_fork=self._register_child)
        except OSError:
            self._owner = None
        catalog.owner = self._owner.token if self._owner is not None else ""

    @property
    def _host_catalog(self) -> HostCatalog:
        catalog = self._catalog
        assert isinstance(catalog, HostCatalog)
        return catalog

    def _start_build(self, pace: Callable[[int], None] | None, wait_s: float) -> None:
        """No folder scan: the index is the store (it is made with its arena)."""
        self.reclaim_dead()

    def _remove_files(self, keys: Sequence[StoreKey], groups: Sequence[GroupKey], reason: str) -> None:
        """Nothing to unlink: the index freed the objects' pages when it deleted their rows."""
        if keys:
            self.counters.count_removed(reason, len(keys))

    # -- writes -----------------------------------------------------------------------

    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        """Admit the batch (pages allocated), copy each object into its pages, then mark the
        written ones ready; items refused for space are tried once more after a `reclaim_dead`
        that took something back."""
        items = checksummed(items)
        statuses = self._put(items)
        full = [i for i, s in enumerate(statuses) if s is TierStatus.NO_SPACE]
        if full and self.reclaim_dead():
            for i, status in zip(full, self._put([items[i] for i in full])):
                statuses[i] = status
        return statuses

    def _put(self, items: Sequence[PutItem]) -> list[TierStatus]:
        catalog = self._host_catalog
        statuses, sizes, by_tenant = sort_puts(items)
        if not self._finish_abandoned():  # the index is still held: no second wait for it
            self.counters.count_removed("index_busy", sum(s is TierStatus.OK for s in statuses))
            return [TierStatus.TIMEOUT if s is TierStatus.OK else s for s in statuses]
        heads = [item.header.encode() for item in items]
        charges = [catalog.geometry.charge(len(h), n) for h, n in zip(heads, sizes)]
        writer = writer_name(catalog.owner)
        victims: list[Victim] = []
        extents: dict[tuple[bytes, str], Extent] = {}
        try:
            for tenant, idx in by_tenant.items():
                requests = [(items[i].key, charges[i], items[i].accepted_ns) for i in idx]
                admitted, gone, allocated = catalog.admit_pages(tenant, requests, self._quotas, writer)
                victims += gone
                extents.update(allocated)
                for i, ok in zip(idx, admitted):
                    if not ok:
                        statuses[i] = TierStatus.NO_SPACE
        except IndexBusy:  # another process holds the index: dropped (a later miss), never a stall
            self.counters.count_removed("index_busy", sum(s is TierStatus.OK for s in statuses))
            self._abandon(items, extents, writer)
            return [TierStatus.TIMEOUT if s is TierStatus.OK else s for s in statuses]
        except Exception:  # noqa: BLE001 - an index that cannot be written: nothing is stored
            self._abandon(items, extents, writer)
            return [TierStatus.ERROR if s is TierStatus.OK else s for s in statuses]
        self._drop_victims(victims, "evicted")
        todo = [i for i, s in enumerate(statuses) if s is TierStatus.OK]
        placed = [(i, extents[(group_id(items[i].key.group), items[i].key.member)]) for i in todo]
        self._write(items, heads, placed)
        try:  # one short transaction: from now on the written objects are found (`contains`)
            still = catalog.finish([items[i].key for i in todo], writer)
        except Exception as exc:  # noqa: BLE001 - left pending: its pages go with the next put's finish
            self._unfinished.append(writer)
            busy = isinstance(exc, IndexBusy)
            if busy:
                self.counters.count_removed("index_busy", len(todo))
            failed = TierStatus.TIMEOUT if busy else TierStatus.ERROR
            return [failed if s is TierStatus.OK else s for s in statuses]
        for i, indexed in zip(todo, still):
            if not indexed:  # evicted while it was written (a later put, another process)
                statuses[i] = TierStatus.NO_SPACE
                self.counters.count_removed("evicted_while_written")
        return statuses

    def _write(self, items: Sequence[PutItem], heads: Sequence[bytes], placed: Sequence[tuple[int, Extent]]) -> None:
        """Copy each item's encoded header (`heads`) and payload into its pages, one batch of copies:
        stamps 0 before, the generation after (`kvpack.tiers.host.pages`)."""
        pages = self._pages
        pairs: list[CopyPair] = []
        pages.begin_writes([extent.runs for _, extent in placed])
        for i, extent in placed:
            head = np.frombuffer(heads[i], dtype=np.uint8)
            start = payload_offset(head.nbytes)
            pairs += pair_up(pages.regions(extent.runs, 0, head.nbytes), [head])
            src = [np.frombuffer(p, dtype=np.uint8) for p in payload_parts(items[i].payload)]
            pairs += pair_up(pages.regions(extent.runs, start, start + items[i].header.payload_len), src)
        self._io.copy(pairs, streaming=True)
        pages.end_writes([extent.runs for _, extent in placed], [extent.gen for _, extent in placed])

    def _finish_abandoned(self) -> bool:
        """End the earlier puts whose own end could not have the index in time (`HostCatalog.finish`:
        their objects, written whole, become found; their limbo pages free). False when the index is
        still held past `WRITE_LOCK_WAIT_S` (the next put tries again)."""
        while self._unfinished:
            try:
                self._host_catalog.finish([], self._unfinished[0])
            except IndexBusy:
                return False
            except Exception:  # noqa: BLE001 - an index that cannot be written: the next put tries again
                return True
            self._unfinished.pop(0)
        return True

    def _abandon(self, items: Sequence[PutItem], extents: dict[tuple[bytes, str], Extent], writer: str) -> None:
        """A put that failed after some of its admissions: unindex what it admitted and free its pages."""
        if not extents:
            return  # nothing admitted: nothing to undo (no second wait for a busy index)
        admitted = {g for g, _ in extents}
        groups = list({it.key.group: None for it in items if group_id(it.key.group) in admitted})
        try:
            self._drop_victims(self._catalog.remove_groups(groups, save=True), "failed_write")
            self._host_catalog.finish([], writer)
        except Exception:  # noqa: BLE001 - left to reclaim_dead / the grace, as a crash would be
            pass

    # -- reads ------------------------------------------------------------------------

    def get_into(
        self,
        keys: Sequence[StoreKey],
        dsts: Sequence[Payload],
        expected: Sequence[Expectation],
        verify_checksum: bool,
    ) -> list[GetResult]:
        """A seqlock over each object's pages: its stamps checked first (not yet or no longer its
        generation: a miss, `torn`), its header checked, every payload copy of the batch at once,
        then its stamps checked again (changed meanwhile: a miss) and, if asked, its checksum."""
        verify_checksum = verify_checksum or not ORDERED_STORES  # a torn read is then a refusal, never wrong bytes
        try:
            found = self._host_catalog.ready_extents(keys)
        except Exception as exc:  # noqa: BLE001 - an unreadable index: nothing is loaded
            return [GetResult(TierStatus.ERROR, detail=f"host index: {exc}")] * len(keys)
        results = [_MISS] * len(keys)
        copied: list[_Copied] = []
        fast = HeaderFastPath()
        area, page = self._pages.area, self._pages.geometry.page_bytes
        for i, extent in self._whole([(i, e) for i, e in enumerate(found) if e is not None]):
            parts = payload_parts(dsts[i])
            checked = self._header(extent, expected[i], sum(p.nbytes for p in parts), fast)
            if isinstance(checked, GetResult):
                results[i] = checked
                continue
            header, start = checked
            if len(extent.runs) == 1 and len(parts) == 1:  # the common case: one region to one buffer
                lo = extent.runs[0][0] * page + start
                pairs = [(np.frombuffer(parts[0], dtype=np.uint8), area[lo : lo + header.payload_len])]
            else:
                src = self._pages.regions(extent.runs, start, start + header.payload_len)
                pairs = pair_up([np.frombuffer(p, dtype=np.uint8) for p in parts], src)
            copied.append(_Copied(i, extent, header, parts, pairs))
        bad = self._copy(copied, verify_checksum)
        stable = self._pages.stamped_many([c.extent.runs for c in copied], [c.extent.gen for c in copied])
        for c, ok, reason in zip(copied, stable, bad):
            if not ok:  # its pages went to another object while they were copied: a miss
                self.torn += 1
                continue
            results[c.index] = GetResult(TierStatus.OK if reason is None else TierStatus.REJECTED, c.header, reason)
        hits = [k.group for k, r in zip(keys, results) if r.ok]
        if hits:
            try:
                self._catalog.touch(hits)
            except Exception:  # noqa: BLE001 - a busy index only delays the LRU order
                pass
        return results

    def lend(
        self, keys: Sequence[StoreKey], expected: Sequence[Expectation], verify_checksum: bool
    ) -> tuple[list[tuple[ObjectHeader, memoryview] | None], Callable[[], list[bool]]]:
        """A lent get: per key, the header and a read-only view of the payload in the mapping
        (no copy), when the object is ready and whole (its stamps), its header is the expected
        one and its payload lies in one run of pages; else None (the caller reads it with
        `get_into`, which counts why). Hits are touched as `get_into` touches them.

        With `verify_checksum` nothing is lent: a checksum must cover the bytes the engine reads,
        and a view's bytes can change after any check of them (any process of this user maps them
        writable), so such loads go through `get_into`, which copies into the caller's buffer
        first and verifies that copy.

        The view is shared memory another process may rewrite at any time (its pages given to
        another object), so the seqlock of `get_into` is closed by the caller: it copies out of
        the views, then calls the returned ``held()``: per key, False where the pages changed
        since the lend (counted in `torn`): what was copied is not that object, and the caller
        must treat it as a miss. On a CPU without ordered stores nothing is lent (there
        `get_into` checks every checksum after its copy instead)."""
        n = len(keys)
        out: list[tuple[ObjectHeader, memoryview] | None] = [None] * n
        if not ORDERED_STORES or verify_checksum:
            return out, lambda: [True] * n
        try:
            found = self._host_catalog.ready_extents(keys)
        except Exception:  # noqa: BLE001 - an unreadable index: the ordinary read answers
            return out, lambda: [True] * n
        fast = HeaderFastPath()
        area, page = self._pages.area, self._pages.geometry.page_bytes
        lent: list[tuple[int, Extent]] = []
        for i, extent in self._whole([(i, e) for i, e in enumerate(found) if e is not None]):
            want = expected[i].payload_len
            if len(extent.runs) != 1 or want is None:
                continue
            checked = self._header(extent, expected[i], want, fast)
            if isinstance(checked, GetResult):
                continue
            header, start = checked
            lo = extent.runs[0][0] * page + start
            out[i] = (header, area[lo : lo + header.payload_len].data.toreadonly())
            lent.append((i, extent))

        def stable() -> list[bool]:
            """Per lent object: its pages still its own (those that are not counted in `torn`)."""
            now = self._pages.stamped_many([e.runs for _, e in lent], [e.gen for _, e in lent])
            self.torn += now.count(False)
            return now

        kept = stable()
        for (i, _), ok in zip(lent, kept):
            if not ok:  # the header was read while the pages changed: no verdict
                out[i] = None
        lent = [le for le, ok in zip(lent, kept) if ok]
        if lent:
            try:
                self._catalog.touch([keys[i].group for i, _ in lent])
            except Exception:  # noqa: BLE001 - a busy index only delays the LRU order
                pass

        def held() -> list[bool]:
            verdict = [True] * n
            for (i, _), ok in zip(lent, stable()):
                verdict[i] = ok
            return verdict

        return out, held

    def _copy(self, copied: Sequence[_Copied], verify_checksum: bool) -> list[RejectReason | None]:
        """Run the copies of `copied` and, if `verify_checksum`, check each payload: per object,
        its refusal or None. Verified copies run `VERIFY_SPAN` bytes at a time, each span hashed
        right after its copy, while its bytes are still in the core's cache (hashing the whole
        batch after its copy reads it back from DRAM). A verdict counts only once the object's
        stamps are found unchanged (`get_into`)."""
        if not verify_checksum:
            self._io.copy([p for c in copied for p in c.pairs])
            return [None] * len(copied)
        bad: list[RejectReason | None] = []
        lo = 0
        while lo < len(copied):
            hi, span = lo + 1, copied[lo].header.payload_len
            while hi < len(copied) and span + copied[hi].header.payload_len <= VERIFY_SPAN:
                span += copied[hi].header.payload_len
                hi += 1
            self._io.copy([p for c in copied[lo:hi] for p in c.pairs], nbytes=span)
            bad += check_payloads([c.header for c in copied[lo:hi]], [c.parts for c in copied[lo:hi]])
            lo = hi
        return bad

    def _whole(self, present: list[tuple[int, Extent]]) -> list[tuple[int, Extent]]:
        """Those of `present` whose pages hold their generation now (their writer is done and none
        has begun rewriting them); the others are counted in `torn`."""
        now = self._pages.stamped_many([e.runs for _, e in present], [e.gen for _, e in present])
        self.torn += now.count(False)
        return [p for p, ok in zip(present, now) if ok]

    def _header(
        self, extent: Extent, exp: Expectation, want: int, fast: HeaderFastPath
    ) -> tuple[ObjectHeader, int] | GetResult:
        """(the object's header, where its payload starts) if it is the expected object's and fits
        `want` payload bytes, else its refusal; a miss when its pages changed while the header was
        read. The header is checked in place in the mapping (`HeaderFastPath` when it is exactly the
        one `exp` predicts), else decoded."""
        pages = self._pages
        page = pages.geometry.page_bytes
        limit = sum(count for _, count in extent.runs) * page
        first, count = extent.runs[0]
        raw = pages.area[first * page : (first + count) * page].data  # the header lies in the first run
        try:
            total = header_length(raw[:HEADER_PREFIX_BYTES])
            hit = fast.check(raw, total + exp.payload_len, exp) if exp.payload_len is not None else None
            if hit is not None:
                header = hit[0]
            elif total <= len(raw):
                header = decode_header(raw[:total])
            else:
                header = decode_header(pages.read_bytes(extent.runs, 0, min(total, limit)))
            reason = None if hit is not None else check_header(header, exp)
        except ObjectRejected as exc:
            return GetResult(TierStatus.REJECTED, None, exc.reason, str(exc)) if self._stable(extent) else _MISS
        start = payload_offset(total)
        if reason is None and want != header.payload_len:
            reason = RejectReason.LENGTH
        elif reason is None and start + header.payload_len > limit:
            reason = RejectReason.TRUNCATED
        if reason is None:
            return header, start
        return GetResult(TierStatus.REJECTED, header, reason) if self._stable(extent) else _MISS

    def _stable(self, extent: Extent) -> bool:
        """Do `extent`'s pages still hold its object (False: counted in `torn`)? A refusal is only
        trusted once they do: bytes read while another object was being written are no verdict."""
        if self._pages.stamped(extent.runs, extent.gen):
            return True
        self.torn += 1
        return False

    def peek_headers(self, keys: Sequence[StoreKey]) -> list[ObjectHeader | None]:
        """Headers of the keys' ready objects (None: not held, unreadable, naming another key, or
        its pages not its own before or after the header was read: `get_into`'s seqlock)."""
        try:
            found = self._host_catalog.ready_extents(keys)
        except Exception:  # noqa: BLE001
            return [None] * len(keys)
        pages = self._pages
        out: list[ObjectHeader | None] = [None] * len(keys)
        for i, extent in self._whole([(i, e) for i, e in enumerate(found) if e is not None]):
            limit = sum(count for _, count in extent.runs) * pages.geometry.page_bytes
            try:
                total = header_length(pages.read_bytes(extent.runs, 0, min(HEADER_PREFIX_BYTES, limit)))
                header = decode_header(pages.read_bytes(extent.runs, 0, min(total, limit)))
            except ObjectRejected:
                continue
            named = (header.tenant, header.chunk, header.member) == (keys[i].tenant, keys[i].chunk, keys[i].member)
            if self._stable(extent) and named:
                out[i] = header
        return out

    # -- dead writers -------------------------------------------------------------------

    def reclaim_dead(self) -> int:
        """Take back what dead processes held: their pending groups (unindexed, counted as
        ``dead_writer``) and the pages of their puts; returns the groups reclaimed."""
        catalog = self._host_catalog
        try:
            known = catalog.pending_owners()
        except Exception:  # noqa: BLE001 - a busy index: the next full put tries again
            return 0
        mine = {self._owner.token} if self._owner is not None else set()
        with dead_owners(self._root_fd, known - mine) as dead:
            dead -= mine
            try:
                victims = catalog.reclaim(dead)
            except Exception:  # noqa: BLE001
                return 0
            self._drop_victims(victims, "dead_writer")
        self.reclaimed += len(victims)
        return len(victims)

    @property
    def owner_token(self) -> str:
        """This process's owner name in the store (`owners.Owner.token`; "" once closed)."""
        return self._owner.token if self._owner is not None else ""

    def mapping(self) -> tuple[int, int]:
        """(address, bytes) of this process's mapping of the arena's pages: what `lend` hands out
        views of (registered with CUDA on a GPU host: `kvpack.transfers.host_registration`)."""
        area = self._pages.area
        return int(area.ctypes.data), int(area.nbytes)

    def page_census(self) -> tuple[int, int, int]:
        """(free, in limbo, held) pages of the arena (`HostCatalog.page_census`)."""
        return self._host_catalog.page_census()

    def close(self) -> None:
        super().close()
        if self._owner is not None:
            self._owner.close()
            self._owner = None
        pages = getattr(self, "_pages", None)
        if pages is not None:
            pages.close()
        if self._give_back and give_back(self._name, self._shm):
            log.info("kvpack: host store %s given back (memory.mode auto, its last user closed)", self._name)


_MISS = GetResult(TierStatus.MISS)


VERIFY_SPAN = 1 << 20
"""Bytes a verified load copies before it hashes them (`HostTier._copy`): well inside a core's
L2 cache (2 MiB on the Xeons and EPYCs kvpack runs on, 1 MiB on older Xeons)."""


@dataclass(frozen=True)
class _Copied:
    """One object of a load whose header passed: where it goes (`index` into the batch), its
    pages (`extent`), its header, the caller's buffer (`parts`) and the copies that fill it."""

    index: int
    extent: Extent
    header: ObjectHeader
    parts: tuple[memoryview, ...]
    pairs: list[CopyPair]
