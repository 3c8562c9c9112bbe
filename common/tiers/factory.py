"""The tier factory: which tiers a config enables, built fastest first.

One place knows every tier implementation; a new tier is one more branch
here (and its module), nothing else in the core changes.

`build_tiers` runs the start-up check (`kvpack.tiers.checks.check_tiers`) first, as
``kvpack config`` does, so a file that command accepts is one start-up accepts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..config.schema import KVPackConfig, MemoryMode
from ..policy.eviction import make_policy
from .base import Tier
from .checks import check_tiers
from .disk import DiskTier
from .disk.reads import ObjectReader
from .disk.removes import ObjectRemover
from .disk.writes import ObjectWriter
from .host import HostTier, chosen_by_auto, memory_mode, store_name
from .memory import MemoryTier
from .mooncake import MooncakeTier
from .parallel import RegionCopier

log = logging.getLogger("kvpack")


_WARNED: set[str] = set()


def warn_persistent(name: str, nbytes: int) -> None:
    """Once per process and store: a host store the operator asked for holds its memory until dropped."""
    if name not in _WARNED:
        _WARNED.add(name)
        log.warning(
            "kvpack: host store %s holds %d MiB of shared memory until dropped (memory.mode host): "
            "kvpack usage lists it, kvpack host drop %s gives it back",
            name,
            nbytes >> 20,
            name,
        )


def build_tiers(
    config: KVPackConfig,
    *,
    include_memory: bool = True,
    copy_threads: int = 1,
    region_copier: Callable[[], RegionCopier | None] | None = None,
    object_writer: Callable[[], ObjectWriter | None] | None = None,
    object_remover: Callable[[], ObjectRemover | None] | None = None,
    object_reader: Callable[[], ObjectReader | None] | None = None,
) -> list[Tier]:
    """The tiers `config` enables, fastest first: memory (per process, or the host's), disk, Mooncake.

    ``memory.mode`` decides the memory tier (`kvpack.tiers.host.choice`: AUTO is resolved
    here unless the adapter resolved it with its process count): PROCESS the in-process
    `MemoryTier`, HOST the `HostTier` every process on the host shares.
    `include_memory=False` leaves out the per-process memory tier, for a process that
    sees another process's memory through an index (vLLM's scheduler side); the host
    tier stays (it is every process's).
    `copy_threads` (>= 1, the calling thread included) spreads one batch's
    memory copies and disk file I/O over that many threads; 1 keeps every
    call on its caller's thread (an engine that saves off its forward path on
    a small machine wants that). `region_copier` hands the memory and host tiers a native
    copy (`kvpack.ops.region_copier`) once one is loaded, `object_writer` the disk tier a native
    batch file write (`kvpack.ops.object_writer`), `object_remover` a native batch
    removal (`kvpack.ops.object_remover`), `object_reader` a native batch read (`kvpack.ops.object_reader`)."""
    check_tiers(config, index_files=False)
    tiers: list[Tier] = []
    quotas = config.eviction.tenant_quotas
    mode = MemoryMode.PROCESS
    if config.memory.enabled:
        mode = memory_mode(config)
    if mode is MemoryMode.HOST:
        auto = chosen_by_auto(config)
        host = HostTier(
            store_name(config),
            config.memory.capacity,
            quotas,
            io_threads=copy_threads,
            region_copier=region_copier,
            give_back_unused=auto,
        )
        if not auto:
            warn_persistent(store_name(config), host.capacity_bytes)
        tiers.append(host)
    elif config.memory.enabled and include_memory:
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
        tiers.append(
            DiskTier(
                config.disk.path,
                config.disk.capacity,
                quotas,
                config.disk.fsync,
                io_threads=copy_threads,
                object_writer=object_writer,
                object_remover=object_remover,
                object_reader=object_reader,
            )
        )
    if config.mooncake.enabled:
        tiers.append(MooncakeTier(config.mooncake))
    return tiers
