"""SGLang's start-up answers the bad-config table (`fixtures.bad_configs`) with one line each.

What SGLang's start-up runs when it builds the backend from
``--hicache-storage-backend-extra-config``: `split_extra_config`, then the session the backend
starts (`Session.start`: the store and its tiers). Each row that is a value (not a file's bytes)
is one `ConfigError` of one line naming the field and the problem; the tests/vllm twin runs the
same rows through vLLM's start-up and ``kvpack config``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.bad_configs import CASES, Case, made, one_line
from kvpack import ConfigError, Session
from kvpack.sglang_plugin import split_extra_config

pytestmark = pytest.mark.sglang

BACKEND = {"backend_name": "kvpack", "module_path": "kvpack.sglang_plugin", "class_name": "KVPackStorage"}


@pytest.mark.parametrize("case", [c for c in CASES if c.startup], ids=lambda c: c.name)
def test_sglang_start_up_answers_one_line(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file, env = made(case, tmp_path)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as err:
        config, _ = split_extra_config({**BACKEND, **json.loads(file.read_text())})
        Session.start(config, write_back=False).close()
    line = one_line(str(err.value))
    for word in case.words:
        assert word in line, (word, line)
