"""The facts a KV-aware router needs about a group, shared through a shared tier's index.

An engine's event for a stored block (vLLM's ``BlockStored``) needs facts only the instance
that computed it has (its engine block hashes, parent hash, token ids, LoRA). On a tier other
processes share (the host store, ``memory.mode: host``; a ``disk.path`` several engines use)
every instance can load what one wrote, so the writer records those facts beside the group in
the tier's index, and every other instance tails them and announces the group as its own
loadable block. The core stores and tails the facts; it never reads them: `RouterFacts.blob`
is the adapter's encoding (vLLM: `kvpack.vllm_plugin.kv_events`).

Invariants:

- a facts row is written in the save path, after the tier published the group's object, and
  only while the group has a ready object (one index transaction checks and inserts), so no
  reader sees the facts of an object still being written or of a writer killed mid-object;
- it is deleted in the transaction that deletes its group (evicted, removed, reclaimed from a
  dead writer, dropped by a scan): facts never outlive the data. One row per group at most
  (the first writer's), at most `MAX_FACTS_BYTES` each;
- rows are numbered by a sequence that only grows (never reused), so a reader's cursor never
  misses a row written after it; `FactsTail.take` reads at most `per_step` rows past its
  cursor in one indexed read (no write, no file opened; the index's busy timeout is its
  bound; an index error skips the step, the next retries);
- a reader skips the rows its own instance wrote (`RouterFacts.origin`) and those whose
  `identity` (what makes the adapter's hashes comparable: vLLM's hash function and seed)
  differs from its own, counting them (``kvpack_shared_facts{outcome}``);
- a salted request's blocks get no facts row (`shares_facts`): their facts (token ids) stay with
  the instance that computed them, whose own events are all that announce them. A router matches
  a request by hashing its token ids, which a salted block's engine hash does not follow (the salt
  seeds it), so another instance's announcement would only tell that instance's subscribers a
  salted tenant's prompt; without the token ids a router could not match it at all.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..identity.keys import GroupKey
from .metrics import Metrics
from .shared_sweep import SWEPT_TIERS


class FactsHolder(Protocol):
    """What `shared_fact_tails` reads of a session: its metrics and its store's tiers."""

    @property
    def metrics(self) -> Metrics: ...

    @property
    def store(self) -> TiersHolder: ...


class TiersHolder(Protocol):
    @property
    def tiers(self) -> Sequence[Any]: ...


log = logging.getLogger("kvpack")

MAX_FACTS_BYTES = 1 << 16
"""A facts row's blob at most (a block's token ids and hashes take a few KiB); larger ones are not recorded."""
PER_STEP = 64
"""Rows a reader takes per engine step at most (one indexed read)."""


def new_origin() -> str:
    """A fresh instance name for `RouterFacts.origin` (random: unique among the tier's writers)."""
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class RouterFacts:
    """What the writer of a group tells the other instances' routers about it.

    `origin`: the writing instance (`new_origin`); `identity`: what makes the adapter's facts
    comparable across instances (a reader announces only rows of its own identity); `blob`:
    the adapter's encoding, opaque to the core, at most `MAX_FACTS_BYTES`."""

    origin: str
    identity: str
    blob: bytes


@dataclass(frozen=True, slots=True)
class FactsRow:
    """One facts row as read back: its sequence number, its group and the facts."""

    seq: int
    group: GroupKey
    facts: RouterFacts


class FactsIndex(Protocol):
    """What a reader reads: a shared tier's index (`kvpack.tiers.disk.DiskTier` and the host tier)."""

    name: str

    def facts_after(self, seq: int, limit: int) -> list[FactsRow]: ...


class FactsTail:
    """One instance's reader of one shared tier's facts rows (module docstring). Not thread-safe:
    one adapter thread (vLLM's scheduler) calls `take` once per step."""

    def __init__(self, tier: FactsIndex, origin: str, metrics: Metrics | None = None, per_step: int = PER_STEP) -> None:
        """Start at the first row the tier holds: an instance that starts announces what the tier
        already holds from other instances, `per_step` rows a step."""
        if per_step < 1:
            raise ValueError(f"per_step must be >= 1, got {per_step}")
        self.tier = tier
        self.origin = origin
        self.per_step = per_step
        self.cursor = 0
        """The last row read (rows are numbered from 1)."""
        self._metrics = metrics

    def take(self, identity: str) -> list[FactsRow]:
        """The next rows (at most `per_step`) other instances of `identity` wrote."""
        try:
            rows = self.tier.facts_after(self.cursor, self.per_step)
        except Exception as exc:  # noqa: BLE001 - a busy or lost index: the next step retries
            log.debug("kvpack: facts tail of %s skipped: %s", self.tier.name, exc)
            return []
        if not rows:
            return []
        self.cursor = rows[-1].seq
        out = [r for r in rows if r.facts.origin != self.origin and r.facts.identity == identity]
        own = sum(r.facts.origin == self.origin for r in rows)
        self._count("taken", len(out))
        self._count("own", own)
        self._count("other_identity", len(rows) - len(out) - own)
        return out

    def _count(self, outcome: str, n: int) -> None:
        if n and self._metrics is not None:
            self._metrics.inc("shared_facts", n, tier=self.tier.name, outcome=outcome)


def shared_fact_tails(session: FactsHolder, origin: str, tiers: Sequence[str] = SWEPT_TIERS) -> list[FactsTail]:
    """A tail of each of `session`'s tiers named in `tiers` that keeps facts rows (in the store's
    tier order; empty: none here), counted in the session's metrics."""
    return [
        FactsTail(tier, origin, session.metrics)  # a DiskTier by its methods
        for tier in session.store.tiers
        if tier.name in tiers and hasattr(tier, "facts_after")
    ]
