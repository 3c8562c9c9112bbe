"""The config's ``reset`` section: what an engine's own reset verb removes, and the tiers a
reset or a clear may name. The rule that applies it is `kvpack.policy.clearing`."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..errors import ConfigError
from .build import join_path


class ClearTier(enum.Enum):
    """A tier a reset or clear may act on (``reset.tiers``, ``kvpack clear --tier``)."""

    MEMORY = "memory"
    HOST = "host"
    DISK = "disk"
    MOONCAKE = "mooncake"


class ResetScope(enum.Enum):
    """What an engine's reset removes (``reset.scope``)."""

    MODEL = "model"
    """The objects of this engine's current group fingerprint(s), every tenant (the default)."""
    ALL = "all"
    """Every object of the tiers this instance reaches, whatever model or tenant stored it."""
    OFF = "off"
    """Nothing: vLLM's ``reset_cache`` answers False, SGLang's ``clear`` logs that it is off."""


@dataclass(frozen=True)
class ResetConfig:
    """The ``reset`` section: what the engine's own reset verb removes (see the module docstring).

    `tiers`: the tiers it acts on, among those the instance reaches; empty (the default): all."""

    scope: ResetScope = ResetScope.MODEL
    tiers: tuple[ClearTier, ...] = ()

    def validate(self, path: str) -> None:
        seen: set[ClearTier] = set()
        for i, tier in enumerate(self.tiers):
            if tier in seen:
                raise ConfigError(join_path(path, f"tiers[{i}]"), f"{tier.value!r} is listed twice")
            seen.add(tier)
