"""``kvpack usage`` and ``kvpack clear`` (`kvpack.operate.operating`) on real stores.

- usage of a disk store of 100,000 objects (its real index, built by the disk tier's own
  `Catalog`): objects and bytes per tenant and model, named by the label an engine recorded,
  read from the index only (the folder holds no object file: none is needed);
- clear of one tenant and one model from a disk folder and a host store, a dry run first;
  another tenant's and another model's objects stay; bad input is one line, exit 2;
- clear through the real Mooncake master (``--tier mooncake``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fixtures.builders import header, payload
from kvpack import KVLayoutSpec, PutItem, StoreKey, TierStatus
from kvpack.cli import main
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.disk.catalog import INDEX_NAME, Catalog
from kvpack.tiers.host import HostTier, host_root

SPECS = [KVLayoutSpec(engine="vllm:cpu", model=m, dtype="bfloat16", chunk_tokens=16) for m in ("llama-x", "qwen-y")]
FPS = [s.group_fingerprint for s in SPECS]


def _items(tenant: str, fp: str, n: int = 5, nbytes: int = 4096) -> list[PutItem]:
    return [
        PutItem(
            StoreKey(tenant, fp, f"{i:064x}", "kv"),
            header(tenant, f"{i:064x}", payload_len=nbytes),
            memoryview(payload(i, nbytes)),
        )
        for i in range(n)
    ]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_usage_of_100k_objects_reads_the_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "store"
    root.mkdir()
    catalog = Catalog(str(root / INDEX_NAME))
    per = 12_500  # 4 tenants x 2 models x 12,500 = 100,000 objects
    for spec, fp in zip(SPECS, FPS):
        catalog.name_fingerprint(fp, spec.describe(f"/models/{spec.model}"))
        for t in ("t0", "t1", "t2", "t3"):
            keys = [StoreKey(t, fp, f"{i:064x}", "kv") for i in range(per)]
            admitted, _ = catalog.admit(t, [(k, 1000, None) for k in keys], 1 << 50, {})
            assert all(admitted)
            assert all(catalog.mark_ready(keys))
    catalog.close()
    started = time.perf_counter()
    rc, out, _ = _cli(capsys, "usage", "--disk", str(root), "--json")
    print(f"kvpack usage over 100,000 objects: {time.perf_counter() - started:.3f} s")
    assert rc == 0
    disk = next(s for s in json.loads(out)["stores"] if s["tier"] == "disk")
    assert len(disk["rows"]) == 8
    assert sum(r["objects"] for r in disk["rows"]) == 100_000
    assert {r["bytes"] for r in disk["rows"]} == {per * 1000}
    assert {r["model"] for r in disk["rows"]} == {s.describe(f"/models/{s.model}") for s in SPECS}
    rc, out, _ = _cli(capsys, "usage", "--disk", str(root))
    assert "/models/qwen-y [qwen-y]" in out and "12500" in out
    assert not list(root.rglob("*.kvp")), "usage wrote something"


def test_clear_one_tenant_and_model_from_disk_and_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tenant = f"leaver-{uuid.uuid4().hex[:8]}"  # this user's other host stores are reached too: a name of our own
    disk = DiskTier(tmp_path / "store", 1 << 30)
    host_name = f"test-opclear-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    host = HostTier(host_name, 16 << 20)
    try:
        for tier in (disk, host):
            tier.name_group(FPS[0], SPECS[0].describe("/models/llama-x"))
            for t in (tenant, "stays"):
                for fp in FPS:
                    assert tier.put_from(_items(t, fp)) == [TierStatus.OK] * 5
        # only this test's host store: other runs' stores of this user (an engine test in the other
        # lane, a store another run left) are not this test's to clear or to fail on
        mine = ("--host", host_name, "--disk", str(tmp_path / "store"))
        rc, out, _ = _cli(capsys, "clear", "--tenant", tenant, "--model", "llama-x", *mine, "--dry-run")
        assert rc == 0
        assert f"disk     {tmp_path / 'store'}: would remove 5 objects" in out, out
        assert f"host     {host_name}: would remove 5 objects" in out, out
        assert all(disk.contains([it.key for it in _items(tenant, FPS[0])]))
        rc, out, _ = _cli(capsys, "clear", "--tenant", tenant, "--model", "llama-x", *mine)
        assert rc == 0 and "removed 5 objects" in out, out
        for tier in (disk, host):
            assert tier.contains([it.key for it in _items(tenant, FPS[0])]) == [False] * 5
            for t, fp in ((tenant, FPS[1]), ("stays", FPS[0]), ("stays", FPS[1])):
                assert all(tier.contains([it.key for it in _items(t, fp)])), (tier.name, t, fp)
        rc, out, _ = _cli(capsys, "clear", "--tenant", tenant, *mine, "--tier", "disk")
        assert rc == 0 and "removed 5 objects" in out and "host" not in out, out
    finally:
        host.close()
        disk.close()
        shutil.rmtree(host_root(host_name), ignore_errors=True)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["clear", "--tenant", "../etc"], "kvpack clear: invalid tenant name"),
        (["clear", "--tenant", "a", "--model", "no-such-model"], "kvpack clear: no model named 'no-such-model'"),
    ],
)
def test_clear_bad_input_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    rc, out, err = _cli(capsys, *argv, "--disk", str(tmp_path / "none"))
    assert rc == 2 and err.startswith(says) and err.count("\n") == 1, err


def test_clear_reaches_mooncake(mooncake_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from kvpack.tiers.mooncake import MooncakeTier

    tier = MooncakeTier(mooncake_cluster.tier_config())
    assert tier.wait_ready(15)
    try:
        gone, stays = _items("leaver", FPS[0]), _items("stays", FPS[0])
        for items in (gone, stays):
            assert tier.put_from(items) == [TierStatus.OK] * 5
        cfg = tmp_path / "kvpack.json"
        mc = {"enabled": True, "master_server_address": mooncake_cluster.master_address, "local_hostname": "127.0.0.1"}
        cfg.write_text(json.dumps({"disk": {"enabled": False}, "mooncake": mc}))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvpack.cli",
                "clear",
                "--tenant",
                "leaver",
                "--tier",
                "mooncake",
                "--config",
                str(cfg),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "mooncake" in proc.stdout and "removed 5 objects" in proc.stdout, proc.stdout
        assert tier.contains([it.key for it in gone]) == [False] * 5
        assert all(tier.contains([it.key for it in stays]))
    finally:
        tier.close()


def test_usage_lists_mooncake_through_the_masters_http(mooncake_cluster, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from kvpack.tiers.mooncake import MooncakeTier

    tier = MooncakeTier(mooncake_cluster.tier_config())
    assert tier.wait_ready(15)
    try:
        for t, n in (("mc-a", 3), ("mc-b", 2)):
            assert tier.put_from(_items(t, FPS[1], n=n)) == [TierStatus.OK] * n
        http = f"127.0.0.1:{mooncake_cluster.metrics_port}"
        rc, out, _ = _cli(capsys, "usage", "--disk", "/nonexistent-kvpack-usage", "--mooncake-http", http, "--json")
        assert rc == 0
        rows = next(s for s in json.loads(out)["stores"] if s["tier"] == "mooncake")["rows"]
        mine = {r["tenant"]: (r["fingerprint"], r["objects"]) for r in rows if r["tenant"] in ("mc-a", "mc-b")}
        assert mine == {"mc-a": (FPS[1], 3), "mc-b": (FPS[1], 2)}, rows
        sized = [r["bytes"] for r in rows if r["tenant"] in ("mc-a", "mc-b")]
        assert all(b is not None and b >= 4096 * 2 for b in sized), sized  # payload + header per object
    finally:
        tier.close()
