"""Groups: a logical cache entry is one chunk's set of named members.

A member is one stored object of a group: the target KV (``kv``, or
``kv@<rank>of<size>`` per TP shard), draft-model state (``draft``), recurrent
or sliding-window state (``mamba``, ``swa``)... The engine adapter declares
the members it needs with `MemberSpec`; lookups answer with how many leading
chunks have *every* required member (principle 1: a hit is full or it is not
a hit) and count, by member name, where only part of a group was found.

Not every member is needed in every chunk of a prefix (`Coverage`): full
attention KV is (ALL), sliding-window KV only in the chunks the window still
sees at the hit boundary (TRAILING), recurrent state only in the chunk that
ends at the boundary (BOUNDARY). A hit of k chunks is valid when every ALL
member is present in chunks 0..k-1 and every other member in its trailing
chunks before k.
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


class Coverage(enum.Enum):
    """Which chunks of a prefix a member must be stored for, for a hit at its end."""

    ALL = "all"
    """Every chunk (full-attention KV, draft KV)."""
    TRAILING = "trailing"
    """Only the last `MemberSpec.window_chunks` chunks before the boundary (sliding-window KV)."""
    BOUNDARY = "boundary"
    """Only the chunk that ends at the boundary (recurrent state such as Mamba's): the
    object is the state after its last token, so a tail of it is usable only whole."""


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
    coverage: Coverage = Coverage.ALL
    window_chunks: int = 0
    """TRAILING only: how many chunks before the boundary must hold the member (>= 1)."""

    def __post_init__(self) -> None:
        validate_member(self.name)
        if self.coverage is Coverage.TRAILING and self.window_chunks < 1:
            raise ValueError(f"member {self.name!r}: a TRAILING member needs window_chunks >= 1")
        if self.coverage is not Coverage.ALL and self.role is MemberRole.DRAFT:
            raise ValueError(f"member {self.name!r}: draft members cover every chunk")

    @property
    def trailing_chunks(self) -> int | None:
        """Chunks before the boundary that must hold the member (None: all of them)."""
        if self.coverage is Coverage.TRAILING:
            return self.window_chunks
        if self.coverage is Coverage.BOUNDARY:
            return 1
        return None


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
    Members that do not cover every chunk (`Coverage`) move the answer down to
    the longest prefix whose trailing chunks hold them; chunks of the prefix
    before their window may lack them.
    """
    names = [m.name for m in members]
    target_names = [m.name for m in members if m.role is not MemberRole.DRAFT]
    every = [m.name for m in members if m.trailing_chunks is None]
    every_target = [m.name for m in members if m.trailing_chunks is None and m.role is not MemberRole.DRAFT]
    windowed = [(m.name, m.trailing_chunks) for m in members if m.trailing_chunks is not None]
    full = 0
    while full < len(presence) and all(presence[full].get(n, False) for n in every):
        full += 1
    target = 0
    while target < len(presence) and all(presence[target].get(n, False) for n in every_target):
        target += 1
    if windowed:
        full = _windowed_boundary(presence, windowed, full)
        target = _windowed_boundary(presence, windowed, target)
    missing: dict[str, int] = {}
    for i in range(full, target):
        for n in names:
            if not presence[i].get(n, False):
                missing[n] = missing.get(n, 0) + 1
    for n, _ in windowed:  # present in the window of `target` by construction; not needed before it
        missing.pop(n, None)
    hit = target if policy is DraftPolicy.TARGET_ONLY else full
    return GroupLookup(full, target, hit, tuple(names), tuple(target_names), missing)


def _windowed_boundary(presence: Sequence[dict[str, bool]], windowed: Sequence[tuple[str, int]], limit: int) -> int:
    """The largest k <= limit whose last chunks hold every windowed member (0 always qualifies)."""
    for k in range(limit, 0, -1):
        if all(presence[i].get(n, False) for n, window in windowed for i in range(max(0, k - window), k)):
            return k
    return 0


def tail_usable(members: Sequence[MemberSpec], stored_members: Sequence[str], matched: int, stored_tokens: int) -> bool:
    """Whether a stored tail of `stored_tokens`, of which `matched` match the prompt, can be
    loaded: a BOUNDARY member is the state after the tail's last token, so its tail
    serves only a prompt that contains the whole tail."""
    present = set(stored_members)
    return all(m.coverage is not Coverage.BOUNDARY or m.name not in present or matched == stored_tokens for m in members)
