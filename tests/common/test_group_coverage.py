"""Members that do not cover every chunk: sliding-window KV (TRAILING) and recurrent state (BOUNDARY).

`resolve_lookup` must answer the longest prefix whose trailing chunks hold every
windowed member, never a prefix whose window has a hole, and must not call a
member missing before its window (that is where the engine freed it).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpack.config.schema import DraftPolicy
from kvpack.policy.groups import Coverage, MemberRole, MemberSpec, resolve_lookup, tail_usable

KV = MemberSpec("kv", "f")
SWA = MemberSpec("kv_g1", "f", coverage=Coverage.TRAILING, window_chunks=2)
STATE = MemberSpec("kv_g2", "f", MemberRole.STATE, coverage=Coverage.BOUNDARY)
DRAFT = MemberSpec("draft", "f", MemberRole.DRAFT)


def chunks(**present: str) -> list[dict[str, bool]]:
    """present: member -> a string of 0/1 per chunk."""
    n = max(len(v) for v in present.values())
    return [{m: v[i] == "1" for m, v in present.items()} for i in range(n)]


def test_sliding_window_member_needed_only_in_the_trailing_chunks() -> None:
    # kv everywhere; the window member was freed by the engine in chunks 0-2
    r = resolve_lookup(chunks(kv="111111", kv_g1="000111"), [KV, SWA], DraftPolicy.RECOMPUTE)
    assert r.hit_chunks == 6 and r.full_chunks == 6 and not r.missing


def test_a_hole_in_the_window_moves_the_hit_down_to_a_whole_window() -> None:
    # chunk 4 lacks the window member: k=6 and k=5 see it; k=4 needs chunks 2,3: 3 is there, 2 is not
    r = resolve_lookup(chunks(kv="111111", kv_g1="011101"), [KV, SWA], DraftPolicy.RECOMPUTE)
    assert r.hit_chunks == 4
    r = resolve_lookup(chunks(kv="111111", kv_g1="000001"), [KV, SWA], DraftPolicy.RECOMPUTE)
    assert r.hit_chunks == 0


def test_boundary_state_needed_only_at_the_boundary() -> None:
    r = resolve_lookup(chunks(kv="11111", kv_g2="01010"), [KV, STATE], DraftPolicy.RECOMPUTE)
    assert r.hit_chunks == 4
    r = resolve_lookup(chunks(kv="11100", kv_g2="00011"), [KV, STATE], DraftPolicy.RECOMPUTE)
    assert r.hit_chunks == 0  # state only where the kv ends early: no valid boundary


def test_draft_partial_hits_still_counted_with_windowed_members() -> None:
    p = chunks(kv="1111", draft="1100", kv_g1="0011")
    r = resolve_lookup(p, [KV, DRAFT, SWA], DraftPolicy.RECOMPUTE)
    assert (r.full_chunks, r.target_chunks, r.hit_chunks) == (0, 4, 0)  # k=2 lacks its window (chunks 0,1)
    assert r.missing == {"draft": 2}  # chunks 2 and 3 lack it
    r = resolve_lookup(p, [KV, DRAFT, SWA], DraftPolicy.TARGET_ONLY)
    assert r.hit_chunks == 4


def test_windowed_members_need_a_window_and_draft_state_is_never_boundary_only() -> None:
    with pytest.raises(ValueError):
        MemberSpec("kv_g1", "f", coverage=Coverage.TRAILING, window_chunks=0)
    with pytest.raises(ValueError):
        MemberSpec("draft", "f", MemberRole.DRAFT, coverage=Coverage.BOUNDARY)


DRAFT_SWA = MemberSpec("draft_swa", "f", MemberRole.DRAFT, coverage=Coverage.TRAILING, window_chunks=1)


@pytest.mark.parametrize("policy", list(DraftPolicy))
def test_a_windowed_draft_member_bounds_the_full_hit_only(policy: DraftPolicy) -> None:
    # SGLang's draft_swa: the target's window (kv_g1) holds at 3 and 4, the draft's (window 1) only at 3
    p = chunks(kv="1111", kv_g1="0111", draft_swa="0010")
    r = resolve_lookup(p, [KV, SWA, DRAFT_SWA], policy)
    assert (r.full_chunks, r.target_chunks) == (3, 4)
    assert r.missing == {"draft_swa": 1}  # chunk 3, the window at the target's boundary, lacks it
    if policy is DraftPolicy.RECOMPUTE:
        assert r.hit_chunks == 3 and r.restorable == (3,)
        assert r.member_hits == {"kv": 4, "kv_g1": 4, "draft_swa": 3}
    else:
        assert r.hit_chunks == 4 and r.restorable == (3, 4)


def test_restorable_lists_every_valid_boundary_not_only_the_longest() -> None:
    r = resolve_lookup(chunks(kv="111111", kv_g1="011011"), [KV, SWA], DraftPolicy.RECOMPUTE)
    assert r.restorable == (3, 6) and r.hit_chunks == 6  # 4 and 5 see a hole in their window
    assert resolve_lookup(chunks(kv="1111"), [KV], DraftPolicy.RECOMPUTE).restorable == (1, 2, 3, 4)


def test_state_tail_only_whole() -> None:
    assert tail_usable([KV, STATE], ["kv", "kv_g2"], 40, 40)
    assert not tail_usable([KV, STATE], ["kv", "kv_g2"], 39, 40)
    assert tail_usable([KV, SWA], ["kv", "kv_g1"], 39, 40)


def _reference(presence: list[dict[str, bool]], window: int) -> int:
    """Brute force: the largest k whose chunks all hold kv and whose last `window` hold kv_g1."""
    best = 0
    for k in range(1, len(presence) + 1):
        if all(presence[i]["kv"] for i in range(k)) and all(presence[i]["kv_g1"] for i in range(max(0, k - window), k)):
            best = k
    return best


@given(
    st.lists(st.tuples(st.booleans(), st.booleans()), max_size=12),
    st.integers(min_value=1, max_value=4),
)
def test_matches_brute_force(bits: list[tuple[bool, bool]], window: int) -> None:
    presence = [{"kv": a, "kv_g1": b} for a, b in bits]
    swa = MemberSpec("kv_g1", "f", coverage=Coverage.TRAILING, window_chunks=window)
    r = resolve_lookup(presence, [KV, swa], DraftPolicy.RECOMPUTE)
    assert r.hit_chunks == _reference(presence, window)
    # every valid boundary, as SGLang's own file backend lists them (restorable_prefix_pages)
    want = [k for k in range(1, len(presence) + 1) if _reference(presence[:k], window) == k]
    assert list(r.restorable) == want


def test_a_group_cut_short_by_one_of_its_parts_names_the_missing_part() -> None:
    """Two every-chunk target members (TP shards, KV-head ranges): a chunk holding one of
    them ends the hit and names the other; a chunk holding neither is a plain end."""
    from kvpack.config.schema import DraftPolicy
    from kvpack.policy.groups import MemberSpec, resolve_lookup

    members = [MemberSpec("kv_h0_1", "f"), MemberSpec("kv_h1_2", "f")]
    both, first_only, none = {"kv_h0_1": True, "kv_h1_2": True}, {"kv_h0_1": True}, {}
    cut = resolve_lookup([both, first_only, both], members, DraftPolicy.RECOMPUTE)
    assert cut.hit_chunks == 1 and cut.boundary_missing == ("kv_h1_2",)
    end = resolve_lookup([both, none, both], members, DraftPolicy.RECOMPUTE)
    assert end.hit_chunks == 1 and end.boundary_missing == ()
    single = resolve_lookup([both, none], members[:1], DraftPolicy.RECOMPUTE)
    assert single.boundary_missing == ()
