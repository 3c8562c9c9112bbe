"""`Session.accept_hit`: a hit's tokens split by the tier (and medium) the lookup found them in.

Real tiers: a memory tier in front of a disk folder. The split covers exactly the tokens the
engine took (whole chunks and the stored tail), counts a chunk under its farthest member's
tier, and an unlocated plan (a handoff's) under no medium.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_hits import IDS, SCOPE, query, store_prompt

from kvpack import UNKNOWN_TIER, HandoffClaim, KVPackConfig, KVStore, Medium, Session
from kvpack.tiers.factory import build_tiers

GROUP = "ab" * 16


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[Callable[[], Session]]:
    """Sessions over one disk folder, each with its own (empty) memory tier."""
    opened: list[Session] = []

    def make() -> Session:
        cfg = KVPackConfig.from_dict({"memory": {"capacity": 1 << 20}, "disk": {"path": str(tmp_path / "disk")}})
        session = Session(KVStore(cfg, build_tiers(cfg)), GROUP)
        opened.append(session)
        return session

    yield make
    for session in opened:
        session.close()


def test_a_hit_is_split_by_the_tier_that_holds_it_and_sums_to_the_accepted_tokens(
    sessions: Callable[[], Session],
) -> None:
    writer = sessions()
    store_prompt(writer, tail=IDS[32:40])
    plan = writer.plan_hit(query())
    assert plan.matched == 39 and plan.tail is not None  # 2 whole chunks of 16, 7 tail tokens
    near = writer.accept_hit(plan, 39, 16)
    assert near.by_tier == {"memory": 39} and near.by_medium == {Medium.HOST: 39}
    assert writer.report.metrics.value("hit_tier_tokens", tier="memory") == 39
    assert writer.report.metrics.value("external_hit_tokens", tenant="default") == 39
    assert writer.flush(10.0)

    reader = sessions()  # a later engine on the same folder: its memory holds nothing
    plan = reader.plan_hit(query())
    assert plan.matched == 39
    far = reader.accept_hit(plan, 39 - 20, 16)  # the engine had the first 20 tokens itself
    assert far.by_tier == {"disk": 19} and far.by_medium == {Medium.DISK: 19} and far.tokens == 19
    assert reader.report.metrics.value("hit_tier_tokens", tier="disk") == 19
    assert reader.accept_hit(plan, 0, 16).by_tier == {}


def test_a_handoff_was_located_by_no_lookup(sessions: Callable[[], Session]) -> None:
    session = sessions()
    plan = session.plan_hit(query(), claim=HandoffClaim(tokens=32, tail_chunk=None))
    assert plan.matched == 32 and plan.scope == SCOPE
    split = session.accept_hit(plan, 32, 16)
    assert split.by_tier == {UNKNOWN_TIER: 32} and split.by_medium == {None: 32}
