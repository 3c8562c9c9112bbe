"""The victim rule: which whole groups go so a tenant's store fits, with guaranteed tenant shares.

Stated once and used by both accountings of a bounded tier: the in-process one
(`kvpack.policy.eviction.manager.CapacityManager`, the memory tier, candidates in its policy's
order) and the shared one (`kvpack.tiers.index.catalog`, one SQLite index per folder,
candidates in its LRU tick order). Each brings its candidates; this module decides.

The rule, for `requester` storing `delta` more bytes into a tier holding `used` of `capacity`:

- nothing goes while ``used + delta <= capacity``; otherwise victims are taken until the
  bytes they free cover the excess (``need``), or the store does not fit (None: nothing goes);
- victims are whole groups, never one of `exclude` (the groups of the batch being admitted);
- a tenant other than the requester is never pushed below its guaranteed share
  ``quotas[tenant]`` (bytes); tenants without a configured share hold none;
- a requester with a share that the store would take it over evicts its own groups first,
  then anyone's; within each pass the candidates go in the order they come (best victim first).

Candidates come from ``candidates(tenant)``: the resident groups an accounting may evict now
(not pinned, not newer than the store: the caller's filters), best victim first; with a tenant,
at least that tenant's (the rule checks the owner itself, so a caller may pass more).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass


@dataclass(slots=True)
class Candidate:
    """A resident group that may be evicted: its id in the accounting, its owner, its bytes.

    Never mutated; not frozen only because a frozen init (one ``object.__setattr__`` per
    field) costs several times a plain one, and an eviction builds one per victim considered
    (a store of a page batch into a full memory tier: one per page)."""

    group: Hashable
    tenant: str
    nbytes: int


def choose_victims(
    requester: str,
    delta: int,
    used: int,
    capacity: int,
    tenant_used: Mapping[str, int],
    quotas: Mapping[str, int],
    candidates: Callable[[str | None], Iterable[Candidate]],
    exclude: Collection[Hashable] = (),
) -> list[Candidate] | None:
    """The victims that make room for `requester`'s `delta` bytes (see the module docstring):
    [] when the store fits as it is, None when no choice the rule allows makes room.

    `tenant_used`: bytes per tenant now (not changed); `candidates(None)`: every tenant's."""
    need = used + delta - capacity
    if need <= 0:
        return []
    after = dict(tenant_used)
    after[requester] = after.get(requester, 0) + delta
    chosen: list[Candidate] = []
    taken: set[Hashable] = set()
    freed = 0

    def take(own_only: bool) -> None:
        nonlocal freed
        for cand in candidates(requester if own_only else None):
            if freed >= need:
                return
            if cand.group in exclude or cand.group in taken:
                continue
            owner = cand.tenant
            if own_only and owner != requester:
                continue
            if owner != requester and after.get(owner, 0) - cand.nbytes < quotas.get(owner, 0):
                continue  # would push another tenant below its guaranteed share
            taken.add(cand.group)
            chosen.append(cand)
            freed += cand.nbytes
            after[owner] = after.get(owner, 0) - cand.nbytes

    if requester in quotas and after[requester] > quotas[requester]:
        take(own_only=True)
    if freed < need:
        take(own_only=False)
    return chosen if freed >= need else None
