"""SGLang start-up reads kvpack's config from ``--hicache-storage-backend-extra-config``
(`split_extra_config`, called when SGLang builds the backend): bad input there, or in the
Mooncake file it names (``mooncake.config_file``, ``MOONCAKE_CONFIG_PATH``), is one
`ConfigError` of one line naming the field, never a UnicodeDecodeError, a RecursionError or
Python's int-string ValueError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpack import ConfigError
from kvpack.sglang_plugin import split_extra_config

pytestmark = pytest.mark.sglang

BACKEND = {"backend_name": "kvpack", "module_path": "kvpack.sglang_plugin", "class_name": "KVPackStorage"}


def _deep(depth: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(depth):
        out = [out]
    return out


@pytest.mark.parametrize(
    ("ours", "words"),
    [
        ({"tenant": 10**5000}, ("tenant", "expected a string")),
        ({"tenant": _deep(100_000)}, ("tenant", "expected a string")),
        ({"tenant": "a\n" * 500_000}, ("tenant", "invalid tenant name")),
        ({"disk": {"path": "x" * 100_000}}, ("disk.path",)),
    ],
    ids=["huge-int-for-a-string", "deep", "megabyte-lines", "long-path"],
)
def test_bad_extra_config_is_one_config_error(ours: dict[str, Any], words: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as err:
        split_extra_config({**BACKEND, **ours})
    text = str(err.value)
    assert "\n" not in text and len(text) < 1000, text[:300]
    for word in words:
        assert word in text, text


@pytest.mark.parametrize("via_env", [False, True], ids=["config_file", "MOONCAKE_CONFIG_PATH"])
def test_a_mooncake_file_that_is_not_utf8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via_env: bool) -> None:
    file = tmp_path / "mooncake.json"
    file.write_bytes(b'{"master_server_address": "\xff"}')
    mooncake: dict[str, Any] = {"enabled": True}
    if via_env:
        monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(file))
    else:
        monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
        mooncake["config_file"] = str(file)
    with pytest.raises(ConfigError) as err:
        split_extra_config({**BACKEND, "mooncake": mooncake})
    assert err.value.field == ("MOONCAKE_CONFIG_PATH" if via_env else "mooncake.config_file")
    assert "mooncake.json is not UTF-8" in str(err.value) and "\n" not in str(err.value)
