"""Capacity accounting over groups, with per-tenant guaranteed shares.

The mechanism half of eviction (the policy half only orders groups). A
bounded tier asks `reserve()` before it stores a member; the answer is either
ADMITTED plus the whole groups to evict first, or NO_SPACE (the store is
dropped and counted, nothing is evicted: batch eviction is all or nothing).

Invariants (checked by property tests):
- used bytes never exceed `capacity` after a reservation is applied;
- a group is evicted whole, never one member;
- victims follow the one rule of `kvpack.policy.eviction.shares` (also the disk index's):
  a tenant U other than the requester is never pushed below its guaranteed
  share `quotas[U]` (bytes); a requester with a share that it exceeds evicts
  its own groups before anyone else's. Tenants without a configured share
  compete for the unreserved space in plain policy order (no tenant is held
  to a share of zero, which would let it keep only one group);
- per-tenant state exists only while the tenant stores something: a tenant
  whose last group is released leaves no entry behind (20,000 one-off
  tenants from ``cache_salt`` values cost nothing once evicted);
- a pinned group (`pin`, a load between its lookup and its copy) is never a
  victim while its pin holds: pins are counted (each `pin` is matched by one
  `unpin`) and bounded in time (a pin not released by its deadline no longer
  protects the group, so a lost load cannot hold memory forever). Pins exist
  only for resident groups.

Not thread-safe: the owning tier calls it under its own lock.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from .base import EvictionPolicy
from .shares import Candidate, choose_victims


class Admission(enum.Enum):
    ADMITTED = "admitted"
    NO_SPACE = "no_space"


@dataclass(slots=True)
class GroupUsage:
    """One resident group: its tenant, its members' bytes, and their sum (`nbytes`)."""

    tenant: str
    members: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0


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
        self._pins: dict[Hashable, list[float]] = {}  # group -> [count, latest deadline (monotonic)]
        self.used = 0
        self.kept: Callable[[], Collection[Hashable]] | None = None
        """The groups pinned by their tenant (`kvpack.store.pins`): never candidates while it answers them."""

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

    def tenants(self) -> list[str]:
        """Tenants with at least one resident group."""
        return list(self._tenant_used)

    def pinned(self, group: Hashable, now: float | None = None) -> bool:
        """True while `group` holds a pin whose deadline has not passed."""
        pin = self._pins.get(group)
        return pin is not None and pin[1] > (time.monotonic() if now is None else now)

    # -- pins ----------------------------------------------------------------

    def pin(self, group: Hashable, until: float) -> bool:
        """Keep resident `group` from eviction until `unpin` or the monotonic time `until`.
        False (nothing pinned) when the group is not resident."""
        if group not in self._groups:
            return False
        pin = self._pins.get(group)
        if pin is None:
            self._pins[group] = [1, until]
        else:
            pin[0] += 1
            pin[1] = max(pin[1], until)
        return True

    def unpin(self, group: Hashable) -> None:
        """Release one `pin` of `group` (an unknown or evicted group is ignored)."""
        pin = self._pins.get(group)
        if pin is not None:
            pin[0] -= 1
            if pin[0] <= 0:
                del self._pins[group]

    # -- mutation ------------------------------------------------------------

    def reserve(self, group: Hashable, tenant: str, member: str, nbytes: int) -> Reservation:
        """Plan room for `member` of `group` (replacing a same-named member).

        Returns the victims to evict (whole groups, never `group` itself). The
        caller must then evict them with `release` and record the member with
        `commit`, under one lock.
        """
        return self.reserve_many(tenant, ((group, member, nbytes),))

    def reserve_many(self, tenant: str, requests: Iterable[tuple[Hashable, str, int]]) -> Reservation:
        """Plan room for several members of `tenant` at once: all or nothing.

        `requests` are (group, member, bytes); a request replaces a same-named
        member already stored (and a later request an earlier one of the same
        batch). The victims are whole groups, never a group of the batch, chosen
        exactly as for one request of the batch's total size, so every invariant
        of the module docstring holds for the batch as a whole. NO_SPACE (nothing
        planned) when the batch as a whole does not fit: the caller may then
        reserve its members one by one. The caller must `release` the victims
        and `commit` every request, under one lock.
        """
        final: dict[tuple[Hashable, str], int] = {}
        for group, member, nbytes in requests:
            if nbytes > self.capacity:
                return Reservation(Admission.NO_SPACE)
            final[(group, member)] = nbytes
        delta = 0
        batch: set[Hashable] = set()
        for (group, member), nbytes in final.items():
            existing = self._groups.get(group)
            delta += nbytes - (existing.members.get(member, 0) if existing else 0)
            batch.add(group)
        victims = choose_victims(
            tenant, delta, self.used, self.capacity, self._tenant_used, self._quotas, self._candidates, batch
        )
        if victims is None:
            return Reservation(Admission.NO_SPACE)
        return Reservation(Admission.ADMITTED, tuple(v.group for v in victims))

    def _candidates(self, tenant: str | None) -> Iterator[Candidate]:
        """Resident groups in the policy's victim order (of `tenant` only, when given), pinned ones left out."""
        groups, pins = self._groups, self._pins
        now = time.monotonic() if pins else 0.0
        kept = self.kept() if self.kept is not None else ()
        for group in self._policy.victims():
            usage = groups.get(group)
            if usage is None or (tenant is not None and usage.tenant != tenant) or group in kept:
                continue
            if pins and group in pins and pins[group][1] > now:
                continue  # pinned by a load in progress
            yield Candidate(group, usage.tenant, usage.nbytes)

    def admit(
        self,
        tenant: str,
        requests: Sequence[tuple[Hashable, str, int]],
        evict: Callable[[Sequence[Hashable]], object],
    ) -> list[bool]:
        """Reserve, evict and commit a batch of `tenant`'s members; per request, admitted?

        One `reserve_many` for the whole batch when it fits (every request
        admitted); else request by request, where a later request may evict an
        earlier one's group (callers check `has_member` before publishing).
        `evict(groups)` is called with the victims of each reservation and must
        `release` them (`release_many`) and drop their data."""
        plan = self.reserve_many(tenant, requests)
        if plan.admission is Admission.ADMITTED:
            if plan.victims:
                evict(plan.victims)
            self.commit_many(tenant, requests)
            return [True] * len(requests)
        admitted: list[bool] = []
        for group, member, nbytes in requests:
            plan = self.reserve(group, tenant, member, nbytes)
            if plan.admission is Admission.NO_SPACE:
                admitted.append(False)
                continue
            if plan.victims:
                evict(plan.victims)
            self.commit(group, tenant, member, nbytes)
            admitted.append(True)
        return admitted

    def commit(self, group: Hashable, tenant: str, member: str, nbytes: int) -> None:
        """Record `member` (after its victims were released)."""
        self.commit_many(tenant, ((group, member, nbytes),))

    def commit_many(self, tenant: str, requests: Iterable[tuple[Hashable, str, int]]) -> None:
        """`commit` each (group, member, bytes) of `tenant`, in order."""
        groups, policy = self._groups, self._policy
        total = 0
        for group, member, nbytes in requests:
            usage = groups.get(group)
            if usage is None:
                usage = groups[group] = GroupUsage(tenant, {member: nbytes}, nbytes)
                policy.insert(group)
                total += nbytes
                continue
            policy.touch(group)
            members = usage.members
            delta = nbytes - members.get(member, 0)
            members[member] = nbytes
            usage.nbytes += delta
            total += delta
        self.used += total
        self._tenant_used[tenant] = self._tenant_used.get(tenant, 0) + total

    def release(self, group: Hashable) -> dict[str, int]:
        """Forget a whole group; returns its members (name -> bytes)."""
        return self.release_many((group,))[0]

    def release_many(self, groups: Iterable[Hashable]) -> list[dict[str, int]]:
        """`release` each group, in order; an unknown group gives an empty dict."""
        pop, remove, tenant_used = self._groups.pop, self._policy.remove, self._tenant_used
        out: list[dict[str, int]] = []
        freed = 0
        for group in groups:
            usage = pop(group, None)
            if usage is None:
                out.append({})
                continue
            self._pins.pop(group, None)
            remove(group)
            size = usage.nbytes
            freed += size
            left = tenant_used.get(usage.tenant, 0) - size
            if left > 0:
                tenant_used[usage.tenant] = left
            else:
                tenant_used.pop(usage.tenant, None)
            out.append(usage.members)
        self.used -= freed
        return out

    def touch(self, group: Hashable) -> None:
        if group in self._groups:
            self._policy.touch(group)

    def touch_many(self, groups: Iterable[Hashable]) -> None:
        """`touch` each resident group, in order (a read of a batch)."""
        resident, touch = self._groups, self._policy.touch
        for group in groups:
            if group in resident:
                touch(group)
