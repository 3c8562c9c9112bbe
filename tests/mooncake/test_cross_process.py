"""Process 1 stores through KVStore (Mooncake tier only) and exits; process 2 loads bit-exact."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from fixtures.mooncake import client_env
from fixtures.warm_start import KVPACK_MODULES, warm_starts

pytestmark = pytest.mark.mooncake

TESTS = Path(__file__).parent.parent

SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    from kvpack.config.schema import KVPackConfig
    from kvpack.store import KVStore, LoadItem
    from kvpack.tiers.base import TierStatus
    from fixtures.builders import expect_key, item, key, payload

    cfg = KVPackConfig.from_dict(json.loads(sys.argv[2]))
    store = KVStore.from_config(cfg)
    tier = store.tiers[0]
    assert tier.name == "mooncake" and len(store.tiers) == 1, store.tiers
    assert tier.wait_ready(20), tier.state
    sizes = [64 << 10, 1 << 20, 3 << 20 | 17]
    keys = [key(f"xp-{{i}}", m) for i in range(len(sizes)) for m in ("kv", "draft")]
    datas = [payload(1000 + j, sizes[j // 2]) for j in range(len(keys))]
    if sys.argv[1] == "store":
        st = store.store([item(k, d) for k, d in zip(keys, datas)])
        assert st == [TierStatus.OK] * len(keys), st
        assert store.flush(30)
        assert store.metrics.value("stored_objects", tier="mooncake") == len(keys), store.metrics.snapshot()
    else:
        dsts = [np.zeros_like(d) for d in datas]
        res = store.load([LoadItem(k, memoryview(x), expect_key(k)) for k, x in zip(keys, dsts)])
        assert all(r.ok for r in res), [(r.status, r.reason, r.detail) for r in res]
        assert all(np.array_equal(a, b) for a, b in zip(dsts, datas)), "payload differs"
        assert store.metrics.value("loaded_bytes", tier="mooncake") == sum(d.nbytes for d in datas)
    store.close()
    print("DONE", sys.argv[1])
    """
)


def _run(phase: str, cfg: dict, tmp_path: Path) -> str:  # type: ignore[type-arg]
    script = tmp_path / "xp.py"
    script.write_text(SCRIPT.format(tests=str(TESTS)))
    argv = [str(script), phase, json.dumps(cfg)]  # forked from a process that imported torch
    log = tmp_path / f"{phase}.log"
    proc = warm_starts().run_script(sys.executable, argv, client_env(), log, 120, modules=KVPACK_MODULES)
    assert proc.returncode == 0, f"{phase} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_store_in_one_process_load_in_another(mooncake_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = mooncake_cluster.kvpack_config().to_dict()
    assert "DONE store" in _run("store", cfg, tmp_path)
    assert "DONE load" in _run("load", cfg, tmp_path)


def test_second_process_sees_nothing_after_removal(mooncake_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The load phase really reads the cluster: with the objects gone it fails."""
    from fixtures.builders import key
    from kvpack.tiers.mooncake import MooncakeTier

    cfg = mooncake_cluster.kvpack_config().to_dict()
    _run("store", cfg, tmp_path)
    tier = MooncakeTier(mooncake_cluster.tier_config())
    assert tier.wait_ready(15)
    try:
        assert tier.remove_groups([key(f"xp-{i}").group for i in range(3)]) == 6
    finally:
        tier.close()
    with pytest.raises(AssertionError, match="load failed"):
        _run("load", cfg, tmp_path)
