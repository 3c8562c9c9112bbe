"""The tier factory: which tiers a config enables, built fastest first.

One place knows every tier implementation; a new tier is one more branch
here (and its module), nothing else in the core changes.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import KVPackConfig
from ..eviction import make_policy
from .base import Tier
from .parallel import RegionCopier


def build_tiers(
    config: KVPackConfig,
    *,
    include_memory: bool = True,
    copy_threads: int = 1,
    region_copier: Callable[[], RegionCopier | None] | None = None,
) -> list[Tier]:
    """The tiers `config` enables, fastest first: memory, disk, Mooncake.

    `include_memory=False` leaves out the host-memory tier, for a process that
    sees another process's memory through an index (vLLM's scheduler side).
    `copy_threads` (>= 1, the calling thread included) spreads one batch's
    memory copies and disk file I/O over that many threads; 1 keeps every
    call on its caller's thread (an engine that saves off its forward path on
    a small machine wants that). `region_copier` hands the memory tier a native
    copy (`kvpack.ops.region_copier`) once one is loaded."""
    tiers: list[Tier] = []
    quotas = config.eviction.tenant_quotas
    if config.memory.enabled and include_memory:
        from .memory import MemoryTier

        tiers.append(
            MemoryTier(
                config.memory.capacity,
                make_policy(config.eviction.policy),
                quotas,
                copy_threads=copy_threads,
                region_copier=region_copier,
            )
        )
    if config.disk.enabled:
        from .disk import DiskTier

        tiers.append(
            DiskTier(
                config.disk.path,
                config.disk.capacity,
                make_policy(config.eviction.policy),
                quotas,
                config.disk.fsync,
                io_threads=copy_threads,
            )
        )
    if config.mooncake.enabled:
        from .mooncake import MooncakeTier

        tiers.append(MooncakeTier(config.mooncake))
    return tiers
