"""A table of bad configs, each one line naming the problem both ways an operator meets it.

Each row is a config file an operator might write (``fixtures.bad_configs.CASES``). Through ``kvpack config FILE``
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
from pathlib import Path
from typing import Any

import pytest
from vllm.config import KVTransferConfig, VllmConfig
from vllm.plugins import load_general_plugins
from vllm_helpers import kv_config

from fixtures.bad_configs import CASES, Case, made, one_line
from kvpack import ConfigError
from kvpack.store import KVStore
from kvpack.vllm_plugin.scopes import load_config


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
            file, env = made(case, root)
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
def test_kvpack_config_answers_oneone_line(case: Case, script_answers: dict[str, tuple[int, str, str, Path]]) -> None:
    code, stdout, stderr, file = script_answers[case.name]
    line = one_line(stderr)
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
def test_start_up_answers_oneone_line(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file, env = made(case, tmp_path)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:
        _start_up(json.loads(file.read_text()))
    line = one_line(str(err.value))
    for word in case.words:
        assert word in line, (word, line)
