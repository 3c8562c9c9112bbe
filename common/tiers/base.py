"""The tier interface: batched contains / get_into / put_from / remove.

Every method takes a batch and returns one outcome per item, in order. No
method raises on the data path: a broken tier answers UNAVAILABLE, TIMEOUT or
ERROR per item, a refused object answers REJECTED with its `RejectReason`, and
callers treat anything but OK as a miss (the engine recomputes).

Zero-copy contract:
- `put_from` reads each payload from the caller's buffer during the call and
  keeps no reference to it afterwards (the caller may reuse the buffer at once).
- `get_into` writes each payload straight into the caller's buffer. When the
  result is not OK the destination's contents are unspecified: the caller must
  not use them (vLLM's connector reports such blocks as load errors).

Buffers are C-contiguous `memoryview`s of bytes, e.g.
``memoryview(tensor.view(torch.uint8).numpy())`` for a CPU tensor, or a tuple
of them (`kvpack.identity.objects.Payload`): a payload made of several regions (the K
and V halves of a page, one run per layer) is stored and restored region by
region, in place, without a gather copy.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..identity.keys import GroupKey, StoreKey
from ..identity.objects import Expectation, ObjectHeader, Payload, RejectReason, payload_checksums, payload_nbytes
from ..observe.router_facts import RouterFacts
from ..policy.clearing import Cleared, ClearScope, ClearUnsupported


class TierStatus(enum.Enum):
    OK = "ok"
    MISS = "miss"
    REJECTED = "rejected"
    """The object exists but failed a check (see `GetResult.reason`)."""
    NO_SPACE = "no_space"
    """The tier is full and eviction could not make room (quotas); store dropped."""
    UNAVAILABLE = "unavailable"
    """The tier is down or its circuit breaker is open."""
    TIMEOUT = "timeout"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class GetResult:
    status: TierStatus
    header: ObjectHeader | None = None
    reason: RejectReason | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status is TierStatus.OK


@dataclass(frozen=True, slots=True)
class PutItem:
    """One object to store. `header.payload_len == payload_nbytes(payload)`.

    `header.checksum` may be None: a tier that persists or ships the object
    computes it (memory keeps it lazily)."""

    key: StoreKey
    header: ObjectHeader
    payload: Payload
    accepted_ns: int | None = None
    """Wall-clock ns at which `KVStore.store` accepted the object, when it reaches this tier
    later (the write-back): a bounded tier ranks its recency by this, not by its arrival, so
    a store that arrives late never displaces a newer one. None: accepted now, by this put."""
    announce: RouterFacts | None = None
    """What the writer tells other instances' routers about the object's group: recorded by a
    shared tier once it stored the object (`kvpack.observe.router_facts`); None: nothing."""

    @property
    def nbytes(self) -> int:
        return payload_nbytes(self.payload)


def checksummed(items: Sequence[PutItem]) -> list[PutItem]:
    """`items`, each without a checksum given its payload's (one `payload_checksums` batch)."""
    todo = [i for i, it in enumerate(items) if it.header.checksum is None]
    out = list(items)
    for i, csum in zip(todo, payload_checksums([items[i].payload for i in todo])):
        out[i] = replace(items[i], header=replace(items[i].header, checksum=csum))
    return out


@dataclass(frozen=True, slots=True)
class TierUsage:
    used_bytes: int
    capacity_bytes: int
    objects: int
    groups: int


class Medium(enum.Enum):
    """Where a tier keeps its bytes, as engines' metrics name the source of cached tokens."""

    HOST = "host"
    """This host's memory: a process's memory tier, the host store."""
    DISK = "disk"
    """A file system."""
    REMOTE = "remote"
    """Another machine's store (Mooncake)."""


class Tier(ABC):
    """One storage tier. Thread-safe: any method may be called from any thread."""

    name: str = "tier"
    medium: Medium = Medium.REMOTE
    """Where its bytes are (`kvpack.store.hit_sources` splits a hit's tokens by it)."""
    remote: bool = False
    """Calls leave this process and may each wait up to the tier's own bound (Mooncake):
    `KVStore` skips such a tier once an engine step's `WaitBudget` is spent."""
    front: bool = False
    """A tier in host memory that a store reaches first: `KVStore.store` returns once it holds
    a copy and hands the tiers below it to the write-back threads (the per-process memory
    tier, the host store). At most one per store, and then the first."""

    @abstractmethod
    def contains(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Per key: is an object stored (not yet verified)? Never raises."""

    @abstractmethod
    def get_into(
        self,
        keys: Sequence[StoreKey],
        dsts: Sequence[Payload],
        expected: Sequence[Expectation],
        verify_checksum: bool,
    ) -> list[GetResult]:
        """Copy each payload into `dsts[i]` after checking its header against
        `expected[i]` (and, if asked, its checksum). Never raises. Writes into `dsts` only
        before it returns (a transfer given up at a deadline writes nothing later), so the
        caller may reuse them at once."""

    @abstractmethod
    def put_from(self, items: Sequence[PutItem]) -> list[TierStatus]:
        """Store (or overwrite) each object. Never raises."""

    @abstractmethod
    def peek_headers(self, keys: Sequence[StoreKey]) -> list[ObjectHeader | None]:
        """Decoded headers without payloads (None: missing or unreadable)."""

    @abstractmethod
    def remove_groups(self, groups: Sequence[GroupKey]) -> int:
        """Remove every member of each group; returns objects removed."""

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def clear(self, scope: ClearScope, dry_run: bool = False) -> Cleared:
        """Remove every object whose tenant and group fingerprint `scope` matches (`kvpack.policy.clearing`),
        found from the tier's own index; with `dry_run`, only count them. Raises (`ClearUnsupported`,
        or the tier's error) when it cannot: `clear_tiers` reports the tier failed. A load racing
        with it is a miss, never a wrong load."""
        raise ClearUnsupported(f"the {self.name} tier cannot list its objects")

    def name_group(self, fingerprint: str, label: str) -> None:  # noqa: B027 (optional hook)
        """Record what group fingerprint `fingerprint` is (`label`: model and layout) where the
        tier keeps an index an operator reads (``kvpack usage``); nothing elsewhere. Never raises."""

    @property
    def available(self) -> bool:
        """False while the tier answers every call without doing it (a remote tier that is
        down: its breaker open, or not connected). Never blocks; a hint that may change at
        once, used to count the lookups an outage turned into misses."""
        return True

    def warming_up(self) -> bool:
        """True while the tier's first connect is in progress and within its bound:
        it answers UNAVAILABLE or MISS now but will hold objects soon (Mooncake).
        Never blocks."""
        return False

    def wait_warm(self) -> bool:
        """Block (bounded by the tier's own start-up bound) while `warming_up`;
        True when the tier is usable. Never called on an engine's step."""
        return True

    def wait_ready(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` until the tier is usable; True when it is. The caller's
        bound, for tests, tools and an operator's start-up check; unlike `wait_warm` it also
        waits past a failed first attempt. Never called on an engine's step."""
        return True

    def close(self) -> None:  # noqa: B027 (optional hook: most tiers hold nothing to release)
        """Release resources; later calls answer UNAVAILABLE or MISS."""
