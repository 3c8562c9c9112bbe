"""`kvpack.policy.hits` through `Session.plan_hit` / `plan_handoff` / `lookups_held`, over real tiers.

The hit rules every adapter relies on, engine-neutral: whole chunks, then the stored
tail's longest common prefix in units of ``prefix_match_unit``; at most n - 1 tokens
(n - 2 with a drafter); a tail's draft loaded only when stored; a handoff's tail only
when it is a tail slot of the prompt; requests held while a tier makes its first connect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvpack import (
    ChunkFacts,
    HandoffClaim,
    HitPlan,
    HitQuery,
    KVPackConfig,
    KVStore,
    MemberObject,
    MemberRole,
    MemberSpec,
    ObjectIO,
    RequestScope,
    Session,
    chunk_hashes,
    tail_chunk,
)
from kvpack.tiers.factory import build_tiers

GROUP = "ab" * 16
FP = "cd" * 16
BS = 16
KV = MemberSpec("kv", FP)
DRAFT = MemberSpec("draft", FP, MemberRole.DRAFT)
IDS = list(range(1000, 1040))  # 2 whole chunks and 8 more
HASHES = chunk_hashes(IDS, BS)
SCOPE = RequestScope(tenant="default", seed=None)


@pytest.fixture
def make_session(tmp_path: Path) -> Iterator[Callable[..., Session]]:
    opened: list[Session] = []

    def make(**config: object) -> Session:
        cfg = KVPackConfig.from_dict(
            {"memory": {"capacity": 1 << 20}, "disk": {"path": str(tmp_path / f"disk{len(opened)}")}, **config}
        )
        session = Session(KVStore(cfg, build_tiers(cfg)), GROUP)
        opened.append(session)
        return session

    yield make
    for session in opened:
        session.close()


def put(session: Session, chunk: str, member: str, ids: Sequence[int] | None = None) -> None:
    facts = ChunkFacts(chunk, len(ids) if ids else BS, tuple(ids) if ids else None)
    payload = np.zeros(64, dtype=np.uint8)
    result = session.save("default", [ObjectIO(facts, MemberObject(member, FP), memoryview(payload))], dedupe=False)
    assert all(st.name == "OK" for st in result.statuses)


def store_prompt(session: Session, members: Sequence[str] = ("kv",), tail: Sequence[int] = ()) -> None:
    for h in HASHES:
        for m in members:
            put(session, h, m)
    if tail:
        chunk, _ = session.place_tail("default", HASHES[-1], members, tail)
        for m in members:
            put(session, chunk, m, tail)


def query(ids: Sequence[int] = IDS, members: Sequence[MemberSpec] = (KV,), min_prefill_tokens: int = 1) -> HitQuery:
    drafts = tuple(m.name for m in members if m.role is MemberRole.DRAFT)
    return HitQuery(
        scope=SCOPE,
        token_ids=list(ids),
        chunk_tokens=BS,
        min_prefill_tokens=min_prefill_tokens,
        members=members,
        draft_members=drafts,
    )


def test_plans_are_built_by_keyword_only() -> None:
    with pytest.raises(TypeError):
        HitPlan(40, None)  # type: ignore[misc]
    assert HitPlan.miss(40) == HitPlan(num_tokens=40, scope=None)


def test_whole_chunks_then_the_tail_up_to_n_minus_one(make_session: Callable[..., Session]) -> None:
    session = make_session()
    store_prompt(session, tail=IDS[32:40])
    plan = session.plan_hit(query())
    assert (plan.hit_chunks, plan.matched) == (2, 39)  # vLLM computes the last token
    assert plan.tail is not None and plan.tail.token_ids == tuple(IDS[32:39]) and plan.tail.stored_tokens == 8
    assert session.metrics.value("tail_hit_tokens", tenant="default") == 7
    drafter = session.plan_hit(query(min_prefill_tokens=2))
    assert drafter.matched == 38 and drafter.tail is not None and len(drafter.tail.token_ids) == 6


def test_a_tail_is_reused_to_the_longest_common_prefix_in_match_units(
    make_session: Callable[..., Session],
) -> None:
    session = make_session(prefix_match_unit=4)
    store_prompt(session, tail=IDS[32:40])
    other = IDS[:37] + [7, 7, 7, 7]  # shares 5 of the tail's 8 tokens
    plan = session.plan_hit(query(other))
    assert plan.matched == 32 + 4 and plan.tail is not None and plan.tail.token_ids == tuple(IDS[32:36])
    assert session.plan_hit(query(IDS[:34] + [7] * 6)).tail is None  # 2 shared: below one match unit


def test_a_tail_without_its_draft_loads_the_target_only_under_target_only(
    make_session: Callable[..., Session],
) -> None:
    session = make_session(draft_policy="target_only")
    store_prompt(session, members=("kv", "draft"))
    chunk, _ = session.place_tail("default", HASHES[-1], ("kv",), IDS[32:40])
    put(session, chunk, "kv", IDS[32:40])  # the draft member of the tail is missing
    plan = session.plan_hit(query(members=(KV, DRAFT)))
    assert plan.full_chunks == 2 and plan.tail is not None and not plan.tail.with_draft
    strict = make_session()  # recompute: no hit past what lacks the draft
    store_prompt(strict, members=("kv", "draft"))
    put(strict, chunk, "kv", IDS[32:40])
    assert strict.plan_hit(query(members=(KV, DRAFT))).matched == 32


@pytest.mark.parametrize(
    ("tail", "matched"),
    [(tail_chunk(HASHES[1]), 39), (tail_chunk(HASHES[1], 2), 39), (tail_chunk(HASHES[0]), 32), ("", 32)],
)
def test_a_handoff_loads_its_tail_only_from_a_tail_slot_of_the_prompt(
    make_session: Callable[..., Session], tail: str, matched: int
) -> None:
    session = make_session()
    plan = session.plan_handoff(query(), HandoffClaim(tokens=40, tail_chunk=tail))
    assert plan.handoff and plan.hit_chunks == 2 and plan.matched == matched
    assert (plan.tail is not None) == (matched == 39)
    assert session.metrics.value("handoff_tails_dropped") == (matched == 32)


class WarmingTier:
    """Wraps a real tier; says it is making its first connect until `connected`."""

    def __init__(self, tier: object) -> None:
        self._tier = tier
        self.connected = False

    def warming_up(self) -> bool:
        return not self.connected

    def __getattr__(self, name: str) -> object:
        return getattr(self._tier, name)


def test_requests_are_held_while_a_tier_makes_its_first_connect(tmp_path: Path) -> None:
    cfg = KVPackConfig.from_dict({"memory": {"enabled": False}, "disk": {"path": str(tmp_path / "d")}})
    (disk,) = build_tiers(cfg)
    warming = WarmingTier(disk)
    session = Session(KVStore(cfg, [warming]), GROUP)  # type: ignore[list-item]
    try:
        asked: list[int] = []

        def scope_of() -> RequestScope:
            asked.append(1)
            return SCOPE

        assert session.lookups_held(scope_of) and session.lookups_held(scope_of)
        assert not session.lookups_held(lambda: None)  # a request without the cache is never held
        assert session.metrics.value("lookups_held", tenant="default") == 2
        warming.connected = True
        assert not session.lookups_held(scope_of) and len(asked) == 2  # the scope is asked only while warming
    finally:
        session.close()
