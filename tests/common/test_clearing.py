"""The one rule for resets and clears (`kvpack.policy.clearing`) on the real memory, host and disk tiers.

Each tier holds the objects of two tenants under two group fingerprints (two models sharing a
folder); a clear of one (tenant, fingerprint) removes exactly those, counted in objects and bytes,
from the tier's own index; a dry run counts the same and removes nothing; a load of a removed
object is a miss, never an error; the engine's reset takes its fingerprint at the time of the call;
the ``reset`` section is checked like every config field.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fixtures.builders import MEMBER_FP, TOKENS, chunk_id, header, payload
from kvpack import (
    ClearScope,
    ConfigError,
    Expectation,
    KVLayoutSpec,
    KVPackConfig,
    KVStore,
    PutItem,
    Session,
    StoreKey,
    TierStatus,
)
from kvpack.config.reset import ResetConfig, ResetScope
from kvpack.observe.tier_events import TierEventKind
from kvpack.policy.clearing import engine_scope
from kvpack.policy.eviction import make_policy
from kvpack.tiers.base import Tier
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.host import HostTier, host_root
from kvpack.tiers.memory import MemoryTier

FP_A = KVLayoutSpec(engine="test", model="model-a", dtype="bfloat16", chunk_tokens=16).group_fingerprint
FP_B = KVLayoutSpec(engine="test", model="model-b", dtype="bfloat16", chunk_tokens=16).group_fingerprint
NBYTES = 4096
PER = 6
"""Groups stored per (tenant, fingerprint); each group has two members."""


def _items(tenant: str, fp: str) -> list[PutItem]:
    out = []
    for i in range(PER):
        for member in ("kv", "draft"):
            data = payload(i, NBYTES)
            h = header(tenant, chunk_id(i), member, payload_len=NBYTES)
            out.append(PutItem(StoreKey(tenant, fp, chunk_id(i), member), h, memoryview(data)))
    return out


def _fill(tier: Tier) -> dict[tuple[str, str], list[PutItem]]:
    owners = {(t, fp): _items(t, fp) for t in ("acme", "globex") for fp in (FP_A, FP_B)}
    for items in owners.values():
        assert tier.put_from(items) == [TierStatus.OK] * len(items)
    return owners


def _get(tier: Tier, items: list[PutItem]) -> list[TierStatus]:
    dsts = [np.zeros(NBYTES, np.uint8) for _ in items]
    exp = [Expectation(MEMBER_FP, it.key.tenant, it.key.chunk, it.key.member, TOKENS, NBYTES) for it in items]
    return [r.status for r in tier.get_into([it.key for it in items], [memoryview(d) for d in dsts], exp, True)]


@pytest.fixture(params=["memory", "host", "disk"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    t: Tier
    if request.param == "memory":
        t = MemoryTier(64 << 20, make_policy(KVPackConfig().eviction.policy))
    elif request.param == "host":
        name = f"test-clear-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        t = HostTier(name, 64 << 20)
    else:
        t = DiskTier(tmp_path / "store", 64 << 20)
    yield t
    t.close()
    if request.param == "host":
        shutil.rmtree(host_root(name), ignore_errors=True)


def test_clear_removes_exactly_its_scope(tier: Tier) -> None:
    owners = _fill(tier)
    scope = ClearScope(tenants={"acme"}, fingerprints={FP_A})
    used = tier.usage().used_bytes
    counted = tier.clear(scope, dry_run=True)
    assert _get(tier, owners[("acme", FP_A)]) == [TierStatus.OK] * 2 * PER, "a dry run removed something"
    cleared = tier.clear(scope)
    # bytes as the tier charges them (the host store: whole pages, header included)
    assert (cleared.objects, cleared.nbytes) == (2 * PER, used - tier.usage().used_bytes)
    assert (counted.objects, counted.nbytes) == (cleared.objects, cleared.nbytes)
    assert cleared.nbytes is not None and cleared.nbytes >= 2 * PER * NBYTES
    assert _get(tier, owners[("acme", FP_A)]) == [TierStatus.MISS] * 2 * PER
    for owner in (("acme", FP_B), ("globex", FP_A), ("globex", FP_B)):
        assert _get(tier, owners[owner]) == [TierStatus.OK] * 2 * PER, f"{owner} was touched"
    assert tier.clear(scope).objects == 0
    # every fingerprint of one tenant, then every tenant of one fingerprint
    assert tier.clear(ClearScope(tenants={"globex"})).objects == 4 * PER
    assert tier.clear(ClearScope(fingerprints={FP_B})).objects == 2 * PER
    assert tier.usage().objects == 0


def test_disk_clear_unlinks_the_files_and_keeps_other_models(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "store", 64 << 20)
    try:
        _fill(disk)
        disk.clear(ClearScope(fingerprints={FP_A}))
        names = {p.parent.parent.name for p in (tmp_path / "store").rglob("*.kvp")}
        assert names == {FP_B}, names
        assert len(list((tmp_path / "store").rglob("*.kvp"))) == 2 * 2 * PER
    finally:
        disk.close()


def test_engine_scope_follows_the_config_and_the_current_fingerprint() -> None:
    assert engine_scope(ResetConfig(), [FP_A]) == ClearScope(None, {FP_A}, None)
    assert engine_scope(ResetConfig(scope=ResetScope.ALL), [FP_A]) == ClearScope(None, None, None)
    assert engine_scope(ResetConfig(scope=ResetScope.OFF), [FP_A]) is None
    cfg = KVPackConfig.from_dict({"reset": {"scope": "model", "tiers": ["disk", "host"]}})
    assert engine_scope(cfg.reset, [FP_A]) == ClearScope(None, {FP_A}, {"disk", "host"})


@pytest.mark.parametrize(
    ("reset", "field"),
    [
        ({"scope": "everything"}, "reset.scope"),
        ({"tiers": ["disk", "disk"]}, "reset.tiers[1]"),
        ({"tiers": ["ssd"]}, "reset.tiers[0]"),
        ({"tier": ["disk"]}, "reset.tier"),
    ],
)
def test_reset_config_errors_name_the_field(reset: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        KVPackConfig.from_dict({"reset": reset})
    assert str(err.value).startswith(f"kvpack config: {field}:"), str(err.value)
    assert "\n" not in str(err.value)


def _session(tmp_path: Path, **extra: object) -> Session:
    cfg = KVPackConfig.from_dict(
        {"memory": {"mode": "process", "capacity": "64MiB"}, "disk": {"path": str(tmp_path / "store")}, **extra}
    )
    return Session(KVStore.from_config(cfg), FP_A)


def test_session_reset_takes_the_fingerprint_bound_now(tmp_path: Path) -> None:
    session = _session(tmp_path)
    try:
        for fp in (FP_A, FP_B):
            assert all(s is TierStatus.OK for s in session.store.complete_store(_items("acme", fp)))
        assert session.store.flush(10)
        session.bind_group(FP_B, "model-b (test)")  # the weights changed in place: a new fingerprint
        report = session.reset("test")
        assert report is not None and report.ok
        assert report.scope.fingerprints == {FP_B}
        assert report.removed["memory"].objects == 2 * PER
        assert report.removed["disk"].objects == 2 * PER
        left = session.store.contains([it.key for it in _items("acme", FP_A)])
        assert all(left), "another fingerprint's objects were removed"
        snap = session.metrics_snapshot()
        assert snap["cleared_objects"]["tier=disk"] == 2 * PER
        assert snap["cleared_bytes"]["tier=memory"] == 2 * PER * NBYTES
    finally:
        session.close()


def test_reset_off_removes_nothing(tmp_path: Path) -> None:
    session = _session(tmp_path, reset={"scope": "off"})
    try:
        session.store.complete_store(_items("acme", FP_A))
        assert session.reset("test") is None
        assert all(session.store.contains([it.key for it in _items("acme", FP_A)]))
    finally:
        session.close()


def test_reset_narrowed_to_a_tier(tmp_path: Path) -> None:
    session = _session(tmp_path, reset={"tiers": ["disk"]})
    try:
        session.store.complete_store(_items("acme", FP_A))
        assert session.store.flush(10)
        report = session.reset("test")
        assert report is not None and set(report.removed) == {"disk"}
        assert session.store.in_memory([it.key for it in _items("acme", FP_A)]) == [True] * 2 * PER
    finally:
        session.close()


def test_a_reset_tells_routers_of_the_memory_groups_gone(tmp_path: Path) -> None:
    session = _session(tmp_path, disk={"enabled": False})
    try:
        feed = session.store.tier_events()
        session.store.complete_store(_items("acme", FP_A))
        feed.take()
        assert session.reset("test") is not None
        removed = {e.group for e in feed.take() if e.kind is TierEventKind.REMOVED and e.tier == "memory"}
        assert removed == {StoreKey("acme", FP_A, chunk_id(i), "kv").group.as_str() for i in range(PER)}
    finally:
        session.close()
