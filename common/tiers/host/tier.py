"""The host memory tier: one store in the host's shared memory, shared by every kvpack process.

`HostTier` is the disk tier (`kvpack.tiers.disk.DiskTier`: one file per object,
the shared SQLite index with its one budget, LRU over groups, tenant shares,
atomic publication by rename) rooted in a tmpfs folder (`place.host_root`). A
tmpfs file's pages are host memory and nothing else: no page-cache copy, no
disk. So every process on the host reads and writes one set of objects under
one `capacity`, and:

- a load is one copy, ``preadv`` from the shared pages straight into the
  destination (`files.read_verified`); a save is one copy, ``writev`` from the
  source into the new file (`disk.writes`: native when the extension is
  loaded); checksums (`ChecksumPolicy.BOUNDARY`: the objects cross processes)
  and the integrity key apply as on the disk tier;
- `capacity` counts what tmpfs holds for an object (`_charge`): its header page(s)
  plus its payload in whole pages, so the folder's size stays within it (plus the
  index, `place.INDEX_ALLOWANCE`);
- a write starts in this process's own temporary folder (`owners`), is renamed
  into place when whole, and its index row names this process until it is ready
  (`HostCatalog`). A process killed mid-store leaves no lock held (``flock`` and
  SQLite's locks die with it) and its reservation is reclaimed by the next
  process that opens the store or finds it full (`reclaim_dead`): the groups it
  was writing are unindexed and their files removed, its temporary folder emptied;
- the folder scan of the disk tier runs only when the index is incomplete (a new
  or lost index): a live host store's index is the truth (nothing else writes tmpfs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from ...objects import payload_checksum
from ..base import PutItem, TierStatus
from ..disk import DiskTier
from ..disk.catalog import Catalog, open_catalog
from ..disk.files import data_offset
from ..disk.fs import SHM, open_store_root
from ..disk.removes import ObjectRemover
from ..disk.writes import ObjectWriter
from .catalog import HostCatalog
from .owners import Owner, dead_owners
from .place import host_root

FIELD = "memory.mode"
"""The config field a host store's start-up errors name."""


class HostTier(DiskTier):
    name = "host"

    def __init__(
        self,
        host_name: str,
        capacity: int,
        quotas: dict[str, int] | None = None,
        io_threads: int = 1,
        *,
        shm: str = SHM,
        busy_timeout_s: float = 10.0,
        object_writer: Callable[[], ObjectWriter | None] | None = None,
        object_remover: Callable[[], ObjectRemover | None] | None = None,
    ) -> None:
        """Open (or create) host store `host_name` in `shm` (`place.host_root`) with `capacity`
        bytes for every process on it; reclaims what dead processes held. ConfigError naming
        ``memory.mode`` when the folder is not one kvpack may use. `object_writer`, `object_remover`: `DiskTier`'s."""
        self._owner: Owner | None = None
        self.reclaimed = 0
        """Groups this process took back from dead writers (`reclaim_dead`)."""
        super().__init__(
            host_root(host_name, shm),
            capacity,
            quotas,
            False,
            io_threads,
            busy_timeout_s=busy_timeout_s,
            object_writer=object_writer,
            object_remover=object_remover,
        )

    # -- DiskTier's hooks -----------------------------------------------------------

    def _open_root(self, path: str) -> tuple[str, int]:
        return open_store_root(path, FIELD, shm=True)

    def _open_catalog(self, busy_timeout_s: float) -> Catalog:
        catalog = open_catalog(self._root_str, self._root_fd, busy_timeout_s, FIELD, HostCatalog)
        assert isinstance(catalog, HostCatalog)
        self._owner = Owner(self._root_fd)
        catalog.owner = self._owner.token
        return catalog

    def _start_build(self, pace: Callable[[int], None] | None, wait_s: float) -> None:
        self.reclaim_dead()
        if not self._catalog.complete():
            super()._start_build(pace, wait_s)

    def _charge(self, item: PutItem, nbytes: int) -> int:
        """What tmpfs holds for the object: its header page(s) and its payload in whole pages."""
        return data_offset(item.header.encoded_len) + data_offset(nbytes)

    def _temp_dir_fd(self) -> int:
        """This owner's temporary folder: a write is renamed from there into the object's folder (one copy)."""
        assert self._owner is not None
        return self._owner.temp_fd

    # -- writes -----------------------------------------------------------------------

    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        """`DiskTier.put_from` with each checksum computed first (the charge counts the header's
        exact size); items refused for space are tried once more after a `reclaim_dead` that
        took something back."""
        items = [it if it.header.checksum is not None else _checksummed(it) for it in items]
        statuses = super().put_from(items)
        full = [i for i, s in enumerate(statuses) if s is TierStatus.NO_SPACE]
        if full and self.reclaim_dead():
            for i, status in zip(full, super().put_from([items[i] for i in full])):
                statuses[i] = status
        return statuses

    def reclaim_dead(self) -> int:
        """Take back what dead processes held: their pending groups (unindexed, files removed,
        counted as ``dead_writer``) and their temporary files; returns the groups reclaimed."""
        catalog = self._catalog
        assert isinstance(catalog, HostCatalog)
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

    def close(self) -> None:
        super().close()
        if self._owner is not None:
            self._owner.close(self._root_fd)
            self._owner = None


def _checksummed(item: PutItem) -> PutItem:
    return replace(item, header=replace(item.header, checksum=payload_checksum(item.payload)))
