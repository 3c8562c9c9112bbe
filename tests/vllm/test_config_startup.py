"""vLLM start-up reads kvpack's config from ``kv_connector_extra_config``: bad input there,
or in the Mooncake file it names (``mooncake.config_file``, ``MOONCAKE_CONFIG_PATH``), is one
`ConfigError` of one line naming the field, never a UnicodeDecodeError, a RecursionError or
Python's int-string ValueError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.config import KVTransferConfig, VllmConfig
from vllm.plugins import load_general_plugins
from vllm_helpers import kv_config

from kvpack import ConfigError
from kvpack.vllm_plugin.scopes import load_config


def _deep(depth: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(depth):
        out = [out]
    return out


def _start_up_config(extra: dict[str, Any]) -> None:
    load_general_plugins()  # registers KVPackConnector, as the engine does
    load_config(VllmConfig(kv_transfer_config=KVTransferConfig(**kv_config(extra))))


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"io_threads": 10**5000}, ("io_threads",)),
        ({"tenant": 10**5000}, ("tenant", "expected a string")),
        ({"tenant": _deep(100_000)}, ("tenant", "expected a string")),
        ({"tenant": "a\n" * 500_000}, ("tenant", "invalid tenant name")),
        ({"eviction": {"tenant_quotas": {"a": 10**5000}}}, ("eviction.tenant_quotas.a",)),
    ],
    ids=["huge-int", "huge-int-for-a-string", "deep", "megabyte-lines", "huge-quota"],
)
def test_bad_extra_config_is_one_config_error(extra: dict[str, Any], words: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as err:
        _start_up_config(extra)
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
        _start_up_config({"mooncake": mooncake})
    field = "MOONCAKE_CONFIG_PATH" if via_env else "mooncake.config_file"
    assert err.value.field == field
    assert "mooncake.json is not UTF-8" in str(err.value) and "\n" not in str(err.value)
