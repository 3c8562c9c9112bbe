"""Adaptive Replacement Cache (Megiddo & Modha) over groups.

Lists:
- T1: resident, seen once recently (recency);
- T2: resident, seen at least twice (frequency);
- B1, B2: ghosts of keys evicted from T1 / T2 (keys only, no data).

Flow: a new key enters T1; a touch moves it to T2's MRU end. Inserting a key
that is a ghost in B1 grows the target size `p` of T1 (recency is paying off);
one in B2 shrinks it; the key then enters T2. Victims come from T1 while
|T1| > p (or T2 is empty), else from T2; each list in LRU order. Ghost lists
are bounded by the number of resident keys seen at the peak (`_capacity`), so
memory stays O(resident).

Batch eviction is linear: `victims()` walks the two lists lazily in the
order above, so choosing k victims costs O(k).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator

from .base import EvictionPolicy


class ARCPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._p = 0.0
        self._capacity = 1

    def insert(self, key: Hashable) -> None:
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        if key in self._b1:
            self._p = min(float(self._capacity), self._p + max(1.0, len(self._b2) / max(1, len(self._b1))))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / max(1, len(self._b2))))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._capacity = max(self._capacity, len(self))

    def touch(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            self._b2[key] = None
        else:
            return
        for ghosts in (self._b1, self._b2):
            while len(ghosts) > self._capacity:
                ghosts.popitem(last=False)

    def victims(self) -> Iterator[Hashable]:
        if len(self._t1) > self._p or not self._t2:
            return itertools.chain(self._t1, self._t2)
        return itertools.chain(self._t2, self._t1)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    @property
    def target_t1(self) -> float:
        """ARC's adaptive target size of T1 (for tests and stats)."""
        return self._p
