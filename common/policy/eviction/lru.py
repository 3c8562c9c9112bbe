"""Least-recently-used order over groups."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from .base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Invariant: `_order` holds every resident key once, least recent first."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
