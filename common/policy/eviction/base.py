"""The eviction-policy interface: ordering only, no sizes, no tenants.

A policy sees group keys being inserted, touched (read) and removed and
yields candidate victims in its preferred eviction order. The capacity
manager (`kvpack.policy.eviction.manager`) decides which candidates may actually go
(quotas) and how many are needed (bytes). Mechanism and policy never mix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator


class EvictionPolicy(ABC):
    """Orders resident groups for eviction. Keys are any hashable group id."""

    @abstractmethod
    def insert(self, key: Hashable) -> None:
        """A new group became resident (not already present)."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """A resident group was read or extended."""

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """A resident group left (evicted or removed); unknown keys are ignored."""

    @abstractmethod
    def victims(self) -> Iterator[Hashable]:
        """Resident groups, best victim first. Each resident key appears once.

        The iterator is lazy: choosing k victims costs O(k), not O(resident).
        The caller must not insert, touch or remove while iterating (the
        capacity manager picks its whole batch first, then releases it).
        """

    @abstractmethod
    def __len__(self) -> int: ...
