"""Tail slots: the computed tail of a request's last, partial block, reused by prefix.

A tail is stored with its token ids (in the object header) under
`tail_chunk(parent, slot)`, where `parent` is the chunk before it (None at the
start of a sequence). Up to `TAIL_SLOTS` distinct continuations of one parent
are kept, so concurrent requests sharing a prefix do not overwrite each
other's tail. A later prompt reuses the longest common prefix with a stored
tail, rounded down to the match unit (`prefix_match_unit`); the partial block
is loaded whole and the engine computes the rest into it, so nothing already
computed is thrown away. Every lookup is one batched header peek per tier for
all slots and members.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..config.schema import DraftPolicy, KVPackConfig
from ..identity.keys import StoreKey
from ..identity.objects import ObjectHeader
from ..observe.metrics import Metrics
from .budget import WaitBudget
from .groups import MemberRole, MemberSpec

TAIL_SLOTS = 4
"""Tails kept per parent block: distinct continuations of one prefix."""


def tail_chunk(parent: str | None, slot: int = 0) -> str:
    """Chunk id of tail slot `slot` after `parent` (None: sequence start)."""
    return f"{parent or 'root'}-tail" + (str(slot) if slot else "")


@dataclass(frozen=True, slots=True)
class TailMatch:
    """A usable stored tail: `tokens` leading tokens of it match the new prompt.

    `token_ids` are the tail's stored ids (what a load must find again)."""

    chunk: str
    tokens: int
    stored_tokens: int
    token_ids: tuple[int, ...]
    members: tuple[str, ...]
    tiers: tuple[str, ...] = ()
    """The tiers its members' headers were found in (the load reads it from those)."""


HeaderPeek = Callable[[Sequence[StoreKey], "WaitBudget | None"], "tuple[list[ObjectHeader | None], list[str | None]]"]
"""`KVStore.peek_located`: each key's header from the fastest tier holding it, and that tier's name."""


class TailSlots:
    """Finding and placing tails over a store's tiers (see the module docstring)."""

    def __init__(self, config: KVPackConfig, metrics: Metrics, peek: HeaderPeek) -> None:
        self.config = config
        self.metrics = metrics
        self._peek = peek

    def find(
        self,
        tenant: str,
        fingerprint: str,
        parent: str | None,
        tokens: Sequence[int] | np.ndarray,
        members: Sequence[MemberSpec],
        match_unit: int,
        budget: WaitBudget | None = None,
    ) -> TailMatch | None:
        """The stored tail after `parent` sharing the longest prefix with `tokens`.

        Looks at every tail slot of `parent` (`TAIL_SLOTS`). Every required member
        must hold a tail with the same token ids (a draft member may be absent
        under target_only: then only target members load, counted as partial).
        Returns None when fewer than `match_unit` tokens match."""
        if not self.config.tail_reuse or len(tokens) == 0:
            return None
        query = np.asarray(tokens, dtype=np.int64)
        best: TailMatch | None = None
        missing_draft: set[str] = set()
        slots = self._tail_slot_headers(tenant, fingerprint, parent, [m.name for m in members], budget)
        for chunk, found, tiers in slots:
            headers = dict(zip((m.name for m in members), found))
            match = self._match_tail_slot(chunk, headers, query, members, match_unit, missing_draft)
            if match is not None:
                used = dict(zip((m.name for m in members), tiers))
                match = replace(match, tiers=tuple(sorted({t for m in match.members if (t := used.get(m))})))
            if match is not None and (best is None or match.tokens > best.tokens):
                best = match
        if best is None or len(best.members) < len(members):
            for name in missing_draft:  # a tail whose draft state is missing: never silent
                self.metrics.inc("partial_hits", tenant=tenant, missing_member=name)
        return best

    def _tail_slot_headers(
        self, tenant: str, fingerprint: str, parent: str | None, members: Sequence[str], budget: WaitBudget | None
    ) -> list[tuple[str, list[ObjectHeader | None], list[str | None]]]:
        """For each tail slot of `parent`: (its chunk, the header of each member and the tier
        it came from, in `members` order). One batched `peek_headers` per tier for all of them."""
        chunks = [tail_chunk(parent, slot) for slot in range(TAIL_SLOTS)]
        headers, tiers = self._peek([StoreKey(tenant, fingerprint, c, m) for c in chunks for m in members], budget)
        n = len(members)
        return [(c, headers[i * n : (i + 1) * n], tiers[i * n : (i + 1) * n]) for i, c in enumerate(chunks)]

    def _match_tail_slot(
        self,
        chunk: str,
        headers: dict[str, ObjectHeader | None],
        query: np.ndarray,
        members: Sequence[MemberSpec],
        match_unit: int,
        missing_draft: set[str],
    ) -> TailMatch | None:
        targets = [m for m in members if m.role is not MemberRole.DRAFT]
        ref = headers[targets[0].name] if targets else None
        if ref is None or ref.token_ids is None:
            return None
        names: list[str] = []
        for m in members:
            h = headers[m.name]
            if h is None or h.token_ids != ref.token_ids:
                if m.role is not MemberRole.DRAFT:
                    return None
                missing_draft.add(m.name)
                if self.config.draft_policy is not DraftPolicy.TARGET_ONLY:
                    return None
                continue
            names.append(m.name)
        stored = np.asarray(ref.token_ids, dtype=np.int64)
        n = min(len(stored), len(query))
        mismatch = np.nonzero(stored[:n] != query[:n])[0]
        common = int(mismatch[0]) if mismatch.size else n
        common -= common % match_unit
        if common <= 0:
            return None
        return TailMatch(chunk, common, len(stored), ref.token_ids, tuple(names))

    def place(
        self,
        tenant: str,
        fingerprint: str,
        parent: str | None,
        members: Sequence[str],
        token_ids: Sequence[int],
        budget: WaitBudget | None = None,
    ) -> tuple[str, bool]:
        """Where to store the tail `token_ids` after `parent`: (chunk, already stored).

        Several continuations of one parent block keep separate tails (up to
        `TAIL_SLOTS`), so concurrent requests sharing a prefix do not overwrite
        each other's tail. Choice, in order: a slot already holding exactly
        these tokens in every member (nothing to write); a slot whose tail this
        one extends; an empty slot; else a slot picked by the tokens' hash."""
        ids = tuple(int(t) for t in token_ids)
        extends: str | None = None
        empty: str | None = None
        for chunk, headers, _ in self._tail_slot_headers(tenant, fingerprint, parent, members, budget):
            stored = headers[0].token_ids if headers[0] is not None else None
            if stored is None:
                empty = empty or chunk
            elif stored == ids and all(h is not None and h.token_ids == ids for h in headers):
                return chunk, True
            elif extends is None and ids[: len(stored)] == stored:
                extends = chunk
        if extends or empty:
            return extends or empty, False  # type: ignore[return-value]
        slot = int.from_bytes(hashlib.blake2b(np.asarray(ids, dtype="<u4").tobytes(), digest_size=4).digest(), "little")
        return tail_chunk(parent, slot % TAIL_SLOTS), False
