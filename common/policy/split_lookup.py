"""Lookups over several head splits: each chunk from whichever split holds all of it.

Canonical objects (`kvpack.identity.heads`) of one chunk may be stored under several head
splits: a fleet that moved from TP=2 to TP=1 holds the old prompts as two head-range
objects per chunk and the new ones as one. A multi-turn conversation that started
before the move and goes on after it has both in one prefix: its first chunks under
the old split, the rest under the new one. A lookup that took one split for the whole
prefix would stop at the first chunk of the other and recompute the rest on every
later turn; this one picks, per chunk, the first member set (in the order given, the
reader's own first) that holds every member of that chunk, and the hit is the leading
run of chunks that some set holds completely. A chunk with some but not all objects of
a split right after the hit is a partial hit (`GroupLookup.boundary_missing`), never a
load of part of the heads.

Only for member sets of plain members (the whole KV of each chunk, no draft member, no
window): `plain`. Other sets are taken one per prefix (`lookup_sets`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..identity.keys import StoreKey
from .groups import GroupLookup, MemberRole, MemberSpec

Locate = Callable[[list[StoreKey]], list[str | None]]
"""`KVStore.locate` with its budget bound: the fastest tier holding each key, or None."""

Find = Callable[[Sequence[MemberSpec]], GroupLookup]
"""`KVStore`'s lookup of the chunks under one member set."""


def lookup_sets(
    locate: Locate,
    find: Find,
    tenant: str,
    fingerprint: str,
    chunks: Sequence[str],
    sets: Sequence[Sequence[MemberSpec]],
) -> GroupLookup:
    """`KVStore.lookup` over `sets` (the engine's own first): plain sets mix per chunk
    (`find_over_splits`); others one set for the whole prefix, the first that holds
    chunk 0 (the answer's `all_members` says which)."""
    if len(sets) > 1 and plain(sets):
        return find_over_splits(locate, tenant, fingerprint, chunks, sets)
    result = find(sets[0])
    for other in sets[1:]:
        if result.hit_chunks:
            break
        found = find(other)
        result = found if found.hit_chunks else result
    return result


def plain(sets: Sequence[Sequence[MemberSpec]]) -> bool:
    """Whether every member of every set is a target member of every chunk."""
    return all(m.role is MemberRole.TARGET and m.trailing_chunks is None for ms in sets for m in ms)


def find_over_splits(
    locate: Locate, tenant: str, fingerprint: str, chunks: Sequence[str], sets: Sequence[Sequence[MemberSpec]]
) -> GroupLookup:
    """The longest prefix of `chunks` whose every chunk some set of `sets` holds whole.

    At most two `locate` calls: the first set for every chunk, then, if some chunk is not
    held whole, every other set for those chunks in one call (one batched call per tier,
    one round trip to a Mooncake master, however many splits there are). The answer's
    `chunk_sets` says, per hit chunk, the index in `sets` it loads from (the first set
    in order that holds it whole); `located` holds the tier of each of those keys."""
    names = [tuple(m.name for m in ms) for ms in sets]
    chosen: list[int | None] = [None] * len(chunks)
    found: dict[int, list[tuple[StoreKey, str]]] = {}
    missing_at: dict[int, tuple[str, ...]] = {}
    """Per chunk no set held whole: the members the first set holding part of it lacks."""
    for phase in (range(1), range(1, len(sets))):
        todo = [i for i, c in enumerate(chosen) if c is None]
        if not todo:
            break
        asked = [(s, i) for s in phase for i in todo]
        keys = [[StoreKey(tenant, fingerprint, chunks[i], m) for m in names[s]] for s, i in asked]
        where = iter(locate([k for ks in keys for k in ks]))
        for (s, i), ks in zip(asked, keys):
            got = [(k, next(where)) for k in ks]
            if chosen[i] is not None:  # an earlier set holds it whole
                continue
            if all(t is not None for _, t in got):
                chosen[i] = s
                found[i] = [(k, t) for k, t in got if t is not None]
            elif any(t is not None for _, t in got) and i not in missing_at:
                missing_at[i] = tuple(k.member for k, t in got if t is None)
    hit = next((i for i, c in enumerate(chosen) if c is None), len(chunks))
    sets_used = tuple(c for c in chosen[:hit] if c is not None)
    return GroupLookup(
        hit,
        hit,
        hit,
        names[0],
        names[0],
        restorable=tuple(range(1, hit + 1)),
        member_hits={m: hit for m in names[0]},
        located={k: t for i in range(hit) for k, t in found[i]},
        boundary_missing=missing_at.get(hit, ()) if hit < len(chunks) else (),
        chunk_sets=sets_used,
        set_members=tuple(names),
    )
