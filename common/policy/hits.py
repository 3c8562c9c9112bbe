"""Hit planning: how many of a request's tokens the store supplies, and from which objects.

An adapter states a request's facts (`HitQuery`: tenant and chain seed, token ids,
tokens per chunk, the members each chunk needs, how many tokens the engine must
compute itself) and reads back a `HitPlan`; `Session.plan_hit` and
`Session.plan_handoff` run the rules below with the session's store.

- Whole chunks: one batched lookup over the chained hashes of every whole chunk
  (`KVStore.lookup`): the leading chunks whose every required member is stored.
  Canonical objects of another TP size are other member sets (`alternatives`,
  `kvpack.policy.split_lookup`): each chunk from the first set holding all of it.
- Tail: after the last hit chunk, the stored tail sharing the longest common
  prefix with the prompt's next tokens (`TailSlots.find`), in units of
  ``prefix_match_unit``; a tail whose recurrent state covers more tokens than the
  prompt shares is not used (`tail_usable`). The match may end inside a block: the
  engine loads the partial block whole and computes the rest into it.
- The engine computes at least ``min_prefill_tokens`` tokens (1; 2 with a drafter
  model): a prompt stored whole hits n - 1 tokens (n - 2 with a drafter).
- Drafts: a chunk lacking its draft member is a hit only under ``target_only``
  (`GroupLookup.full_chunks`: the leading chunks with every member); a tail loads
  its draft only when every draft member holds it (`PlannedTail.with_draft`).
- Handoffs (prefill/decode through the store): the chunks a prefill instance
  computed, then its tail, capped as above; a tail that is not one of the tail
  slots after the prompt's last whole chunk is dropped (counted as
  ``handoff_tails_dropped``) and the whole chunks still load.
- Warm-up: while a tier makes its first connect a lookup would miss what it holds,
  so `Session.lookups_held` tells the adapter to hold the request (counted as
  ``lookups_held``) until the tier's ``connect_wait_ms`` ends it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config.schema import KVPackConfig
from ..identity.keys import ChunkHash
from ..observe.metrics import Metrics
from .groups import GroupLookup, MemberSpec, tail_usable
from .tails import TAIL_SLOTS, TailMatch, tail_chunk
from .tenancy import RequestScope

TailFinder = Callable[[str | None, Sequence[int], Sequence[MemberSpec]], "TailMatch | None"]
"""(parent chunk, the prompt's tokens after it, members) -> the best stored tail (`TailSlots.find`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HitQuery:
    """One request's facts a hit is planned from (the engine's, translated by its adapter)."""

    scope: RequestScope
    """Tenant and chain seed (`kvpack.policy.tenancy.resolve_tenant`)."""
    token_ids: Sequence[int]
    """The request's tokens: every one the hit may cover and the ones the engine computes."""
    chunk_tokens: int
    """Tokens per chunk (the engine's block or page size)."""
    min_prefill_tokens: int = 1
    """The fewest tokens the engine computes itself: a hit covers at most
    ``len(token_ids) - min_prefill_tokens`` tokens."""
    members: Sequence[MemberSpec]
    """The members each chunk needs (`MemberSpec.coverage` says where)."""
    alternatives: Sequence[Sequence[MemberSpec]] = ()
    """Other member sets a chunk may be read as (canonical objects of other head splits)."""
    draft_members: Sequence[str] = ()
    """Names of the draft members among `members` (a tail loads them only if all are there)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedTail:
    """The stored tail a hit reads into the block after its whole chunks."""

    chunk: str
    stored_tokens: int
    """Tokens the stored tail holds (the object's token count)."""
    token_ids: tuple[int, ...]
    """The leading tokens of it the hit uses (a load requires the stored ids to start with them)."""
    with_draft: bool = True
    """Whether its draft members are loaded too."""
    source: int = 0
    """The member set it is read as (0: `HitQuery.members`, i: ``alternatives[i - 1]``)."""
    tiers: tuple[str, ...] = ()
    """The tiers the lookup found its members in (empty: not known, e.g. a handoff's)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HitPlan:
    """The outcome of one request's hit planning. Built by keyword only."""

    num_tokens: int
    """Tokens of the request when it was planned (a plan is valid for that count)."""
    scope: RequestScope | None
    """The request's tenant and seed (None: the request runs without the cache)."""
    hashes: tuple[ChunkHash, ...] = ()
    """Chained hashes of the request's whole chunks."""
    hit_chunks: int = 0
    """Leading whole chunks the hit loads."""
    matched: int = 0
    """Tokens the hit covers (whole chunks, then the tail's used part); at most
    ``num_tokens - min_prefill_tokens``."""
    tail: PlannedTail | None = None
    """The tail read into block `hit_chunks`, when the match reaches into it."""
    full_chunks: int = 0
    """Leading hit chunks with every member; chunks ``full_chunks..hit_chunks`` lack the
    draft (``target_only``) and load the target members only."""
    handoff: bool = False
    """A prefill instance's prompt: loaded with a bounded wait for objects still landing."""
    sources: tuple[int, ...] = ()
    """Per hit chunk, the member set it is read as (`PlannedTail.source`)."""
    tiers: tuple[tuple[tuple[str, str], ...], ...] = ()
    """Per hit chunk, (member, tier) where the lookup found each member."""

    @classmethod
    def miss(cls, num_tokens: int, scope: RequestScope | None = None) -> HitPlan:
        """No hit: the engine computes every token."""
        return cls(num_tokens=num_tokens, scope=scope)


@dataclass(frozen=True, kw_only=True, slots=True)
class HandoffClaim:
    """What a prefill instance says it stored for a request (its handoff, already checked
    for layout and tenant by the adapter): a client's word, verified here where it can be."""

    tokens: int
    """Prompt tokens it computed and saved."""
    tail_chunk: str | None
    """Where it saved the prompt's partial-block tail (None: none)."""
    source: int = 0
    """The member set it wrote (its head split: index into [members, *alternatives])."""


def tail_slots(parent: str | None) -> tuple[str, ...]:
    """Every chunk a tail after `parent` may be stored under (`TAIL_SLOTS` of them)."""
    return tuple(tail_chunk(parent, slot) for slot in range(TAIL_SLOTS))


def _cap(query: HitQuery) -> int:
    """The most tokens a hit may cover."""
    return len(query.token_ids) - query.min_prefill_tokens


def plan_lookup(
    query: HitQuery,
    hashes: tuple[ChunkHash, ...],
    result: GroupLookup,
    find_tail: TailFinder,
    config: KVPackConfig,
    metrics: Metrics,
) -> HitPlan:
    """The hit of `query` from its lookup `result` (over `hashes`) and the stored tail
    `find_tail` gives after the last hit chunk (module docstring)."""
    bs = query.chunk_tokens
    n = len(query.token_ids)
    tenant = query.scope.tenant
    k = result.hit_chunks
    sources = result.chunk_sets or (0,) * k
    if query.alternatives and any(sources):
        metrics.inc("other_split_hits")
    source = sources[-1] if k else 0  # the tail is read as the member set of the chunk before it
    members = [query.members, *query.alternatives][source]
    last = _cap(query)
    matched = k * bs
    match: TailMatch | None = None
    rest: Sequence[int] = ()
    if config.tail_reuse and k * bs < last:
        rest = query.token_ids[k * bs : min(last, (k + 1) * bs)]
        match = find_tail(hashes[k - 1] if k else query.scope.seed, rest, members)
        if match is not None and not tail_usable(members, match.members, match.tokens, match.stored_tokens):
            match = None  # a recurrent state of a longer tail: not the state this prompt needs
        if match is not None and match.tokens > 0:
            matched = k * bs + match.tokens
    matched = min(matched, last)
    matched -= (matched % bs) % config.prefix_match_unit
    tail: PlannedTail | None = None
    if match is not None and match.tokens > 0 and matched > k * bs:
        used = tuple(int(t) for t in rest[: matched - k * bs])
        with_draft = all(m in match.members for m in query.draft_members)
        tail = PlannedTail(
            chunk=match.chunk,
            stored_tokens=match.stored_tokens,
            token_ids=used,
            with_draft=with_draft,
            source=source,
            tiers=match.tiers,
        )
        metrics.inc("tail_hit_tokens", len(used), tenant=tenant)
    found: dict[str, list[tuple[str, str]]] = {}
    for key, tier in result.located.items():  # the tier of each key of the hit, for the loads
        found.setdefault(key.chunk, []).append((key.member, tier))
    return HitPlan(
        num_tokens=n,
        scope=query.scope,
        hashes=hashes,
        hit_chunks=k,
        matched=max(matched, 0),
        tail=tail,
        full_chunks=min(result.full_chunks, k),
        sources=tuple(sources),
        tiers=tuple(tuple(found.get(h, ())) for h in hashes[:k]),
    )


def plan_handoff(
    query: HitQuery, hashes: tuple[ChunkHash, ...], claim: HandoffClaim, config: KVPackConfig, metrics: Metrics
) -> HitPlan:
    """Load what a prefill instance computed: its whole chunks, then its tail (capped at
    ``len(token_ids) - min_prefill_tokens``), as the objects of member set `claim.source`.
    A tail that is not a tail slot after the prompt's last whole chunk is dropped, counted,
    and the whole chunks still load."""
    bs = query.chunk_tokens
    full = min(claim.tokens // bs, len(hashes))
    matched = min(claim.tokens, _cap(query))
    tail: PlannedTail | None = None
    if matched > full * bs:
        parent = hashes[full - 1] if full else query.scope.seed
        if claim.tail_chunk is None or not config.tail_reuse:
            matched = full * bs
        elif claim.tail_chunk not in tail_slots(parent):  # not this prompt's tail: its chunks still load
            metrics.inc("handoff_tails_dropped")
            matched = full * bs
        else:
            used = tuple(int(t) for t in query.token_ids[full * bs : matched])
            tail = PlannedTail(
                chunk=claim.tail_chunk, stored_tokens=claim.tokens - full * bs, token_ids=used, source=claim.source
            )
            metrics.inc("tail_hit_tokens", len(used), tenant=query.scope.tenant)
    metrics.inc("handoff_planned")
    return HitPlan(
        num_tokens=len(query.token_ids),
        scope=query.scope,
        hashes=hashes,
        hit_chunks=full,
        matched=max(matched, 0),
        tail=tail,
        full_chunks=full,
        handoff=True,
        sources=(claim.source,) * full,
    )
