"""Eviction invariants (property-based): capacity, whole groups, tenant shares."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
from helpers import chunk_id, make_item
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpack.config.schema import EvictionPolicyName
from kvpack.policy.eviction import CapacityManager, make_policy
from kvpack.policy.eviction.arc import ARCPolicy
from kvpack.policy.eviction.manager import Admission
from kvpack.policy.eviction.shares import Candidate, choose_victims
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.memory import MemoryTier

POLICIES = [EvictionPolicyName.LRU, EvictionPolicyName.ARC]
TENANTS = ["a", "b", "c"]

ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "touch", "remove"]),
        st.sampled_from(TENANTS),
        st.integers(0, 11),  # group index
        st.sampled_from(["kv", "draft"]),
        st.integers(1, 400),  # bytes
    ),
    max_size=120,
)


def _apply(mgr: CapacityManager, op: tuple[str, str, int, str, int], owner: dict[str, str]) -> None:
    kind, tenant, g, member, nbytes = op
    group = f"{tenant}:{g}"
    if kind == "put":
        plan = mgr.reserve(group, tenant, member, nbytes)
        if plan.admission is Admission.ADMITTED:
            for victim in plan.victims:
                assert victim != group
                mgr.release(victim)
            mgr.commit(group, tenant, member, nbytes)
    elif kind == "touch":
        mgr.touch(group)
    else:
        mgr.release(group)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=150, deadline=None)
@given(ops=ops, quota_a=st.integers(0, 600), capacity=st.integers(200, 2000))
def test_invariants_hold_under_any_sequence(policy: EvictionPolicyName, ops: list, quota_a: int, capacity: int) -> None:
    quotas = {"a": quota_a}
    mgr = CapacityManager(capacity, make_policy(policy), quotas)
    for op in ops:
        kind, tenant, g, member, nbytes = op
        before_a = mgr.tenant_used("a")
        group = f"{tenant}:{g}"
        plan = mgr.reserve(group, tenant, member, nbytes) if kind == "put" else None
        if plan is not None and plan.admission is Admission.ADMITTED:
            evicted_a = 0
            for victim in plan.victims:
                members = mgr.release(victim)
                assert members, "a victim must be a resident group"
                if str(victim).startswith("a:"):
                    evicted_a += sum(members.values())
            mgr.commit(group, tenant, member, nbytes)
            if tenant != "a" and evicted_a:
                # another tenant never pushes "a" below its guaranteed share
                assert before_a - evicted_a >= quota_a
        elif kind != "put":
            _apply(mgr, op, {})
        # capacity is never exceeded
        assert mgr.used <= capacity
        # per-tenant accounting adds up; groups are whole (every member accounted)
        assert sum(mgr.tenant_used(t) for t in TENANTS) == mgr.used
        assert sum(sum(mgr.members(g).values()) for g in mgr.groups()) == mgr.used


def test_over_quota_tenant_evicts_itself_first() -> None:
    mgr = CapacityManager(1000, make_policy(EvictionPolicyName.LRU), {"a": 300, "b": 300})
    for i in range(3):
        mgr.commit(f"b:{i}", "b", "kv", 100)  # b: 300, at its share
    for i in range(7):
        mgr.commit(f"a:{i}", "a", "kv", 100)  # a: 700, over its share
    # b's groups are the oldest, but a is over its share: a's own go first.
    plan = mgr.reserve("a:new", "a", "kv", 200)
    assert plan.admission is Admission.ADMITTED
    assert all(str(v).startswith("a:") for v in plan.victims)
    assert len(plan.victims) == 2


def test_tenant_cannot_push_another_below_its_share() -> None:
    mgr = CapacityManager(600, make_policy(EvictionPolicyName.LRU), {"a": 300})
    for i in range(3):
        mgr.commit(f"a:{i}", "a", "kv", 100)
    for i in range(3):
        mgr.commit(f"b:{i}", "b", "kv", 100)
    plan = mgr.reserve("b:new", "b", "kv", 200)
    # a's groups are least recent, but a is exactly at its share: b evicts its own.
    assert plan.admission is Admission.ADMITTED
    assert all(str(v).startswith("b:") for v in plan.victims)
    # and if b alone cannot make room, the store is refused, nothing evicted
    mgr2 = CapacityManager(300, make_policy(EvictionPolicyName.LRU), {"a": 300})
    for i in range(3):
        mgr2.commit(f"a:{i}", "a", "kv", 100)
    assert mgr2.reserve("b:0", "b", "kv", 100).admission is Admission.NO_SPACE


def test_lru_order_follows_touches() -> None:
    mgr = CapacityManager(300, make_policy(EvictionPolicyName.LRU))
    for i in range(3):
        mgr.commit(i, "t", "kv", 100)
    mgr.touch(0)
    plan = mgr.reserve(3, "t", "kv", 100)
    assert plan.victims == (1,)


def test_arc_prefers_recency_list_and_adapts() -> None:
    arc = ARCPolicy()
    for k in range(4):
        arc.insert(k)
    arc.touch(0)  # 0 moves to the frequency list
    assert list(arc.victims())[:3] == [1, 2, 3]
    arc.remove(1)  # ghost in B1
    arc.insert(1)  # a B1 ghost hit grows T1's target and enters T2
    assert arc.target_t1 > 0
    assert 1 in set(arc.victims())
    assert len(arc) == 4


@pytest.mark.parametrize("policy", POLICIES)
def test_victims_yield_each_resident_once(policy: EvictionPolicyName) -> None:
    p = make_policy(policy)
    for k in range(1000):
        p.insert(k)
    for k in range(0, 1000, 3):
        p.touch(k)
    order = list(p.victims())
    assert sorted(order) == list(range(1000))


@pytest.mark.parametrize("policy", POLICIES)
def test_batch_eviction_is_linear(policy: EvictionPolicyName) -> None:
    # Count policy work instead of timing: victims() must be consumed once per batch.
    class Counting(type(make_policy(policy))):  # type: ignore[misc]
        calls = 0

        def victims(self):  # type: ignore[no-untyped-def]
            Counting.calls += 1
            return super().victims()

    mgr = CapacityManager(100_000, Counting())
    for i in range(1000):
        mgr.commit(i, "t", "kv", 100)
    plan = mgr.reserve("big", "t", "kv", 50_000)
    assert len(plan.victims) == 500
    assert Counting.calls <= 2


@pytest.mark.parametrize("policy", POLICIES)
def test_regression_tenant_without_quota_keeps_more_than_one_group(policy: EvictionPolicyName) -> None:
    # Found by the soak suite: with no quotas configured, a tenant inserting into a
    # full tier evicted only its own groups, so a newcomer could hold one group.
    mgr = CapacityManager(1000, make_policy(policy))
    for i in range(10):
        mgr.commit(f"a:{i}", "a", "kv", 100)
    for i in range(5):
        plan = mgr.reserve(f"b:{i}", "b", "kv", 100)
        assert plan.admission is Admission.ADMITTED
        for victim in plan.victims:
            mgr.release(victim)
        mgr.commit(f"b:{i}", "b", "kv", 100)
    assert mgr.tenant_used("b") == 500


batches = st.lists(
    st.tuples(
        st.sampled_from(TENANTS),
        st.lists(
            st.tuples(st.integers(0, 11), st.sampled_from(["kv", "draft"]), st.integers(1, 300)), min_size=1, max_size=6
        ),
    ),
    max_size=40,
)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=150, deadline=None)
@given(batches=batches, quota_a=st.integers(0, 600), capacity=st.integers(200, 2000))
def test_batch_admission_keeps_every_invariant(
    policy: EvictionPolicyName, batches: list, quota_a: int, capacity: int
) -> None:
    """`admit` (one reservation per batch, else one per request) keeps the same invariants as
    single reservations: capacity, whole groups, never a group of the batch, other tenants' shares."""
    quotas = {"a": quota_a}
    mgr = CapacityManager(capacity, make_policy(policy), quotas)
    for tenant, reqs in batches:
        requests = [(f"{tenant}:{g}", member, nbytes) for g, member, nbytes in reqs]
        batch_groups = {g for g, _, _ in requests}
        before_a = mgr.tenant_used("a")
        evicted: list[str] = []

        def evict(groups: object) -> None:
            for group, members in zip(groups, mgr.release_many(groups)):  # type: ignore[call-overload]
                assert members, "a victim must be a resident group"
                evicted.append(str(group))

        plan = mgr.reserve_many(tenant, requests)
        admitted = mgr.admit(tenant, requests, evict)
        if plan.admission is Admission.ADMITTED:
            assert admitted == [True] * len(requests)
            assert not batch_groups & set(evicted), "a batch never evicts its own groups"
            for group, member, nbytes in requests:
                assert mgr.has_member(group, member)
        if tenant != "a":
            # another tenant's batch never pushes "a" below its guaranteed share
            assert mgr.tenant_used("a") >= min(quota_a, before_a)
        assert mgr.used <= capacity
        assert mgr.used == sum(mgr.tenant_used(t) for t in TENANTS)


def test_batch_reservation_of_one_equals_single_reservation() -> None:
    for policy in POLICIES:
        one = CapacityManager(1000, make_policy(policy), {"a": 300})
        many = CapacityManager(1000, make_policy(policy), {"a": 300})
        for mgr in (one, many):
            for i in range(4):
                mgr.commit(f"a:{i}", "a", "kv", 100)
            for i in range(5):
                mgr.commit(f"b:{i}", "b", "kv", 100)
        assert one.reserve("b:new", "b", "kv", 250) == many.reserve_many("b", [("b:new", "kv", 250)])


def test_batch_that_does_not_fit_falls_back_to_one_by_one() -> None:
    mgr = CapacityManager(400, make_policy(EvictionPolicyName.LRU))
    requests = [(f"t:{i}", "kv", 100) for i in range(6)]
    assert mgr.reserve_many("t", requests).admission is Admission.NO_SPACE
    evicted: list[object] = []
    admitted = mgr.admit("t", requests, lambda gs: evicted.extend(zip(gs, mgr.release_many(gs))))
    assert admitted == [True] * 6  # each admitted in turn; the first two then evicted by later ones
    assert [g for g, _ in evicted] == ["t:0", "t:1"]
    assert mgr.used == 400 and not mgr.has_member("t:0", "kv")


def _groups(*rows: tuple[str, str, int]) -> list[Candidate]:
    return [Candidate(g, tenant, n) for g, tenant, n in rows]


@pytest.mark.parametrize(
    ("requester", "delta", "quotas", "want"),
    [
        ("a", 1, {}, ["a0"]),  # no shares: plain candidate order
        ("b", 1, {"a": 2}, ["b0"]),  # a at its share of 2: only b's own group may go
        ("a", 1, {"a": 1}, ["a0"]),  # a over its share evicts its own first
        ("c", 3, {"a": 2}, None),  # b's two groups free 2 of 3 and a is protected: nothing goes
        ("c", 0, {}, []),  # fits as it is
    ],
)
def test_the_victim_rule(requester: str, delta: int, quotas: dict[str, int], want: list[str] | None) -> None:
    resident = _groups(("a0", "a", 1), ("b0", "b", 1), ("a1", "a", 1), ("b1", "b", 1))

    def candidates(tenant: str | None) -> list[Candidate]:
        return [c for c in resident if tenant is None or c.tenant == tenant]

    used = {"a": 2, "b": 2}
    got = choose_victims(requester, delta, 4, 4, used, quotas, candidates)
    assert (None if got is None else [c.group for c in got]) == want


def test_the_memory_tier_and_the_disk_index_evict_the_same_groups(tmp_path: Path) -> None:
    # One rule (`kvpack.policy.eviction.shares`) for both accountings: the same stores, one at a time,
    # leave the same groups resident in the in-process one and in the shared SQLite one.
    quotas = {"a": 2048, "b": 1024}
    memory = MemoryTier(4096, make_policy(EvictionPolicyName.LRU), quotas, pin=False)
    disk = DiskTier(tmp_path / "disk", 4096, quotas)
    rng = random.Random(7)
    every = [make_item(t, chunk_id(i), seed=i)[0] for t in "abc" for i in range(4)]
    for step in range(60):
        item = make_item(rng.choice("abc"), chunk_id(rng.randrange(4)), seed=step)[0]
        assert memory.put_from([item]) == disk.put_from([item]), f"step {step}"
        keys = [it.key for it in every]
        assert memory.contains(keys) == disk.contains(keys), f"step {step}"
    memory.close()
    disk.close()


def test_the_quota_rule_is_written_once() -> None:
    # "never push another tenant below its guaranteed share": a tenant's share is compared with
    # bytes in one module of the core only, whatever accounting (memory, the disk index) applies it
    core = Path(__file__).resolve().parents[2] / "common"
    found = {
        str(path.relative_to(core))
        for path in core.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Compare) and "quota" in ast.unparse(node)
    }
    assert found == {"policy/eviction/shares.py"}
