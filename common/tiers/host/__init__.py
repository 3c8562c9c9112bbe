"""The host memory tier: one store in the host's shared memory for every kvpack process of a user.

`HostTier` (``tier``) is the disk tier's machinery rooted on tmpfs (``/dev/shm``):
a file's pages are host memory, counted once (tmpfs has no second page-cache
copy). `place` finds and checks the folder, `owners` tells live processes from
dead ones, `catalog` records who is writing what, `choice` decides
``memory.mode: auto``.
"""

from .choice import memory_mode, resolve_memory
from .place import host_root, shm_problem, store_name
from .tier import HostTier

__all__ = ["HostTier", "host_root", "memory_mode", "resolve_memory", "shm_problem", "store_name"]
