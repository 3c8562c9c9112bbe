"""Config: `draft_placement` (auto | packed | sidecar), strict like every other field."""

from __future__ import annotations

import pytest

from kvpack import ConfigError, KVPackConfig
from kvpack.config.schema import DraftPlacementMode


def test_draft_placement_defaults_to_auto() -> None:
    assert KVPackConfig.from_dict({}).draft_placement is DraftPlacementMode.AUTO


@pytest.mark.parametrize("value", ["auto", "packed", "sidecar"])
def test_draft_placement_values_round_trip(value: str) -> None:
    cfg = KVPackConfig.from_dict({"draft_placement": value, "draft_policy": "target_only"})
    assert cfg.draft_placement is DraftPlacementMode(value)
    assert KVPackConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["draft_placement"] == value


@pytest.mark.parametrize("value", ["side", "PACKED", 1, None, True])
def test_bad_draft_placement_names_the_field(value: object) -> None:
    with pytest.raises(ConfigError, match="auto.*packed.*sidecar") as info:
        KVPackConfig.from_dict({"draft_placement": value})
    assert info.value.field == "draft_placement"
