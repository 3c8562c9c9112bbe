"""The kvpack command: inspect is read-only and truthful; errors are clear."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.builders import chunk_id, make_item
from kvpack.cli import main, tool_commands
from kvpack.policy.tails import tail_chunk
from kvpack.tiers.disk import DiskTier
from kvpack.tools.commands import BENCHES, RUNNERS


def test_inspect_reports_per_tenant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier = DiskTier(tmp_path, 1 << 30)
    tier.put_from([make_item("acme", chunk_id(i), m)[0] for i in range(3) for m in ("kv", "draft")])
    tier.put_from([make_item("beta", chunk_id(9))[0]])
    tier.put_from([make_item("beta", tail_chunk(chunk_id(9)), token_ids=(1, 2), token_count=2)[0]])
    bad = tier.path_of(make_item("beta", chunk_id(9))[0].key)
    bad.write_bytes(b"garbage")
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tenants"]["acme"] == {
        "layouts": 1,
        "groups": 3,
        "objects": 6,
        "payload_bytes": 6 * 1024,
        "tails": 0,
        "members": {"draft": 3, "kv": 3},
    }
    assert out["tenants"]["beta"]["tails"] == 1
    assert out["unreadable"] == 1
    assert bad.exists()  # inspect never deletes


def test_inspect_neither_hangs_on_a_fifo_nor_follows_a_symlink_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO planted at an object path used to block `kvpack inspect` forever; a tenant
    folder symlinked to another store was summarised as if it were this one's."""
    import os

    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    tier = DiskTier(store, 1 << 30)
    tier.put_from([make_item("acme", chunk_id(1))[0]])
    fifo = tier.path_of(make_item("acme", chunk_id(2))[0].key)
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    other = DiskTier(elsewhere, 1 << 30)
    other.put_from([make_item("bob", chunk_id(3))[0]])
    (store / "mallory").symlink_to(elsewhere / "bob")
    result: list[int] = []
    import threading

    runner = threading.Thread(target=lambda: result.append(main(["inspect", str(store), "--json"])), daemon=True)
    runner.start()
    runner.join(20)
    assert not runner.is_alive(), "kvpack inspect hung on a FIFO"
    out = json.loads(capsys.readouterr().out)
    assert result == [0] and out["tenants"]["acme"]["objects"] == 1
    assert "bob" not in out["tenants"] and "mallory" not in out["tenants"]
    assert out["unreadable"] == 2  # the FIFO and the symlinked-in object


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


def test_bench_serve_table_ratios_and_targets() -> None:
    # the table and target code of `kvpack bench serve`, on made-up rows (no server, no vLLM)
    from kvpack.tools.bench.serve_bench import repeatable_tokens
    from kvpack.tools.bench.serve_report import Row, RowName, report, targets

    assert repeatable_tokens([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 3, 4], [7]]) == 3 + 3 + 0
    rows = [
        Row(RowName.NO_CACHE, 1.0, 1.2, 12, 12, 12288, 0, 0, 4608),
        Row(RowName.VLLM_PC, 0.8, 1.0, 12, 12, 12288, 1536, 0, 4608, ttft_repeats_median_s=0.4),
        Row(RowName.KVPACK, 0.3, 0.5, 12, 12, 12288, 0, 4352, 4608, ttft_repeats_median_s=0.1),
        Row(RowName.KVPACK_PC, 0.5, 0.6, 12, 12, 12288, 1536, 2816, 4608),
        Row(RowName.RESTART, 0.25, 0.3, 12, 12, 12288, 0, 12160, 12276, objects_on_disk=96),
    ]
    met = {t.what: (round(t.measured, 3), t.met) for t in targets(rows)}
    assert met[f"{RowName.KVPACK}: first-lifetime reuse / repeated prefix tokens"] == (0.944, True)
    assert met[f"{RowName.KVPACK}: median TTFT x vLLM prefix caching"] == (0.375, True)
    assert met[f"{RowName.KVPACK_PC}: median TTFT x vLLM prefix caching"] == (0.625, False)
    assert met[f"{RowName.RESTART}: median TTFT x no cache"] == (0.25, True)
    table = report(rows)
    assert (
        "| kvpack | 0.300 | 0.500 | 0.300 | 0.375 | 0.100, 0.250 | 0 | 4352 | 4352 of 4608 (0.94) | 12 of 12 | 0 |"
        in table
    )
    assert "(96 objects on disk)" in table


def test_cpu_sample_counts_the_named_threads_apart_from_the_rest() -> None:
    """`kvpack bench vllm` reports kvpack's own threads' CPU next to the process's: a live
    thread named with the prefix counts in both, one named otherwise in the total only."""
    import threading
    import time

    from kvpack.tools.bench.timing import cpu_sample

    done = threading.Event()

    def burn_then_wait() -> None:
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        done.wait(10)

    threads = [threading.Thread(target=burn_then_wait, name=n) for n in ("kvpacktest-burn", "other-burn")]
    before = cpu_sample("kvpacktest")
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while (cpu_sample("kvpacktest") - before).total_s < 0.6 and time.monotonic() < deadline:
        time.sleep(0.02)
    used = cpu_sample("kvpacktest") - before
    done.set()
    for t in threads:
        t.join(10)
    assert used.total_s >= 0.6
    assert 0.25 <= used.named_s <= 0.45, used  # the named thread's 0.3 s, not the other one's
    assert set(used.named) == {"kvpacktest-burn"}


def test_the_tools_register_their_commands_and_the_core_names_none() -> None:
    # the core's command finds the tools through the kvpack.commands entry points (pyproject.toml)
    assert set(tool_commands()) == {"bench", *RUNNERS}
    core = (Path(__file__).resolve().parents[2] / "common" / "cli.py").read_text()
    assert "kvpack.tools" not in core.replace("`kvpack.tools`", "")
