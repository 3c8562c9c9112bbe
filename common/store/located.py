"""Where a session's lookups found each object (key -> tier name), kept for the load that
follows in the same process (`kvpack.session.Session.prepare_load` takes them)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from ..identity.keys import StoreKey

MAX_LOCATED = 1 << 16
"""Object locations a session remembers between a lookup and its load (key + tier name each)."""


class LocatedHints:
    """Where lookups found each object (key -> tier name), for the load that follows.

    Bounded to `capacity` keys, the oldest dropped first; a load takes (removes) the
    hints of what it reads. Thread-safe."""

    def __init__(self, capacity: int = MAX_LOCATED) -> None:
        self._capacity = capacity
        self._hints: OrderedDict[StoreKey, str] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, located: Mapping[StoreKey, str]) -> None:
        if not located or self._capacity <= 0:
            return
        with self._lock:
            hints = self._hints
            hints.update(located)
            for key in located:
                hints.move_to_end(key)
            while len(hints) > self._capacity:
                hints.popitem(last=False)

    def take(self, keys: Sequence[StoreKey]) -> dict[StoreKey, str]:
        with self._lock:
            if not self._hints:
                return {}
            return {k: t for k in keys if (t := self._hints.pop(k, None)) is not None}

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._hints

    def contain(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Per key: is a hint kept for it (under one lock)?"""
        with self._lock:
            hints = self._hints
            return [k in hints for k in keys] if hints else [False] * len(keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self._hints)
