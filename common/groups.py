"""Groups: a logical cache entry is one chunk's set of named members.

A member is one stored object of a group: the target KV (``kv``, or
``kv@<rank>of<size>`` per TP shard), draft-model state (``draft``), recurrent
or sliding-window state (``mamba``, ``swa``)... The engine adapter declares
the members it needs with `MemberSpec`; lookups answer with how many leading
chunks have *every* required member (principle 1: a hit is full or it is not
a hit) and count, by member name, where only part of a group was found.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from .config import DraftPolicy
from .keys import validate_member


class MemberRole(enum.Enum):
    TARGET = "target"
    """Target-model KV (or a shard of it). Always required."""
    DRAFT = "draft"
    """Speculative-decoding draft state. Required unless the draft policy is target_only."""
    STATE = "state"
    """Other per-chunk state of the target (mamba, swa, indexer). Always required."""


class DraftPlacement(enum.Enum):
    """How draft state is stored beside the target KV.

    PACKED: draft layers share the target's block index space and are copied
    into the target's object (one member; no extra object, no extra cost).
    SIDECAR: draft state has its own layout and is a separate member of the
    same group, addressed by the same chunk keys.
    """

    NONE = "none"
    PACKED = "packed"
    SIDECAR = "sidecar"


@dataclass(frozen=True)
class MemberSpec:
    """One member an engine stores and requires, with its layout fingerprint."""

    name: str
    fingerprint: str
    role: MemberRole = MemberRole.TARGET

    def __post_init__(self) -> None:
        validate_member(self.name)


@dataclass(frozen=True)
class GroupLookup:
    """Outcome of a batched prefix lookup over chained chunks.

    Attributes:
        full_chunks: leading chunks with every member present.
        target_chunks: leading chunks with every non-draft member present
            (>= full_chunks).
        hit_chunks: what the engine may load under the configured draft
            policy (full_chunks, or target_chunks for target_only).
        all_members / target_members: member names, all and non-draft.
        missing: member name -> chunks within `target_chunks` lacking it.
    """

    full_chunks: int
    target_chunks: int
    hit_chunks: int
    all_members: tuple[str, ...]
    target_members: tuple[str, ...]
    missing: dict[str, int] = field(default_factory=dict)

    def members_to_load(self, chunk_index: int) -> tuple[str, ...]:
        """Members to restore for chunk `chunk_index` (< hit_chunks): every member
        where the group is complete, the target's only beyond that (target_only)."""
        return self.all_members if chunk_index < self.full_chunks else self.target_members

    @property
    def partial(self) -> bool:
        """True when some target-present prefix lacked a required member."""
        return self.target_chunks > self.full_chunks


def resolve_lookup(
    presence: Sequence[dict[str, bool]], members: Sequence[MemberSpec], policy: DraftPolicy
) -> GroupLookup:
    """Turn per-chunk member presence into a `GroupLookup` (pure function).

    `presence[i][name]` says whether member `name` of chunk i is stored.
    """
    names = [m.name for m in members]
    target_names = [m.name for m in members if m.role is not MemberRole.DRAFT]
    full = 0
    while full < len(presence) and all(presence[full].get(n, False) for n in names):
        full += 1
    target = 0
    while target < len(presence) and all(presence[target].get(n, False) for n in target_names):
        target += 1
    missing: dict[str, int] = {}
    for i in range(full, target):
        for n in names:
            if not presence[i].get(n, False):
                missing[n] = missing.get(n, 0) + 1
    hit = target if policy is DraftPolicy.TARGET_ONLY else full
    return GroupLookup(full, target, hit, tuple(names), tuple(target_names), missing)
