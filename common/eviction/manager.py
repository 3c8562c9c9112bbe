"""Capacity accounting over groups, with per-tenant guaranteed shares.

The mechanism half of eviction (the policy half only orders groups). A
bounded tier asks `reserve()` before it stores a member; the answer is either
ADMITTED plus the whole groups to evict first, or NO_SPACE (the store is
dropped and counted, nothing is evicted: batch eviction is all or nothing).

Invariants (checked by property tests):
- used bytes never exceed `capacity` after a reservation is applied;
- a group is evicted whole, never one member;
- a tenant U other than the requester is never pushed below its guaranteed
  share `quotas[U]` (bytes); a requester with a share that it exceeds evicts
  its own groups before anyone else's. Tenants without a configured share
  compete for the unreserved space in plain policy order (no tenant is held
  to a share of zero, which would let it keep only one group).

Not thread-safe: the owning tier calls it under its own lock.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from .base import EvictionPolicy


class Admission(enum.Enum):
    ADMITTED = "admitted"
    NO_SPACE = "no_space"


@dataclass
class GroupUsage:
    tenant: str
    members: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.members.values())


@dataclass(frozen=True)
class Reservation:
    admission: Admission
    victims: tuple[Hashable, ...] = ()


class CapacityManager:
    """Bytes per group and tenant for one bounded tier. See module docstring."""

    def __init__(self, capacity: int, policy: EvictionPolicy, quotas: dict[str, int] | None = None) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._policy = policy
        self._quotas = dict(quotas or {})
        self._groups: dict[Hashable, GroupUsage] = {}
        self._tenant_used: dict[str, int] = {}
        self.used = 0

    # -- queries -------------------------------------------------------------

    def __contains__(self, group: Hashable) -> bool:
        return group in self._groups

    def members(self, group: Hashable) -> dict[str, int]:
        usage = self._groups.get(group)
        return dict(usage.members) if usage else {}

    def has_member(self, group: Hashable, member: str) -> bool:
        usage = self._groups.get(group)
        return usage is not None and member in usage.members

    def tenant_used(self, tenant: str) -> int:
        return self._tenant_used.get(tenant, 0)

    def groups(self) -> Iterable[Hashable]:
        return list(self._groups)

    # -- mutation ------------------------------------------------------------

    def reserve(self, group: Hashable, tenant: str, member: str, nbytes: int) -> Reservation:
        """Plan room for `member` of `group` (replacing a same-named member).

        Returns the victims to evict (whole groups, never `group` itself). The
        caller must then evict them with `release` and record the member with
        `commit`, under one lock.
        """
        existing = self._groups.get(group)
        previous = existing.members.get(member, 0) if existing else 0
        need = self.used - previous + nbytes - self.capacity
        if nbytes > self.capacity:
            return Reservation(Admission.NO_SPACE)
        if need <= 0:
            return Reservation(Admission.ADMITTED)
        victims: list[Hashable] = []
        freed = 0
        # hypothetical per-tenant usage as victims are chosen
        tenant_after = dict(self._tenant_used)
        tenant_after[tenant] = tenant_after.get(tenant, 0) - previous + nbytes
        chosen: set[Hashable] = set()

        def take(candidates: Iterable[Hashable], own_only: bool) -> None:
            nonlocal freed
            for cand in candidates:
                if freed >= need:
                    return
                if cand == group or cand in chosen:
                    continue
                usage = self._groups.get(cand)
                if usage is None:
                    continue
                size = usage.nbytes
                if own_only and usage.tenant != tenant:
                    continue
                if usage.tenant != tenant and tenant_after.get(usage.tenant, 0) - size < self._quotas.get(usage.tenant, 0):
                    continue  # would push another tenant below its guaranteed share
                chosen.add(cand)
                victims.append(cand)
                freed += size
                tenant_after[usage.tenant] = tenant_after.get(usage.tenant, 0) - size

        if tenant in self._quotas and tenant_after[tenant] > self._quotas[tenant]:
            take(self._policy.victims(), own_only=True)
        if freed < need:
            take(self._policy.victims(), own_only=False)
        if freed < need:
            return Reservation(Admission.NO_SPACE)
        return Reservation(Admission.ADMITTED, tuple(victims))

    def commit(self, group: Hashable, tenant: str, member: str, nbytes: int) -> None:
        """Record `member` (after its victims were released)."""
        usage = self._groups.get(group)
        if usage is None:
            usage = GroupUsage(tenant)
            self._groups[group] = usage
            self._policy.insert(group)
        else:
            self._policy.touch(group)
        previous = usage.members.get(member, 0)
        usage.members[member] = nbytes
        delta = nbytes - previous
        self.used += delta
        self._tenant_used[tenant] = self._tenant_used.get(tenant, 0) + delta

    def release(self, group: Hashable) -> dict[str, int]:
        """Forget a whole group; returns its members (name -> bytes)."""
        usage = self._groups.pop(group, None)
        if usage is None:
            return {}
        self._policy.remove(group)
        size = usage.nbytes
        self.used -= size
        self._tenant_used[usage.tenant] = self._tenant_used.get(usage.tenant, 0) - size
        return usage.members

    def touch(self, group: Hashable) -> None:
        if group in self._groups:
            self._policy.touch(group)
