"""Pinned prefixes (`kvpack.store.pins`): a tenant's pinned groups survive pressure that evicts everything
else, in the memory tier and the disk folder; past the budget a pin is refused with one line; unpin
makes them evictable; pins survive reopening the store (an engine restart); `kvpack pin` lists them."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fixtures.builders import GROUP_FP, chunk_id, make_item
from kvpack import KVPackConfig, KVStore, PinOutcome, TierStatus, pin_trusted
from kvpack.cli import main
from kvpack.errors import ConfigError
from kvpack.identity.keys import StoreKey
from kvpack.tiers.host import host_root

OBJ = 1024
"""Bytes of every test object (one member per group: a group is one object)."""
PROMPT = [chunk_id(i) for i in range(3)]
"""The pinned prefix: tenant acme's system prompt, three chunks."""


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[..., KVStore]]:
    opened: list[KVStore] = []

    def make(budget: int = 3 * OBJ, **overrides: object) -> KVStore:
        data: dict = {
            "disk": {"path": str(tmp_path / "disk"), "capacity": 8 * OBJ},
            "memory": {"capacity": 8 * OBJ},
            "eviction": {"pinned_bytes_per_tenant": budget},
        }
        data.update(overrides)
        store = KVStore.from_config(KVPackConfig.from_dict(data), write_back=False)
        opened.append(store)
        return store

    yield make
    for s in reversed(opened):
        s.close()


def put(store: KVStore, tenant: str, chunks: list[str], nbytes: int = OBJ) -> None:
    items = [make_item(tenant, c, nbytes=nbytes, seed=i, checksum=False)[0] for i, c in enumerate(chunks)]
    assert store.store(items) == [TierStatus.OK] * len(items)


def held(store: KVStore, tier: str, tenant: str, chunks: list[str]) -> list[bool]:
    t = next(t for t in store.tiers if t.name == tier)
    return t.contains([StoreKey(tenant, GROUP_FP, c, "kv") for c in chunks])


def pressure(store: KVStore) -> list[str]:
    """Stores of two tenants, 40 KiB into tiers of 8 KiB: LRU would evict the prompt many times over."""
    others = [chunk_id(100 + i) for i in range(40)]
    for i in range(0, 40, 4):
        put(store, "acme" if i % 8 else "globex", others[i : i + 4])
    return others


@pytest.mark.parametrize("pinned", [True, False])
def test_pinned_prefix_survives_pressure_that_evicts_everything_else(
    open_store: Callable[..., KVStore], pinned: bool
) -> None:
    store = open_store()
    put(store, "acme", PROMPT)
    if pinned:
        done = store.pin_prefix("acme", GROUP_FP, PROMPT)
        assert done is not None and (done.pinned, done.refused) == (3, 0)
    others = pressure(store)
    for tier in ("memory", "disk"):
        assert held(store, tier, "acme", PROMPT) == [pinned] * 3, tier  # unpinned (the control): evicted first
        old = held(store, tier, "acme", others[:24]) + held(store, tier, "globex", others[:24])
        assert not any(old), f"{tier} kept older unpinned groups"
    assert store.tiers[1].usage().used_bytes <= 8 * OBJ


@pytest.fixture
def host_name() -> Iterator[str]:
    """A host store's name, its shared memory given back after the test (after its stores closed)."""
    name = f"test-pins-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    shutil.rmtree(host_root(name), ignore_errors=True)


def test_the_host_store_keeps_a_pinned_prefix_too(
    host_name: str, open_store: Callable[..., KVStore], tmp_path: Path
) -> None:
    big = 200 << 10
    store = open_store(
        budget=1 << 20,
        memory={"mode": "host", "host_name": host_name, "capacity": 8 << 20},
        disk={"path": str(tmp_path / "disk"), "capacity": 64 << 20},
    )
    assert store.tiers[0].name == "host"
    put(store, "acme", PROMPT, big)
    assert store.pin_prefix("acme", GROUP_FP, PROMPT) == PinOutcome(pinned=3)
    others = [chunk_id(100 + i) for i in range(80)]  # 16 MiB into 8 MiB (40 such objects)
    for i in range(0, 80, 4):
        put(store, "globex", others[i : i + 4], big)
    assert held(store, "host", "acme", PROMPT) == [True] * 3
    assert not any(held(store, "host", "globex", others[:40]))


def test_pin_past_the_budget_is_refused_with_one_line(
    open_store: Callable[..., KVStore], caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(budget=2 * OBJ)
    put(store, "acme", PROMPT)
    with caplog.at_level(logging.WARNING, logger="kvpack.store.pins"):
        done = store.pin_prefix("acme", GROUP_FP, PROMPT)
        store.pin_prefix("acme", GROUP_FP, PROMPT)  # the next request of that prompt: counted, not logged again
    assert done is not None and (done.pinned, done.refused, done.refused_bytes) == (2, 1, OBJ)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvpack.store.pins"]
    assert len(lines) == 1 and "tenant acme" in lines[0] and "1024 more bytes" in lines[0] and "2048" in lines[0]
    assert store.metrics.value("pins_refused", tenant="acme") == 2
    pressure(store)
    assert held(store, "disk", "acme", PROMPT) == [True, True, False]  # the refused chunk is evictable
    again = store.pin_prefix("acme", GROUP_FP, PROMPT[:2])
    assert again is not None and again.already == 2 and again.refused == 0


def test_unpin_makes_the_prefix_evictable(open_store: Callable[..., KVStore], tmp_path: Path) -> None:
    store = open_store()
    put(store, "acme", PROMPT)
    store.pin_prefix("acme", GROUP_FP, PROMPT)
    assert main(["pin", "--unpin", "--tenant", "acme", "--disk", str(tmp_path / "disk")]) == 0
    pressure(store)
    for tier in ("memory", "disk"):
        assert held(store, tier, "acme", PROMPT) == [False] * 3, tier


def test_pins_survive_reopening_the_store(
    open_store: Callable[..., KVStore], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = open_store()
    put(first, "acme", PROMPT)
    first.pin_prefix("acme", GROUP_FP, PROMPT)
    first.close()
    store = open_store()  # an engine restart: a new process's store on the same folder
    pressure(store)
    assert held(store, "disk", "acme", PROMPT) == [True] * 3
    capsys.readouterr()
    assert main(["pin", "--list", "--json", "--disk", str(tmp_path / "disk")]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["tenants"] == {"acme": {"groups": 3, "bytes": 3 * OBJ}}
    assert [p["chunk"] for p in listing["pins"]] == PROMPT
    assert main(["pin", "--disk", str(tmp_path / "disk"), "--tenant", "globex"]) == 0
    assert capsys.readouterr().out.strip() == "no pins"


def test_pin_command_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pin", "--unpin", "--disk", str(tmp_path)]) == 2
    assert main(["pin", "--tenant", "a/b", "--disk", str(tmp_path)]) == 2
    assert main(["pin", "--disk", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("kvpack pin: ") for line in err)


def test_pin_is_honoured_only_from_a_trusted_front_end() -> None:
    trusting = KVPackConfig.from_dict({"trusted_tenants": ["acme"]})
    assert pin_trusted(trusting, {"kvpack_tenant": "acme"}) is None  # not asked
    assert pin_trusted(trusting, {"kvpack_tenant": "acme", "kvpack_pin": True}) is True
    assert pin_trusted(trusting, {"kvpack_tenant": "globex", "kvpack_pin": True}) is False
    assert pin_trusted(trusting, {"kvpack_pin": True}) is False  # no tenant named: nobody vouches for it
    assert pin_trusted(KVPackConfig.from_dict({}), {"kvpack_tenant": "acme", "kvpack_pin": True}) is False


def test_pinned_budget_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"eviction\.pinned_bytes_per_tenant") as exc:
        KVPackConfig.from_dict({"disk": {"enabled": False}, "eviction": {"pinned_bytes_per_tenant": "1MiB"}})
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match=r"eviction\.pinned_bytes_per_tenant"):
        KVPackConfig.from_dict({"eviction": {"pinned_bytes_per_tenant": -1}})
    assert KVPackConfig.from_dict({"eviction": {"pinned_bytes_per_tenant": "64MiB"}}).eviction.pinned_bytes_per_tenant


def test_a_tenant_over_a_lowered_budget_keeps_nothing(open_store: Callable[..., KVStore]) -> None:
    first = open_store(budget=3 * OBJ)
    put(first, "acme", PROMPT)
    assert first.pin_prefix("acme", GROUP_FP, PROMPT) == PinOutcome(pinned=3)
    first.close()
    store = open_store(budget=2 * OBJ)  # restarted with a smaller budget: acme's 3 KiB of pins are over it
    pressure(store)
    assert held(store, "disk", "acme", PROMPT) == [False] * 3


def test_usage_shows_pins_and_clear_drops_the_tenants(
    open_store: Callable[..., KVStore], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = open_store()
    put(store, "acme", PROMPT)
    put(store, "globex", PROMPT)
    store.pin_prefix("acme", GROUP_FP, PROMPT)
    store.pin_prefix("globex", GROUP_FP, PROMPT[:1])
    store.close()
    folder = str(tmp_path / "disk")
    capsys.readouterr()
    assert main(["usage", "--disk", folder, "--json"]) == 0
    disk = next(s for s in json.loads(capsys.readouterr().out)["stores"] if s["tier"] == "disk")
    assert disk["pinned"] == {"acme": {"groups": 3, "bytes": 3 * OBJ}, "globex": {"groups": 1, "bytes": OBJ}}
    assert main(["usage", "--disk", folder]) == 0
    assert f"pinned in {folder}: tenant acme: 3 groups, 3.0 KiB" in capsys.readouterr().out
    assert main(["clear", "--tenant", "acme", "--tier", "disk", "--disk", folder]) == 0
    capsys.readouterr()
    assert main(["pin", "--json", "--disk", folder]) == 0
    assert json.loads(capsys.readouterr().out)["tenants"] == {"globex": {"groups": 1, "bytes": OBJ}}
