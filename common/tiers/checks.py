"""The start-up check of a config's tiers: every rule a tier's construction applies to the
config, through the same functions, changing nothing (no folder created, no marker written,
nothing connected). `kvpack.tiers.factory.build_tiers` runs it first and ``kvpack config``
runs it, so a file that command accepts is one start-up accepts. It builds no tier, so it
imports none (nor torch): the command stays quick.
"""

from __future__ import annotations

import os

from ..config.schema import KVPackConfig, MemoryMode
from .disk.fs import check_store_root
from .host.choice import memory_mode
from .index.check import check_index_files
from .mooncake.connection import check_support


def check_tiers(config: KVPackConfig, *, index_files: bool = True) -> None:
    """Raise the ConfigError that building `config`'s tiers would raise for their config, changing nothing.

    Disk: the store folder rules (`disk.fs.check_store_root`: where it may be, what
    an existing one may hold, that a missing one can be created). Mooncake: the
    installed package and its tenant support (`connection.check_support`). The
    memory tier has no rule beyond the config's own fields (checked when it was built).
    For an existing folder, the disk index's files too (`index.check.check_index_files`), unless
    `index_files` is False: `build_tiers`, whose `DiskTier` opens them by the same rules a moment later."""
    if config.disk.enabled:
        root = check_store_root(config.disk.path)
        if index_files and os.path.isdir(root):
            check_index_files(root)
    if config.memory.enabled and config.memory.mode is not MemoryMode.PROCESS:
        memory_mode(config)  # HOST: the host's shared memory must hold memory.capacity
    if config.mooncake.enabled:
        check_support(config.mooncake.resolved())
