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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..config.schema import DraftPolicy
from ..identity.keys import StoreKey, validate_member


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
        if self.coverage is Coverage.BOUNDARY and self.role is MemberRole.DRAFT:
            raise ValueError(f"member {self.name!r}: draft members cover every chunk or a trailing window")

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
        missing: member name -> chunks within `target_chunks` lacking it (a
            windowed draft member: the chunks of its window at `target_chunks`).
        restorable: every prefix length k (1..hit_chunks) at which a hit is valid
            under the policy; with windowed members not every shorter prefix is
            (a window with a hole), and engines that intersect such sets across
            ranks need all of them (SGLang's ``restorable_prefix_pages``).
        member_hits: per member, the chunks it alone would allow: an ALL member
            its leading run (within the non-draft members' run), a windowed member
            the last boundary within that policy's run whose window holds it.
        located: per key of the hit (chunks < hit_chunks, `members_to_load`), the
            name of the fastest tier that held it at lookup time (`KVStore.lookup`
            fills it; `KVStore.prepare_load` takes it).
    """

    full_chunks: int
    target_chunks: int
    hit_chunks: int
    all_members: tuple[str, ...]
    target_members: tuple[str, ...]
    missing: dict[str, int] = field(default_factory=dict)
    restorable: tuple[int, ...] = ()
    member_hits: dict[str, int] = field(default_factory=dict)
    located: Mapping[StoreKey, str] = field(default_factory=dict)
    boundary_missing: tuple[str, ...] = ()
    """TARGET members (every chunk; the parts of one model's KV: TP shards, KV-head ranges)
    absent from the chunk right after the target run while another part is there: the
    group was cut short by one of its parts (evicted, never stored), counted as a partial
    hit, never loaded. STATE members (an SGLang indexer pool, a hybrid's other groups)
    only shorten the hit, as their engines expect."""
    chunk_sets: tuple[int, ...] = ()
    """A lookup over several member sets (head splits, `kvpack.policy.split_lookup`): per hit
    chunk, the index in `set_members` of the set it loads. Empty: every chunk loads
    `all_members` (and `target_members` beyond `full_chunks`)."""
    set_members: tuple[tuple[str, ...], ...] = ()

    def members_to_load(self, chunk_index: int) -> tuple[str, ...]:
        """Members to restore for chunk `chunk_index` (< hit_chunks): every member
        where the group is complete, the target's only beyond that (target_only); a
        lookup over head splits: the chunk's own set."""
        if self.chunk_sets:
            return self.set_members[self.chunk_sets[chunk_index]]
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
    before their window may lack them. A windowed draft member (SGLang's
    ``draft_swa``) bounds `full_chunks` only, like any draft member.
    """
    names = [m.name for m in members]
    target_names = [m.name for m in members if m.role is not MemberRole.DRAFT]
    every = [m.name for m in members if m.trailing_chunks is None]
    every_target = [m.name for m in members if m.trailing_chunks is None and m.role is not MemberRole.DRAFT]
    windows = {
        m.name: _window_ok(presence, m.name, m.trailing_chunks) for m in members if m.trailing_chunks is not None
    }
    target_windows = [windows[m.name] for m in members if m.name in windows and m.role is not MemberRole.DRAFT]
    full_run = _leading(presence, every)
    target_run = _leading(presence, every_target)
    full_ok = _all_ok(list(windows.values()), full_run)
    target_ok = _all_ok(target_windows, target_run)
    full = max((k for k in range(1, full_run + 1) if full_ok[k]), default=0)
    target = max((k for k in range(1, target_run + 1) if target_ok[k]), default=0)
    missing: dict[str, int] = {}
    for i in range(full, target):
        for n in names:
            if n not in windows and not presence[i].get(n, False):
                missing[n] = missing.get(n, 0) + 1
    drafts = {m.name: m.trailing_chunks for m in members if m.name in windows and m.role is MemberRole.DRAFT}
    for n, window in drafts.items():  # windowed target members hold their window at `target` by construction
        lacking = sum(1 for i in range(max(0, target - (window or 0)), target) if not presence[i].get(n, False))
        if target > full and lacking:
            missing[n] = lacking
    target_only = policy is DraftPolicy.TARGET_ONLY
    hit, run, ok = (target, target_run, target_ok) if target_only else (full, full_run, full_ok)
    member_hits = {n: min(_leading(presence, [n]), target_run) for n in every}
    for n, w in windows.items():
        member_hits[n] = max((k for k in range(1, run + 1) if w[k]), default=0)
    restorable = tuple(k for k in range(1, run + 1) if ok[k])
    cut: tuple[str, ...] = ()
    parts = [m.name for m in members if m.role is MemberRole.TARGET and m.trailing_chunks is None]
    if target_run < len(presence) and len(parts) > 1:
        there = [n for n in parts if presence[target_run].get(n, False)]
        if there:
            cut = tuple(n for n in parts if n not in there)
    return GroupLookup(
        full, target, hit, tuple(names), tuple(target_names), missing, restorable, member_hits, boundary_missing=cut
    )


def _leading(presence: Sequence[dict[str, bool]], names: Sequence[str]) -> int:
    """Leading chunks that hold every member in `names`."""
    k = 0
    while k < len(presence) and all(presence[k].get(n, False) for n in names):
        k += 1
    return k


def _window_ok(presence: Sequence[dict[str, bool]], name: str, window: int | None) -> list[bool]:
    """ok[k] (k = 0..len(presence)): chunks max(0, k - window) .. k-1 all hold `name`.
    One pass with a running count of the chunks lacking it."""
    w = window or 0
    lacking = [0]
    for chunk in presence:
        lacking.append(lacking[-1] + (not chunk.get(name, False)))
    return [lacking[k] == lacking[max(0, k - w)] for k in range(len(presence) + 1)]


def _all_ok(windows: Sequence[list[bool]], limit: int) -> list[bool]:
    """ok[k] for k = 0..limit: every window in `windows` holds at boundary k."""
    return [all(w[k] for w in windows) for k in range(limit + 1)]


def tail_usable(members: Sequence[MemberSpec], stored_members: Sequence[str], matched: int, stored_tokens: int) -> bool:
    """Whether a stored tail of `stored_tokens`, of which `matched` match the prompt, can be
    loaded: a BOUNDARY member is the state after the tail's last token, so its tail
    serves only a prompt that contains the whole tail."""
    present = set(stored_members)
    return all(
        m.coverage is not Coverage.BOUNDARY or m.name not in present or matched == stored_tokens for m in members
    )
