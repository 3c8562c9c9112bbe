"""MooncakeTierConfig: Mooncake JSON config files, MOONCAKE_CONFIG_PATH, field-named errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpack.config.schema import KVPackConfig, MooncakeProtocol, MooncakeTierConfig
from kvpack.errors import ConfigError
from kvpack.tiers.base import TierStatus
from kvpack.tiers.mooncake import MOONCAKE_CODES, code_info

pytestmark = pytest.mark.mooncake

MOONCAKE_JSON = {
    "local_hostname": "10.0.0.5",
    "metadata_server": "P2PHANDSHAKE",
    "global_segment_size": "3.125GB",
    "local_buffer_size": 1073741824,
    "protocol": "RDMA",
    "device_name": "mlx5_0",
    "master_server_address": "10.0.0.1:50051",
    "tenant_id": "team-a",
    "enable_ssd_offload": False,
}


def _write(tmp_path: Path, data: object) -> str:
    p = tmp_path / "mooncake.json"
    p.write_text(json.dumps(data))
    return str(p)


def test_file_fills_fields_left_at_default(tmp_path: Path) -> None:
    path = _write(tmp_path, MOONCAKE_JSON)
    cfg = KVPackConfig.from_dict({"mooncake": {"enabled": True, "config_file": path, "tenant_id": "mine"}}).mooncake
    r = cfg.resolved()
    assert r.master_server_address == "10.0.0.1:50051"
    assert r.local_hostname == "10.0.0.5"
    assert r.protocol is MooncakeProtocol.RDMA and r.device_name == "mlx5_0"
    assert r.global_segment_size == int(3.125 * (1 << 30))  # Mooncake's GB is 2**30
    assert r.local_buffer_size == 1 << 30
    assert r.tenant_id == "mine"  # set here: wins over the file


def test_environment_variable_is_used_without_an_address(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", _write(tmp_path, {**MOONCAKE_JSON, "protocol": "tcp"}))
    cfg = KVPackConfig.from_dict({"mooncake": {"enabled": True}}).mooncake
    assert cfg.resolved().master_server_address == "10.0.0.1:50051"


@pytest.mark.parametrize(
    "data, field",
    [
        ({**MOONCAKE_JSON, "bogus": 1}, "mooncake.config_file:bogus"),
        ({**MOONCAKE_JSON, "global_segment_size": "lots"}, "mooncake.config_file:global_segment_size"),
        ({**MOONCAKE_JSON, "protocol": "carrier-pigeon"}, "mooncake.config_file:protocol"),
        ([1, 2], "mooncake.config_file"),
    ],
)
def test_bad_file_names_the_key(tmp_path: Path, data: object, field: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        KVPackConfig.from_dict({"mooncake": {"enabled": True, "config_file": path}})
    assert err.value.field == field


@pytest.mark.parametrize(
    "cfg, field",
    [
        ({"enabled": True}, "mooncake.master_server_address"),
        ({"enabled": True, "master_server_address": "h:1", "protocol": "rdma"}, "mooncake.device_name"),
        ({"timeout_ms": 0}, "mooncake.timeout_ms"),
        ({"workers": 0}, "mooncake.workers"),
        ({"staging_size": "1KiB"}, "mooncake.staging_size"),
        ({"enabled": True, "config_file": "/nonexistent/mc.json"}, "mooncake.config_file"),
    ],
)
def test_bad_values_name_the_field(cfg: dict, field: str, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[type-arg]
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    with pytest.raises(ConfigError) as err:
        KVPackConfig.from_dict({"mooncake": cfg})
    assert err.value.field == field


def test_every_code_has_a_named_outcome() -> None:
    assert code_info(0).status is TierStatus.OK and code_info(4096).status is TierStatus.OK
    assert code_info(-704).status is TierStatus.MISS
    assert code_info(-200).status is TierStatus.NO_SPACE and code_info(-1700).status is TierStatus.NO_SPACE
    assert code_info(-800).status is TierStatus.ERROR
    assert code_info(-900).status is TierStatus.UNAVAILABLE and code_info(-900).trips_breaker
    assert code_info(-12345).name == "UNKNOWN_-12345" and code_info(-12345).status is TierStatus.ERROR
    assert all(info.name.isupper() for info in MOONCAKE_CODES.values())


def test_defaults_round_trip() -> None:
    cfg = MooncakeTierConfig()
    assert KVPackConfig.from_dict({"mooncake": KVPackConfig(mooncake=cfg).to_dict()["mooncake"]}).mooncake == cfg
