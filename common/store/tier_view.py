"""The one description of a store's tiers an adapter reads (`Session.tiers`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..identity.keys import StoreKey
from .store import KVStore


class TierView:
    """What an adapter may know of the store's tiers: their names, the one in host memory
    asked first, and whether the memory tier lends its own slots. Reads only; never raises."""

    def __init__(self, store: KVStore) -> None:
        self._store = store

    @property
    def names(self) -> list[str]:
        """The store's tiers by name, fastest first."""
        return [t.name for t in self._store.tiers]

    @property
    def front(self) -> str | None:
        """The tier in host memory the store asks first (the memory tier or the host store),
        None without one (`KVStore.front_tier`)."""
        return self._store.front_tier

    def in_front(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Per key: held by the `front` tier now (all False without one)."""
        return self._store.in_front(keys)

    @property
    def lends_slots(self) -> bool:
        """Whether `Session.save_pages` with ``fill`` and `Session.complete_load` with ``lend``
        use the memory tier's own slots (`KVStore.lends_memory`); when False they copy."""
        return self._store.lends_memory


__all__ = ["TierView"]
