"""examples/sglang: the server command on each script's first line carries a kvpack config that parses."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from kvpack.sglang_plugin import split_extra_config

pytestmark = pytest.mark.sglang

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "sglang").glob("*.sh"))


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"launch_default.sh", "launch_disk.sh", "launch_mooncake.sh"}


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_first_line_is_a_valid_dynamic_backend_command(script):
    argv = shlex.split(script.read_text().splitlines()[0])
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert argv[argv.index("--hicache-storage-backend") + 1] == "dynamic"
    assert "--enable-hierarchical-cache" in argv
    extra = json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])
    config, engine = split_extra_config(extra)
    assert engine["module_path"] == "kvpack.sglang_plugin" and engine["class_name"] == "KVPackStorage"
    assert engine["interface_v1"] == 1
    assert config.mooncake.enabled == ("mooncake" in script.name)
    assert not re.search(r"\bTODO\b", script.read_text())
