"""A LoRA adapter's identity in the key seed is what it computes (`kvpack.adapter_identity`): its
adapter_config.json and weights, on real files; its name only where the files are not here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fixtures.lora_adapter import write_adapter
from kvpack import KVPackConfig, TenantSource, adapter_identity, resolve_tenant
from kvpack.identity.model_identity import clear_cache


def seed_of(adapter: str) -> object:
    return resolve_tenant(TenantSource(adapter=adapter), KVPackConfig()).seed


def test_an_adapter_reloaded_under_its_name_with_other_weights_gets_other_keys(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "sql-lora", seed=0)
    first = adapter_identity(path, "sql-lora:1")
    assert first.startswith("lora:v1:")
    assert adapter_identity(path, "sql-lora:1") == first  # cached, stable
    write_adapter(path, seed=1)  # retrained, saved over the same path, loaded again under the same name
    second = adapter_identity(path, "sql-lora:1")
    assert second != first
    assert seed_of(first) != seed_of(second)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 32}))  # same weights, other scale
    assert adapter_identity(path, "sql-lora:1") not in (first, second)


def test_the_same_adapter_shares_under_any_name_path_or_base_path(tmp_path: Path) -> None:
    a = adapter_identity(write_adapter(tmp_path / "a", seed=3), "a:1")
    b = adapter_identity(write_adapter(tmp_path / "elsewhere" / "b", seed=3, base="org/base"), "b:7")
    assert a == b
    clear_cache()
    assert adapter_identity(tmp_path / "a", "a:1") == a  # recomputed: a pure function of the files


def test_a_file_rewritten_in_place_with_the_same_size_is_seen(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", seed=0)
    first = adapter_identity(path, "a:1")
    weights = path / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor, deep in the file
    weights.write_bytes(bytes(data))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert adapter_identity(path, "a:1") != first


def test_an_adapter_not_on_this_machine_is_its_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="kvpack.identity.model_identity"):
        assert adapter_identity("org/some-hub-adapter", "hub:2") == "name:hub:2"
        assert adapter_identity(tmp_path / "missing", "hub:2") == "name:hub:2"
        assert adapter_identity(None, "x:3") == "name:x:3"
    assert sum("'hub:2'" in r.getMessage() for r in caplog.records) == 1  # once per name
