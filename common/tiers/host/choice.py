"""Which memory tier a process uses: ``memory.mode`` resolved (`resolve_memory`).

- PROCESS: the in-process arena (`kvpack.tiers.memory.MemoryTier`), `capacity` per process.
- HOST: the host store (`kvpack.tiers.host.HostTier`), `capacity` per host; the
  host's shared memory must hold it (`place.shm_problem`), else start-up fails with one line.
- AUTO: HOST when the engine runs more than one process on this host (the adapter
  passes `engine_processes`: vLLM's tensor x pipeline x data parallel ranks) or a live
  process already uses the host store (a second server started after one in host
  mode); else PROCESS, which gives its memory back when the process ends (a host store
  holds its arena until dropped) and serves one process's hits a little faster (no index
  transaction, no checksum on load: ``kvpack bench vllm --memory-mode``). When the shared memory cannot hold
  the store, AUTO falls back to PROCESS with a warning.

A folder at the store's name that is not this user's alone (a symlink, another uid's, group or
other bits: `kvpack.tiers.disk.private`) is never used: HOST fails start-up with one line naming
it, AUTO takes PROCESS with one warning; its owner files (another user's locks) count for nothing.

Resolution reads the file system only (the host folder's owner files); it changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ...config.schema import KVPackConfig, MemoryMode
from ...errors import ConfigError
from ..disk.fs import SHM
from ..disk.private import REFUSED, path_problem
from .owners import live_users
from .place import host_root, shm_problem, store_name

log = logging.getLogger("kvpack")

_AUTO_CHOSE: set[str] = set()
"""Host store names that ``memory.mode: auto`` resolved to HOST in this process (`chosen_by_auto`)."""


def memory_mode(config: KVPackConfig, engine_processes: int = 1, shm: str = SHM) -> MemoryMode:
    """PROCESS or HOST for `config` (see the module docstring); ConfigError naming ``memory.mode``
    when HOST is asked for and the shared memory cannot hold `memory.capacity`."""
    mem = config.memory
    if mem.mode is MemoryMode.PROCESS:
        return MemoryMode.PROCESS
    root = host_root(store_name(config), shm)
    taken = path_problem(root)
    if taken is not None:
        if mem.mode is MemoryMode.HOST:
            raise ConfigError("memory.mode", f"host: {taken}; {REFUSED}")
        log.warning("kvpack: memory.mode auto: the per-process memory tier (%s: not used)", taken)
        return MemoryMode.PROCESS
    problem = shm_problem(mem.capacity, shm, root)
    if mem.mode is MemoryMode.HOST:
        if problem is not None:
            raise ConfigError("memory.mode", f"host: {problem}; set memory.mode to process or lower memory.capacity")
        return MemoryMode.HOST
    if engine_processes <= 1 and live_users(root) == 0:
        return MemoryMode.PROCESS
    if problem is not None:
        log.warning("kvpack: memory.mode auto: the per-process memory tier (%s)", problem)
        return MemoryMode.PROCESS
    _AUTO_CHOSE.add(store_name(config))
    return MemoryMode.HOST


def chosen_by_auto(config: KVPackConfig) -> bool:
    """Did ``memory.mode: auto`` choose the host store of `config` (in this process, here or in
    `resolve_memory`), rather than the operator? Such a store is given back by its last user."""
    return store_name(config) in _AUTO_CHOSE


def resolve_memory(config: KVPackConfig, engine_processes: int = 1, shm: str = SHM) -> KVPackConfig:
    """`config` with ``memory.mode`` PROCESS or HOST (`memory_mode`); unchanged when memory is off
    or the mode is already resolved. Adapters call it once with their engine's process count."""
    if not config.memory.enabled:
        return config
    mode = memory_mode(config, engine_processes, shm)
    if mode is config.memory.mode:
        return config
    return replace(config, memory=replace(config.memory, mode=mode))
