"""A table of bad configs, each one line naming the problem both ways an operator meets it.

Each row is a config file an operator might write (``CASES``). Through ``kvpack config FILE``
(the installed script, a subprocess): exit status 2, nothing on stdout, one line on stderr
naming the file, the field and the problem, no traceback. Through vLLM's start-up (the
same values as ``kv_connector_extra_config``: `load_config`, then the store the connector
opens, `KVStore.from_config`): one `ConfigError` of one line naming the field and the
problem. A file whose bytes are not even a config (not UTF-8, 100k deep, an integer of
5000 digits) has no start-up twin here: vLLM parses its own ``--kv-transfer-config`` JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm.config import KVTransferConfig, VllmConfig
from vllm.plugins import load_general_plugins
from vllm_helpers import kv_config

from kvpack import ConfigError
from kvpack.store import KVStore
from kvpack.tiers.disk import fs as disk_fs
from kvpack.tiers.disk.catalog import INDEX_NAME
from kvpack.vllm_plugin.settings import load_config

HUGE = "9" * 5000
DEEP = 100_000
Prepare = Callable[[Path], dict[str, str]]
"""Makes what a row's config names under a fresh folder; returns the environment it needs."""


def _nothing(root: Path) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Case:
    """A bad config: its JSON text (``{root}`` stands for the row's folder), what it needs made,
    the words its one line must hold, and its value at start-up (None: no start-up twin)."""

    name: str
    text: str
    words: tuple[str, ...]
    prepare: Prepare = _nothing
    startup: bool = True


def _mooncake_file(root: Path) -> dict[str, str]:
    (root / "mooncake.json").write_bytes(b'{"master_server_address": "\xff"}')
    return {}


def _mooncake_env(root: Path) -> dict[str, str]:
    _mooncake_file(root)
    return {"MOONCAKE_CONFIG_PATH": str(root / "mooncake.json")}


def _photos(root: Path) -> dict[str, str]:
    (root / "store" / "photos").mkdir(parents=True)
    return {}


def _bad_index(root: Path) -> dict[str, str]:
    real, fd = disk_fs.open_store_root(str(root / "store"))
    os.close(fd)
    Path(real, INDEX_NAME).write_bytes(b"not a database" * 64)
    return {}


NO_TIERS = '"memory": {"enabled": false}, "disk": {"enabled": false}'
CASES = [
    Case("not-utf8", '{"tenant": "\udcff"}', ("not UTF-8",), startup=False),
    Case("huge-int-text", '{"io_threads": ' + HUGE + "}", ("more than 4300 digits",), startup=False),
    Case("deep-text", "[" * DEEP + "]" * DEEP, ("nested too deeply",), startup=False),
    Case("unknown-field", '{"memroy": {"capacity": "1GiB"}}', ("memroy", "unknown key")),
    Case("wrong-type", '{"io_threads": "four"}', ("io_threads", "expected an integer")),
    Case("wrong-type-nested", '{"disk": {"fsync": "yes"}}', ("disk.fsync", "expected true or false")),
    Case("negative-capacity", '{"memory": {"capacity": -1}}', ("memory.capacity", ">= 0")),
    Case("negative-quota", '{"eviction": {"tenant_quotas": {"a": -3}}}', ("eviction.tenant_quotas.a", ">= 0")),
    Case("unknown-policy", '{"eviction": {"policy": "fifo"}}', ("eviction.policy", "fifo")),
    Case("port-out-of-range", '{"metrics_port": 70000}', ("metrics_port",)),
    Case("key-not-hex", '{"tenant_signing_key": "zz"}', ("tenant_signing_key", "hex")),
    Case("megabyte-value", json.dumps({"tenant": "t" * (1 << 20)}), ("tenant",)),
    Case("disk-path-root", '{"disk": {"path": "/"}}', ("disk.path", "top-level system folder")),
    Case("disk-path-unmarked", '{"disk": {"path": "{root}/store"}}', ("disk.path", "photos"), _photos),
    Case("disk-index-not-sqlite", '{"disk": {"path": "{root}/store"}}', ("disk.path", "not a database"), _bad_index),
    Case(
        "mooncake-config-file-not-utf8",
        "{" + NO_TIERS + ', "mooncake": {"enabled": true, "config_file": "{root}/mooncake.json"}}',
        ("mooncake.config_file", "not UTF-8"),
        _mooncake_file,
    ),
    Case(
        "mooncake-env-not-utf8",
        "{" + NO_TIERS + ', "mooncake": {"enabled": true}}',
        ("MOONCAKE_CONFIG_PATH", "not UTF-8"),
        _mooncake_env,
    ),
]


def _made(case: Case, root: Path) -> tuple[Path, dict[str, str]]:
    """The row's config file under `root` (and what it names), and its environment."""
    env = case.prepare(root)
    file = root / "c.json"
    file.write_bytes(case.text.replace("{root}", str(root)).encode("utf-8", "surrogateescape"))
    return file, env


def _line(text: str) -> str:
    lines = text.splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text[-2000:]
    assert len(lines[0]) < 1000, lines[0][:300]
    return lines[0]


def test_the_table_has_a_dozen_for_both() -> None:
    assert sum(c.startup for c in CASES) >= 12


@pytest.fixture(scope="module")
def script_answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str, Path]]:
    """Every row through the installed ``kvpack config``, three processes at a time."""
    script = shutil.which("kvpack", path=os.path.dirname(sys.executable))
    command = [script] if script else [sys.executable, "-m", "kvpack.cli"]
    out: dict[str, tuple[int, str, str, Path]] = {}
    todo = list(CASES)
    while todo:
        batch, todo = todo[:3], todo[3:]
        running = []
        for case in batch:
            root = tmp_path_factory.mktemp(case.name)
            file, env = _made(case, root)
            full = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"} | env
            proc = subprocess.Popen(
                [*command, "config", str(file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full
            )
            running.append((case.name, file, proc))
        for name, file, proc in running:
            stdout, stderr = proc.communicate(timeout=300)
            out[name] = (proc.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace"), file)
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kvpack_config_answers_one_line(case: Case, script_answers: dict[str, tuple[int, str, str, Path]]) -> None:
    code, stdout, stderr, file = script_answers[case.name]
    line = _line(stderr)
    assert code == 2 and stdout == "", (code, stdout[:300])
    assert line.startswith("kvpack config: ") and str(file) in line, line
    for word in case.words:
        assert word in line, (word, line)


def _start_up(extra: dict[str, Any]) -> None:
    """What vLLM's start-up runs on `extra`: the connector's `load_config`, then its store."""
    load_general_plugins()
    config = load_config(VllmConfig(kv_transfer_config=KVTransferConfig(**kv_config(extra))))
    KVStore.from_config(config, write_back=False).close()


@pytest.mark.parametrize("case", [c for c in CASES if c.startup], ids=lambda c: c.name)
def test_start_up_answers_one_line(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file, env = _made(case, tmp_path)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:
        _start_up(json.loads(file.read_text()))
    line = _line(str(err.value))
    for word in case.words:
        assert word in line, (word, line)
