"""Config: strict parsing, field names in every error, sizes, files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpack import ConfigError, DraftPolicy, KVPackConfig
from kvpack.config.schema import ChecksumPolicy, EvictionPolicyName
from kvpack.config.sizes import parse_size


def test_defaults_are_memory_plus_disk() -> None:
    cfg = KVPackConfig.from_dict({})
    assert cfg.memory.enabled and cfg.disk.enabled and not cfg.mooncake.enabled
    assert cfg.draft_policy is DraftPolicy.RECOMPUTE
    assert cfg.checksum is ChecksumPolicy.BOUNDARY


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"tenat": "a"}, "tenat"),
        ({"disk": {"capcity": "1GiB"}}, "disk.capcity"),
        ({"disk": {"capacity": "-1GiB"}}, "disk.capacity"),
        ({"disk": {"capacity": -5}}, "disk.capacity"),
        ({"memory": {"capacity": "12 parsecs"}}, "memory.capacity"),
        ({"memory": {"enabled": "yes"}}, "memory.enabled"),
        ({"draft_policy": "sometimes"}, "draft_policy"),
        ({"eviction": {"policy": "fifo"}}, "eviction.policy"),
        ({"io_timeout_ms": 0}, "io_timeout_ms"),
        ({"io_timeout_ms": True}, "io_timeout_ms"),
        ({"prefix_match_unit": -1}, "prefix_match_unit"),
        ({"tenant": "../etc"}, "tenant"),
        ({"eviction": {"tenant_quotas": {"a/b": "1GiB"}}}, "eviction.tenant_quotas.a/b"),
        ({"eviction": {"tenant_quotas": {"a": "lots"}}}, "eviction.tenant_quotas.a"),
        ({"mooncake": {"enabled": True}}, "mooncake.master_server_address"),
        ({"memory": {"enabled": False}, "disk": {"enabled": False}}, "memory.enabled"),
        ({"disk": []}, "disk"),
    ],
)
def test_bad_config_names_the_field(data: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVPackConfig.from_dict(data)
    assert info.value.field == field
    assert field in str(info.value)


def test_unknown_key_lists_allowed_keys() -> None:
    with pytest.raises(ConfigError, match="allowed keys: .*capacity"):
        KVPackConfig.from_dict({"disk": {"size": 1}})


def test_enum_error_lists_allowed_values() -> None:
    with pytest.raises(ConfigError, match="recompute.*target_only"):
        KVPackConfig.from_dict({"draft_policy": "x"})


def test_sizes_and_nested_values_parse() -> None:
    cfg = KVPackConfig.from_dict(
        {
            "memory": {"capacity": "1.5GiB"},
            "disk": {"capacity": "10GB", "path": "/tmp/x"},
            "eviction": {"policy": "arc", "tenant_quotas": {"acme": "256MiB", "beta": 1024}},
            "draft_policy": "target_only",
        }
    )
    assert cfg.memory.capacity == int(1.5 * 1024**3)
    assert cfg.disk.capacity == 10 * 1000**3
    assert cfg.eviction.policy is EvictionPolicyName.ARC
    assert cfg.eviction.tenant_quotas == {"acme": 256 * 1024**2, "beta": 1024}
    assert cfg.draft_policy is DraftPolicy.TARGET_ONLY


def test_round_trip_through_dict_and_files(tmp_path: Path) -> None:
    cfg = KVPackConfig.from_dict({"tenant": "acme", "disk": {"path": str(tmp_path)}, "eviction": {"policy": "arc"}})
    assert KVPackConfig.from_dict(cfg.to_dict()) == cfg
    json_file = tmp_path / "kvpack.json"
    json_file.write_text(json.dumps(cfg.to_dict()))
    assert KVPackConfig.from_file(json_file) == cfg
    toml_file = tmp_path / "kvpack.toml"
    toml_file.write_text(f'tenant = "acme"\n[disk]\npath = "{tmp_path}"\n[eviction]\npolicy = "arc"\n')
    assert KVPackConfig.from_file(toml_file) == cfg


def test_bad_json_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not valid JSON"):
        KVPackConfig.from_json("{nope")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("8GiB", 8 * 1024**3), ("512MB", 512 * 10**6), ("1 KiB", 1024), (7, 7), ("0", 0)],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["-1", "1XB", "", "GiB", True, None, [1]])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)  # type: ignore[arg-type]


def test_a_renamed_key_is_read_with_a_warning_and_not_beside_its_new_name(caplog: pytest.LogCaptureFixture) -> None:
    # pd_wait_ms became handoff_wait_ms (one name per idea: the metrics are kvpack_handoff_*)
    with caplog.at_level("WARNING", logger="kvpack.config.schema"):
        cfg = KVPackConfig.from_json(json.dumps({"pd_wait_ms": 750}))
    assert cfg.handoff_wait_ms == 750
    assert "'pd_wait_ms' is now called 'handoff_wait_ms'" in caplog.text
    assert "pd_wait_ms" not in cfg.to_dict()
    with pytest.raises(ConfigError) as err:
        KVPackConfig.from_dict({"pd_wait_ms": 750, "handoff_wait_ms": 500})
    assert err.value.field == "pd_wait_ms"
    with pytest.raises(ConfigError) as err:
        KVPackConfig.from_dict({"pd_wait_ms": -1})
    assert err.value.field == "handoff_wait_ms"
