"""The kvpack command: inspect is read-only and truthful; errors are clear."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.builders import chunk_id, make_item

from kvpack.cli import BENCHES, RUNNERS, main
from kvpack.config import EvictionPolicyName
from kvpack.eviction import make_policy
from kvpack.store import tail_chunk
from kvpack.tiers.disk import DiskTier


def test_inspect_reports_per_tenant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier = DiskTier(tmp_path, 1 << 30, make_policy(EvictionPolicyName.LRU))
    tier.put_from([make_item("acme", chunk_id(i), m)[0] for i in range(3) for m in ("kv", "draft")])
    tier.put_from([make_item("beta", chunk_id(9))[0]])
    tier.put_from([make_item("beta", tail_chunk(chunk_id(9)), token_ids=(1, 2), token_count=2)[0]])
    bad = tier.path_of(make_item("beta", chunk_id(9))[0].key)
    bad.write_bytes(b"garbage")
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tenants"]["acme"] == {
        "layouts": 1, "groups": 3, "objects": 6, "payload_bytes": 6 * 1024, "tails": 0, "members": {"draft": 3, "kv": 3},
    }
    assert out["tenants"]["beta"]["tails"] == 1
    assert out["unreadable"] == 1
    assert bad.exists()  # inspect never deletes


def test_inspect_missing_dir(tmp_path: Path) -> None:
    assert main(["inspect", str(tmp_path / "nope")]) == 2


def test_console_script_config_error_names_field(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.json"
    cfg.write_text('{"disk": {"capacity": "-3GiB"}}')
    proc = subprocess.run([sys.executable, "-m", "kvpack.cli", "config", str(cfg)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "disk.capacity" in proc.stderr


def test_bench_tiers_runs_and_prints_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tiers", "--total", "2MiB", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "x memcpy" in out and "| 1MiB |" in out


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's --help and usage errors
        return int(exc.code or 0)


HELP_ARGVS = [[], ["inspect"], ["config"], ["bench"]]
HELP_ARGVS += [[name] for name in RUNNERS] + [["bench", name] for name in BENCHES]


@pytest.mark.parametrize("argv", HELP_ARGVS, ids=lambda argv: " ".join(["kvpack", *argv]))
def test_every_help_prints_usage_and_exits_0(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # regression: `kvpack bench --help` exited 2 ("the following arguments are required: name")
    assert _exit_code([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {' '.join(['kvpack', *argv])}"), out[:200]


def test_bench_without_a_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["bench"]) == 2
    assert "NAME" in capsys.readouterr().err
