"""Issue 15, config: every bad number, size and name is a ConfigError naming its
field (never a bare OverflowError, never silently truncated or accepted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpack import ConfigError, KVPackConfig
from kvpack.config.sizes import parse_size
from kvpack.identity.keys import StoreKey, validate_chunk_hash, validate_member, validate_tenant

HUGE = "1" + "0" * 400


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"memory": {"capacity": HUGE + "B"}}, "memory.capacity"),
        ({"disk": {"capacity": HUGE}}, "disk.capacity"),
        ({"eviction": {"tenant_quotas": {"a": HUGE}}}, "eviction.tenant_quotas.a"),
        ({"eviction": {"tenant_quotas": {"a": float("inf")}}}, "eviction.tenant_quotas.a"),
        ({"memory": {"capacity": float("inf")}}, "memory.capacity"),
        ({"memory": {"capacity": float("nan")}}, "memory.capacity"),
        ({"memory": {"capacity": 1.9}}, "memory.capacity"),
        ({"memory": {"capacity": "0.5B"}}, "memory.capacity"),
        ({"memory": {"capacity": "0.1KiB"}}, "memory.capacity"),
        ({"memory": {"capacity": 10**30}}, "memory.capacity"),
        ({"io_timeout_ms": 10**30}, "io_timeout_ms"),
        ({"io_timeout_ms": float("inf")}, "io_timeout_ms"),
        ({"write_queue_depth": 10**30}, "write_queue_depth"),
        ({"io_threads": 2000}, "io_threads"),
        ({"mooncake": {"backoff_s": float("nan")}}, "mooncake.backoff_s"),
        ({"mooncake": {"backoff_s": float("inf")}}, "mooncake.backoff_s"),
        ({"mooncake": {"backoff_s": 10**400}}, "mooncake.backoff_s"),
        ({"mooncake": {"timeout_ms": 10**30}}, "mooncake.timeout_ms"),
        ({"mooncake": {"workers": 2000}}, "mooncake.workers"),
        ({"tenant": "acme\n"}, "tenant"),
        ({"eviction": {"tenant_quotas": {"acme\n": "1GiB"}}}, "eviction.tenant_quotas.acme\\n"),  # one line: escaped
        ({"trusted_tenants": ["ok", "bad\n"]}, "trusted_tenants[1]"),
        ({"trusted_tenants": "alice"}, "trusted_tenants"),
        ({"tenant_signing_key": "zz"}, "tenant_signing_key"),
        ({"tenant_signing_key": "ab" * 4}, "tenant_signing_key"),
        ({"integrity_key": "ab" * 8}, "integrity_key"),
        ({"integrity_key": "not hex at all, not hex at all!!"}, "integrity_key"),
        ({"integrity_key_file": "/nonexistent/kvpack.key"}, "integrity_key_file"),
        ({"metrics_max_tenants": 0}, "metrics_max_tenants"),
    ],
)
def test_bad_values_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVPackConfig.from_dict(data)
    assert info.value.field == field


def test_json_infinity_and_toml_inf_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        KVPackConfig.from_json('{"memory": {"capacity": Infinity}}')
    assert info.value.field == "memory.capacity"
    with pytest.raises(ConfigError) as info:
        KVPackConfig.from_json(json.dumps({"mooncake": {"backoff_s": float("nan")}}))
    assert info.value.field == "mooncake.backoff_s"
    toml = tmp_path / "kv.toml"
    toml.write_text("[memory]\ncapacity = inf\n")
    with pytest.raises(ConfigError) as info:
        KVPackConfig.from_file(toml)
    assert info.value.field == "memory.capacity"
    toml.write_text("[mooncake]\nbackoff_s = nan\n")
    with pytest.raises(ConfigError) as info:
        KVPackConfig.from_file(toml)
    assert info.value.field == "mooncake.backoff_s"


def test_mooncake_file_sizes_overflowing_name_the_key(tmp_path: Path) -> None:
    f = tmp_path / "mooncake.json"
    f.write_text(json.dumps({"master_server_address": "127.0.0.1:1", "global_segment_size": HUGE + "GB"}))
    with pytest.raises(ConfigError) as info:
        KVPackConfig.from_dict({"mooncake": {"enabled": True, "config_file": str(f)}})
    assert info.value.field == "mooncake.config_file:global_segment_size"


@pytest.mark.parametrize("value", [1.9, "0.5B", "1.5B", float("inf"), float("nan"), HUGE, HUGE + "B", 10**30])
def test_sizes_are_exact_or_refused(value: object) -> None:
    with pytest.raises(ValueError):
        parse_size(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "size"), [(2.0, 2), ("1.5KiB", 1536), ("1.5 GB", 1_500_000_000), ("8GiB", 8 << 30)])
def test_whole_sizes_still_parse(value: object, size: int) -> None:
    assert parse_size(value) == size  # type: ignore[arg-type]


def test_good_values_at_the_bounds_are_accepted() -> None:
    cfg = KVPackConfig.from_dict(
        {
            "io_threads": 64,
            "io_timeout_ms": 600_000,
            "mooncake": {"backoff_s": 0, "workers": 64, "staging_size": "64MiB"},
            "trusted_tenants": ["alice", "*"],
            "integrity_key": "ab" * 32,
        }
    )
    assert cfg.trusted_tenants == ("alice", "*") and cfg.integrity_key_bytes() == b"\xab" * 32
    assert KVPackConfig.from_dict(cfg.to_dict()) == cfg


def test_integrity_key_from_a_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("cd" * 32 + "\n")
    assert KVPackConfig.from_dict({"integrity_key_file": str(key)}).integrity_key_bytes() == b"\xcd" * 32


@pytest.mark.parametrize("check", [validate_tenant, validate_member, validate_chunk_hash])
def test_names_with_a_trailing_newline_are_refused(check) -> None:  # type: ignore[no-untyped-def]
    good = {validate_tenant: "acme", validate_member: "kv", validate_chunk_hash: "ab12"}[check]
    assert check(good) == good
    with pytest.raises(ValueError):
        check(good + "\n")


def test_store_keys_with_a_trailing_newline_are_refused() -> None:
    with pytest.raises(ValueError):
        StoreKey("acme", "ab12", "cd34\n", "kv")
    with pytest.raises(ValueError):
        StoreKey.batch("acme\n", "ab12", ["cd34"], "kv")
