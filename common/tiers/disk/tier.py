"""Local-disk tier: one marked directory, one file per object, atomic writes.

Layout: ``<root>/<tenant>/<fingerprint>/<chunk[:2]>/<chunk>.<member>.kvp``;
every path component comes from a validated `StoreKey`, so no key can escape
the root. A file is the object's header (`kvpack.identity.objects`), zero padding up
to the next 4 KiB boundary, then the payload: page-aligned payloads make the
kernel's copy into the caller's buffer as fast as a plain file read, and a
reader gets header and payload in one `preadv`. Files are written to a
random temporary name in the same folder (``O_EXCL``) and renamed into place,
so a reader never sees a half-written object.

kvpack never touches what is not its own (`kvpack.tiers.disk.fs`):
- the root is a new or empty folder that kvpack marks (``.kvpack-store``, with
  the format version), or one it marked before; anything else is refused at
  start-up with a ConfigError naming ``disk.path``;
- every open inside starts from the root's directory fd and refuses symlinks
  and non-regular files (counted in `DiskCounters.refused_unsafe`; a load of
  such an entry is a REJECTED(UNSAFE_FILE) miss, never a block on a FIFO);
- a file is deleted only when kvpack can prove it wrote it: an indexed object
  (its header decoded, named its path and matched the file's size) when its
  group is evicted or removed, its own temporary file after a failed write,
  or, at start-up, a temporary file of exactly kvpack's random-name pattern
  older than `stale_temp_s` (a live writer's temporaries survive). Every
  removal is counted with its reason (`DiskCounters.removed`). Folders are
  removed only when empty (`rmdir`), when the last object indexed in them goes.

The index is persistent and shared by every process on the folder
(`kvpack.tiers.index.catalog`: SQLite in the folder, one row per object): open
is O(1), `capacity` bounds the folder as a whole whatever the number of
processes, and eviction (LRU over whole groups, tenant shares kept) deletes
the victims' files after the transaction that unindexed them. A store without
a complete index (written by an older kvpack, or its index file deleted) is
indexed on a background thread by one process (`kvpack.tiers.disk.scan`);
until then a key the index does not know is looked up in the folder itself
(its path follows from the key; a load verifies the file's own header), so
the first request is served at once.

Batches: capacity for a whole put batch is planned in one index transaction
(`Catalog.admit`, rows not ready: no lookup finds them), then the files are
checksummed and written and the written ones marked ready in one more
(`Catalog.mark_ready`),
and a get batch's files are read and verified, on `io_threads` threads
(`kvpack.tiers.parallel`: file I/O releases the GIL). Each thread's share of a
put is one `writes.write_batch`: with the native writer, one GIL release for
all its files, and of a get one `reads.read_batch` with the native reader. A file whose group was
evicted while it was being written (by this or another process) is removed
again, so the index and the directory agree.

Failures never raise: a vanished or unwritable directory is ERROR, a full
disk NO_SPACE, a bad object REJECTED with its reason.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...identity.keys import GroupKey, StoreKey
from ...identity.objects import (
    Expectation,
    HeaderFastPath,
    ObjectHeader,
    ObjectRejected,
    Payload,
    RejectReason,
    check_payload,
    payload_nbytes,
    payload_parts,
)
from ...observe.router_facts import FactsRow, RouterFacts
from ...policy.clearing import Cleared, ClearScope, ClearUnsupported
from ..base import GetResult, Medium, PutItem, Tier, TierStatus, TierUsage, checksummed, sort_puts
from ..index.catalog import INDEX_BUSY_TIMEOUT_S, WRITE_GRACE_S, IndexBusy, open_catalog
from ..index.rows import Victim
from ..parallel import IOThreads, RegionCopier
from . import fs, scan
from .files import read_header_fd, read_verified
from .fs import UnsafeEntry
from .paths import file_name, leaf_of, rel_file
from .reads import ObjectReader, read_batch
from .removes import ObjectRemover, remove_batch
from .writes import ObjectWriter, WriteOutcome, outcome_of, write_batch, write_job

# WRITE_GRACE_S (from `kvpack.tiers.index.catalog`): a row not ready this long after its admission is a
# crashed writer's, dropped by a load miss or the folder scan; a ready row's miss drops it at once.
STALE_TEMP_S = 900.0
"""A temporary file untouched this long is a crashed writer's, swept at start-up."""
WRITE_ATTEMPTS = 8
"""Tries of one object write whose folder keeps being removed under it (`DiskTier._write_items`)."""
CLOSE_BUILD_WAIT_S = 5.0
"""How long `DiskTier.close` waits for the background index build to end (seconds): it stops after
the leaf folder at hand, a bounded amount of work."""

log = logging.getLogger("kvpack")


@dataclass
class DiskCounters:
    """What the tier refused and removed (plain ints: read them, never reset)."""

    refused_unsafe: int = 0
    """Opens refused: a symlink or a non-regular file where an object or folder belongs."""
    startup_rejected: int = 0
    """Files left alone at start-up: header unreadable, naming another path, or a size it does not have."""
    startup_unindexed: int = 0
    """Always 0 since the shared index: every valid file is indexed (the folder may be over capacity
    until the next put evicts); kept for readers of the counters."""
    removed: dict[str, int] = field(default_factory=dict)
    """Files removed, by reason: evicted, removed (`remove_groups`: damaged or dropped by the
    store), failed_write (the rest of a group one of whose members could not be written),
    own_temp (this writer's temporary after a failed write), evicted_while_written, stale_temp;
    index_busy: objects of saves dropped because another process held the index past
    `catalog.WRITE_LOCK_WAIT_S` (never written; a later miss)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count_removed(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.removed[reason] = self.removed.get(reason, 0) + n

    def count_unsafe(self) -> None:
        with self._lock:
            self.refused_unsafe += 1


class DiskTier(Tier):
    name = "disk"
    medium = Medium.DISK

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity: int,
        quotas: dict[str, int] | None = None,
        fsync: bool = False,
        io_threads: int = 1,
        *,
        stale_temp_s: float = STALE_TEMP_S,
        busy_timeout_s: float = INDEX_BUSY_TIMEOUT_S,
        open_scan_s: float = 0.5,
        object_writer: Callable[[], ObjectWriter | None] | None = None,
        object_remover: Callable[[], ObjectRemover | None] | None = None,
        object_reader: Callable[[], ObjectReader | None] | None = None,
        region_copier: Callable[[], RegionCopier | None] | None = None,
    ) -> None:
        """Raises ConfigError naming ``disk.path`` for a folder kvpack must not use (`fs.open_store_root`).

        Eviction is LRU over the folder's groups, shared by every process on it (`kvpack.tiers.index.catalog`;
        the configured `eviction.policy` orders the memory tier only). `quotas`: the tenants' guaranteed
        shares (`kvpack.policy.eviction.shares`). `busy_timeout_s` bounds a wait for another process's
        index transaction. `open_scan_s` is how long opening waits for the folder scan
        (`kvpack.tiers.disk.scan`) before leaving it to its background thread. Each native part, if
        given, is asked for at each use (None: from Python): `object_writer` the batch file write
        (`kvpack.ops.object_writer`), `object_remover` the batch removal (`kvpack.ops.object_remover`),
        `object_reader` the batch read (`kvpack.ops.object_reader`), `region_copier` the memory copy
        (`kvpack.ops.region_copier`)."""
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self._root_str, self._root_fd = fs.open_store_root(os.fspath(root))
        self.root = Path(self._root_str)
        self._old_root_fds: list[int] = []
        self._fsync = fsync
        self._object_writer = object_writer
        self._object_remover = object_remover
        self._object_reader = object_reader
        self._stale_temp_s = stale_temp_s
        self._capacity_bytes = capacity
        self._quotas = dict(quotas or {})
        self._lock = threading.Lock()
        self._root_lock = threading.Lock()
        self._io = IOThreads(io_threads, min_items_per_thread=4, name="kvpack-disk", region_copier=region_copier)
        # its files checked as this user's alone when the folder lies in one others may write into
        self._catalog = open_catalog(
            self._root_str, self._root_fd, busy_timeout_s, private_root=fs.is_private(self._root_str)
        )
        self._refused: dict[StoreKey, tuple[int, int]] = {}
        """Keys whose file was refused, by the file's (inode, mtime_ns); bounded.

        The folder fallback of `contains` skips them until the file changes."""
        self.counters = DiskCounters()
        self.on_evict: Callable[[GroupKey, int], None] | None = None
        self._complete = self._catalog.complete()
        self._checked = time.monotonic()
        self._builder: threading.Thread | None = None
        self._stop_build = threading.Event()
        """Set by `close`: the background build ends after its leaf folder at hand."""
        self.scan_seconds: float | None = None
        """How long this process's folder scan took, once it ended (None: not scanned here, or still running)."""
        self._start_build(open_scan_s)

    @property
    def startup_rejected(self) -> int:
        return self.counters.startup_rejected

    # -- the index build ---------------------------------------------------------

    def _start_build(self, wait_s: float) -> None:
        """Scan the folder on a thread (`scan.build_index`), waiting for it at most `wait_s`;
        a no-op while another process (or tier) on the folder scans it."""
        try:
            lock_fd = scan.try_build_lock(self._root_fd)
        except OSError:
            return
        if lock_fd is None:
            return  # another process builds it; `index_complete` notices when it is done

        started = time.monotonic()

        def run() -> None:
            try:
                found = scan.build_index(
                    self._root_fd,
                    self._catalog,
                    self.counters,
                    self._stale_temp_s,
                    self._refuse_stat,
                    WRITE_GRACE_S,
                    self._stop_build,
                )
                if found is not None:
                    self._complete = True
                    self.scan_seconds = time.monotonic() - started
            finally:
                os.close(lock_fd)

        self._builder = threading.Thread(target=run, name="kvpack-disk-index", daemon=True)
        self._builder.start()
        self._builder.join(wait_s)

    def index_complete(self) -> bool:
        """Is the shared index complete (every file of the folder indexed)? Re-read at most twice a second."""
        if not self._complete and time.monotonic() - self._checked > 0.5:
            self._checked = time.monotonic()
            self._complete = self._catalog.complete()
        return self._complete

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Block until this process's background build ends (operator tools and benches, never an engine step)."""
        builder = self._builder
        if builder is not None:
            builder.join(timeout)
        self._checked = 0.0
        return self.index_complete()

    # -- paths -------------------------------------------------------------------

    def path_of(self, key: StoreKey) -> Path:
        return Path(f"{self._root_str}/{rel_file(key)}")

    def _reopen_root(self, seen_fd: int) -> None:
        """The root folder was deleted under us: recreate and re-mark it (a new, empty folder).

        The old fd stays open until `close` (another thread may still hold its number)."""
        with self._root_lock:
            if self._root_fd != seen_fd:
                return
            _, fd = fs.open_store_root(self._root_str)
            self._old_root_fds.append(self._root_fd)
            self._root_fd = fd

    # -- removal -----------------------------------------------------------------

    def _drop_victims(self, victims: Sequence[Victim], reason: str) -> int:
        """Delete the files of groups already unindexed, counted under `reason` (one batch:
        `removes.remove_batch`); returns the objects the index held."""
        keys: list[StoreKey] = []
        for victim in victims:
            if reason == "evicted" and self.on_evict is not None:
                self.on_evict(victim.group, victim.nbytes)
            keys += [victim.group.member(member) for member in victim.members]
        self._remove_files(keys, [victim.group for victim in victims], reason)
        return len(keys)

    def _drop_removed(self, victims: Sequence[Victim]) -> int:
        return self._drop_victims(victims, "removed")

    def _remove_files(self, keys: Sequence[StoreKey], groups: Sequence[GroupKey], reason: str) -> None:
        """Unlink `keys`' files and the emptied folders of `groups`, each removed file counted under `reason`."""
        native = self._object_remover() if self._object_remover is not None else None
        for gone in remove_batch(self._root_fd, keys, groups, native):
            if gone:
                self.counters.count_removed(reason)

    def _refuse_stat(self, key: StoreKey, st: os.stat_result | None) -> None:
        with self._lock:
            if len(self._refused) > 65536:
                self._refused.clear()  # bounded: forgetting only makes contains() report a few more candidates
            self._refused[key] = (st.st_ino, st.st_mtime_ns) if st is not None else (-1, -1)

    def _refuse(self, key: StoreKey, fd: int | None = None) -> None:
        """Remember that `key`'s file (as it is now) was refused, so `contains` stops reporting it."""
        try:
            st = os.fstat(fd) if fd is not None else None
        except OSError:
            st = None
        self._refuse_stat(key, st)

    # -- reads -------------------------------------------------------------------

    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        """One indexed lookup per batch; while the index is incomplete, the keys it
        does not know are looked for in the folder (their paths follow from the keys)."""
        try:
            known = self._catalog.lookup(keys)
        except Exception:  # noqa: BLE001 - an unreadable index answers from the folder
            known = [False] * len(keys)
            self._complete = False
        if all(known) or self.index_complete():
            return known
        with self._lock:
            marks = [None if ok else self._refused.get(k) for k, ok in zip(keys, known)]
        return [ok or self._present(k, mark) for k, ok, mark in zip(keys, known, marks)]

    @property
    def capacity_bytes(self) -> int:
        """The bytes every process on the folder shares (`capacity`)."""
        return self._capacity_bytes

    def keep(self, kept: Callable[[], frozenset[bytes]]) -> None:
        """Never evict the groups whose ids `kept()` holds (`kvpack.store.pins`), from any process's store."""
        self._catalog.kept = kept

    def groups_present(self, groups: Sequence[GroupKey]) -> list[int | None]:
        """Per group: the bytes of its ready objects the index holds, None when none. One indexed
        read per batch, no file touched: the answer is the folder's only while `index_complete`."""
        return self._catalog.ready_bytes(groups)

    def record_facts(self, rows: Sequence[tuple[GroupKey, RouterFacts]]) -> int:
        """Routers' facts of groups the folder holds ready (`Catalog.record_facts`, `kvpack.observe.router_facts`)."""
        return self._catalog.record_facts(rows)

    def facts_after(self, seq: int, limit: int) -> list[FactsRow]:
        """The facts rows after `seq`, at most `limit` (`Catalog.facts_after`: one indexed read)."""
        return self._catalog.facts_after(seq, limit)

    def _present(self, key: StoreKey, refused: tuple[int, int] | None) -> bool:
        try:
            fd = fs.open_regular(self._root_fd, rel_file(key))
        except UnsafeEntry:
            self.counters.count_unsafe()
            return False
        except OSError:
            return False
        try:
            if refused is None:
                return True
            st = os.fstat(fd)
            return (st.st_ino, st.st_mtime_ns) != refused
        finally:
            os.close(fd)

    def peek_headers(self, keys: Sequence[StoreKey]) -> list[ObjectHeader | None]:
        """Headers of the files at the keys' paths; None for a missing, refused or
        unreadable file, or one whose header names another key."""
        out: list[ObjectHeader | None] = []
        for key in keys:
            try:
                fd = fs.open_regular(self._root_fd, rel_file(key))
            except UnsafeEntry:
                self.counters.count_unsafe()
                out.append(None)
                continue
            except OSError:
                out.append(None)
                continue
            try:
                header = read_header_fd(fd)
                ok = header.tenant == key.tenant and header.chunk == key.chunk and header.member == key.member
                out.append(header if ok else None)
            except (OSError, ObjectRejected):
                out.append(None)
            finally:
                os.close(fd)
        return out

    def get_into(
        self,
        keys: Sequence[StoreKey],
        dsts: Sequence[Payload],
        expected: Sequence[Expectation],
        verify_checksum: bool,
    ) -> list[GetResult]:
        """Read and check each file, spread over `io_threads`; then one locked
        pass that touches the hits and indexes files another process wrote."""

        def part(lo: int, hi: int) -> list[GetResult]:
            fast = HeaderFastPath()  # one per thread: it caches
            native = self._object_reader() if self._object_reader is not None else None
            if native is not None:

                def slow(i: int) -> GetResult:
                    return self._get_one(keys[lo + i], dsts[lo + i], expected[lo + i], verify_checksum, fast)

                cut = slice(lo, hi)
                return read_batch(self._root_fd, keys[cut], dsts[cut], expected[cut], verify_checksum, native, slow)
            return [self._get_one(keys[i], dsts[i], expected[i], verify_checksum, fast) for i in range(lo, hi)]

        results = self._io.split(len(keys), part, sum(payload_nbytes(d) for d in dsts))
        hits = [k.group for k, r in zip(keys, results) if r.ok]
        gone = [k for k, r in zip(keys, results) if r.status is TierStatus.MISS]
        try:
            if hits:
                self._catalog.touch(hits)
            if gone:
                # a ready row's file vanished (removed behind kvpack's back): the row and its bytes go
                # now; a row not ready is a write in progress unless older than the grace
                self._catalog.forget(gone, time.time_ns() - int(WRITE_GRACE_S * 1e9))
        except Exception:  # noqa: BLE001 - a busy index only delays the LRU order
            pass
        return results

    def _get_one(
        self, key: StoreKey, dst: Payload, exp: Expectation, verify: bool, fast: HeaderFastPath | None = None
    ) -> GetResult:
        rel = rel_file(key)
        try:
            fd = fs.open_regular(self._root_fd, rel)
        except FileNotFoundError:
            return _MISS
        except UnsafeEntry as exc:
            self.counters.count_unsafe()
            return GetResult(TierStatus.REJECTED, None, RejectReason.UNSAFE_FILE, f"{rel}: {exc.strerror}")
        except OSError as exc:
            return GetResult(TierStatus.ERROR, detail=f"{rel}: {exc}")
        parts = payload_parts(dst)
        try:
            result = read_verified(fd, parts, exp, fast)
            if result.ok and verify:
                assert result.header is not None
                bad = check_payload(result.header, parts)
                if bad is not None:
                    result = GetResult(TierStatus.REJECTED, result.header, bad)
            if result.reason in _DAMAGED:
                self._refuse(key, fd)
            return result
        except ObjectRejected as exc:
            self._refuse(key, fd)
            return GetResult(TierStatus.REJECTED, None, exc.reason, str(exc))
        except OSError as exc:
            return GetResult(TierStatus.ERROR, detail=f"{rel}: {exc}")
        finally:
            os.close(fd)

    # -- writes ------------------------------------------------------------------

    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        """Admit the batch under one lock, write its files on `io_threads`, then
        un-index the files that failed and remove those evicted meanwhile."""
        n = len(items)
        statuses, sizes, by_tenant = sort_puts(items)
        victims: list[Victim] = []
        try:
            for tenant, idx in by_tenant.items():
                admitted, gone = self._catalog.admit(
                    tenant,
                    [(items[i].key, sizes[i], items[i].accepted_ns) for i in idx],  # an object counts its payload
                    self._capacity_bytes,
                    self._quotas,
                )
                victims += gone
                for i, ok in zip(idx, admitted):
                    if not ok:
                        statuses[i] = TierStatus.NO_SPACE
        except IndexBusy:  # another process holds the index: dropped (a later miss), never a stall
            self.counters.count_removed("index_busy", sum(s is TierStatus.OK for s in statuses))
            return [TierStatus.TIMEOUT if s is TierStatus.OK else s for s in statuses]
        except Exception:  # noqa: BLE001 - an index that cannot be written: nothing is stored
            return [TierStatus.ERROR if s is TierStatus.OK else s for s in statuses]
        self._drop_victims(victims, "evicted")
        todo = [i for i in range(n) if statuses[i] is TierStatus.OK]

        def part(lo: int, hi: int) -> list[TierStatus]:
            return self._write_items([items[i] for i in todo[lo:hi]])

        nbytes = sum(items[i].header.payload_len for i in todo)
        for i, status in zip(todo, self._io.split(len(todo), part, nbytes)):
            statuses[i] = status
        failed = [items[i].key.group for i in todo if statuses[i] is not TierStatus.OK]
        if failed:
            self._drop_victims(self._catalog.remove_groups(failed, save=True), "failed_write")
        written = [i for i in todo if statuses[i] is TierStatus.OK]
        try:  # one short transaction: from now on the written objects are found (`contains`)
            still = self._catalog.mark_ready([items[i].key for i in written])
        except Exception:  # noqa: BLE001 - left not ready: unseen until a scan finds them whole
            still = [True] * len(written)
        # evicted while it was written (a later put, another process)
        late = [i for i, indexed in zip(written, still) if not indexed]
        for i in late:
            statuses[i] = TierStatus.NO_SPACE
        if late:
            keys = [items[i].key for i in late]
            self._remove_files(keys, [k.group for k in keys], "evicted_while_written")
        return statuses

    def _write_items(self, items: Sequence[PutItem]) -> list[TierStatus]:
        """Checksum and write `items` (`writes.write_batch`: native when `object_writer` gives one).

        A folder missing or removed meanwhile (emptied by an eviction's `removes.remove_batch` in this
        or another process, or the whole root) is made again (`_make_leaf`) and its object retried, at
        most `WRITE_ATTEMPTS` times: a removal needs an empty folder, and the write's own temporary
        makes its leaf non-empty, so only a removal racing the few calls before it costs a retry."""
        finals = [file_name(it.key) for it in items]
        jobs = [
            write_job(leaf_of(it.key), final, temp, it.header.encode(), it.payload)
            for it, final, temp in zip(checksummed(items), finals, fs.temp_names(finals))
        ]
        statuses = [TierStatus.ERROR] * len(jobs)
        pending = list(range(len(jobs)))
        native = self._object_writer() if self._object_writer is not None else None
        for _attempt in range(WRITE_ATTEMPTS):
            root_fd, retry = self._root_fd, []
            # temporaries in each object's own leaf (-1): renamed in place, one copy
            results = write_batch(root_fd, -1, [jobs[i] for i in pending], self._fsync, native)
            for i, (err, removed) in zip(pending, results):
                if removed:
                    self.counters.count_removed("own_temp", removed)
                outcome = outcome_of(err)
                if outcome is WriteOutcome.MISSING_FOLDER and self._make_leaf(root_fd, jobs[i].leaf):
                    retry.append(i)
                elif outcome is WriteOutcome.UNSAFE:
                    self.counters.count_unsafe()
                statuses[i] = outcome.status
            if not retry:
                break
            pending = retry
        return statuses

    def _make_leaf(self, root_fd: int, leaf: str) -> bool:
        try:
            fs.make_dirs(root_fd, leaf)
            return True
        except UnsafeEntry:
            self.counters.count_unsafe()
            return False
        except FileNotFoundError:  # a folder on the way went meanwhile (an eviction's cleanup): retry
            if not fs.root_removed(root_fd):
                return True
            try:
                self._reopen_root(root_fd)
                return True
            except Exception:  # noqa: BLE001 - a root that cannot be recreated is an ERROR, not a crash
                return False
        except OSError:
            return False

    def remove_groups(self, groups: Sequence[GroupKey]) -> int:
        try:
            victims = self._catalog.remove_groups(groups)
        except Exception:  # noqa: BLE001
            return 0
        return self._drop_removed(victims)

    def clear(self, scope: ClearScope, dry_run: bool = False) -> Cleared:
        """From the shared index (`Catalog.clear`), then the files: a racing load misses."""
        if not self.index_complete():
            raise ClearUnsupported(f"{self._root_str}: its index is still being built; clear again once it is")
        return self._catalog.clear(scope, None if dry_run else self._drop_removed)

    def name_group(self, fingerprint: str, label: str) -> None:
        self._catalog.name_fingerprint(fingerprint, label)

    def usage(self) -> TierUsage:
        """The folder's usage (every process's objects): the index is shared."""
        return self._catalog.usage(self._capacity_bytes)

    def tenant_used(self, tenant: str) -> int:
        return self._catalog.tenant_used(tenant)

    def tenants(self) -> list[str]:
        """Tenants with anything indexed (their rows exist only while they store something)."""
        return self._catalog.tenants()

    def close(self) -> None:
        self._io.close()
        for fd in self._old_root_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._old_root_fds.clear()
        self._stop_build.set()  # a closed tier writes nothing more: its build ends after one leaf folder
        if self._builder is not None:
            self._builder.join(CLOSE_BUILD_WAIT_S)
        if self._builder is None or not self._builder.is_alive():
            self._catalog.close()
        else:
            log.warning(
                "kvpack: the disk index build of %s did not end within %.0f s of close",
                self._root_str,
                CLOSE_BUILD_WAIT_S,
            )


_MISS = GetResult(TierStatus.MISS)
_DAMAGED = frozenset({RejectReason.TRUNCATED, RejectReason.CHECKSUM, RejectReason.GROUP})
"""Refusals of a file that decoded but is not a whole, intact object of its path: `contains` skips it."""
