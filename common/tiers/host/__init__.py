"""The host memory tier: one store in the host's shared memory for every kvpack process of a user.

`HostTier` (``tier``) holds the shared index the disk tier holds too (`kvpack.tiers.index`), over
one arena file on tmpfs (``/dev/shm``) that every process maps once (`pages`). `place` finds and
checks the folder, `owners` tells live processes from dead ones, `catalog` (the index's extension)
records which pages hold which object and who is writing what, `choice` decides
``memory.mode: auto``, `stores` lists this user's stores and drops one (``kvpack host``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...exports import LazyExports

if TYPE_CHECKING:  # imported on first use (`kvpack.exports`)
    from .choice import chosen_by_auto, memory_mode, resolve_memory
    from .place import disk_store_name, host_root, shm_problem, store_name
    from .stores import HostStore, drop, give_back, host_stores
    from .tier import HostTier

__all__ = [
    "HostStore",
    "HostTier",
    "chosen_by_auto",
    "disk_store_name",
    "drop",
    "give_back",
    "host_root",
    "host_stores",
    "memory_mode",
    "resolve_memory",
    "shm_problem",
    "store_name",
]

__getattr__ = LazyExports.read(__name__, __file__).resolve
