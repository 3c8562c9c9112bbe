"""A clear on the real Mooncake tier (`MooncakeTier.clear`): one ``remove_by_regex`` over the key
prefix of a scope removes exactly its objects; a dry run is reported as not countable."""

from __future__ import annotations

import numpy as np
import pytest

from fixtures.builders import item, payload
from kvpack import ClearScope, StoreKey, TierStatus
from kvpack.policy.clearing import ClearUnsupported, clear_tiers
from kvpack.tiers.mooncake import MooncakeTier

FP_A, FP_B = "a" * 32, "b" * 32


@pytest.fixture(scope="module")
def tier(mooncake_cluster):  # type: ignore[no-untyped-def]
    t = MooncakeTier(mooncake_cluster.tier_config())
    assert t.wait_ready(15), f"tier never connected: {t.state}"
    yield t
    t.close()


def test_clear_by_tenant_and_fingerprint(tier: MooncakeTier) -> None:
    keys = {
        (t, fp): [StoreKey(t, fp, f"{i:064x}", m) for i in range(5) for m in ("kv", "draft")]
        for t in ("acme", "acme.2", "globex")
        for fp in (FP_A, FP_B)
    }
    data: list[np.ndarray] = []
    for ks in keys.values():
        data += [payload(i, 4096) for i in range(len(ks))]
        assert tier.put_from([item(k, d) for k, d in zip(ks, data[-len(ks) :])]) == [TierStatus.OK] * len(ks)
    with pytest.raises(ClearUnsupported):
        tier.clear(ClearScope(tenants={"acme"}), dry_run=True)
    cleared = tier.clear(ClearScope(tenants={"acme"}, fingerprints={FP_A}))
    assert (cleared.objects, cleared.nbytes) == (10, None)
    assert tier.contains(keys[("acme", FP_A)]) == [False] * 10
    for owner in (("acme", FP_B), ("acme.2", FP_A), ("globex", FP_A)):  # "acme." is no prefix of "acme/"
        assert all(tier.contains(keys[owner])), owner
    report = clear_tiers([tier], ClearScope(fingerprints={FP_B}))
    assert report.ok and report.removed["mooncake"].objects == 30
    assert tier.clear(ClearScope()).objects == 20
