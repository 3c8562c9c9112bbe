"""The store folder's pin list (`kvpack.store.pins.PinBook`) wired to the store's tiers: each
bounded tier keeps what the list pins, and a pin request pins what the disk folder holds.
Apart from `pins` so that the pin list itself (``kvpack pin``) needs no tier.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config.schema import KVPackConfig
from ..identity.keys import GroupKey
from ..tiers.disk import DiskTier
from ..tiers.host import HostTier
from ..tiers.memory import MemoryTier
from .pins import PinBook, PinOutcome


def open_pins(config: KVPackConfig, tiers: Sequence[object]) -> PinBook | None:
    """The store folder's pin list, its rule handed to every bounded tier of `tiers` (memory,
    host store, disk); None when pins are off (``eviction.pinned_bytes_per_tenant`` 0, or no disk)."""
    budget = config.eviction.pinned_bytes_per_tenant
    if budget <= 0 or not config.disk.enabled:
        return None
    book = PinBook(config.disk.path, budget)
    for tier in tiers:
        if isinstance(tier, MemoryTier):
            tier.keep(book.kept_names)
        elif isinstance(tier, (DiskTier, HostTier)):  # both hold the shared index (`kvpack.tiers.index`)
            tier.keep(book.kept)
    return book


def pin_prefix(
    book: PinBook, tiers: Sequence[object], tenant: str, fingerprint: str, chunks: Sequence[str]
) -> PinOutcome:
    """Pin `tenant`'s prefix `chunks` (first chunk first) as far as the disk folder holds it: the
    groups of its chunks up to the first one the folder does not hold, each with the bytes it holds
    there (one indexed read); the rest is pinned by a later request with the same prefix."""
    disk = next((t for t in tiers if isinstance(t, DiskTier) and t.name == "disk"), None)
    if disk is None or not chunks:
        return PinOutcome()
    groups = [GroupKey(tenant, fingerprint, c) for c in chunks]
    held: list[tuple[GroupKey, int]] = []
    for group, nbytes in zip(groups, disk.groups_present(groups)):
        if nbytes is None:
            break
        held.append((group, nbytes))
    return book.pin(tenant, held)
