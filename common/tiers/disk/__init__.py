"""The local-disk tier: one marked folder, one file per object, a shared SQLite index.

Modules, each with one job:

- `tier`: `DiskTier`, the `Tier` the store talks to (batched contains / get / put / remove);
- `files`: the bytes of one object file (header, padding, payload) and their verified read;
- `paths`: where an object's file lives, and the emptied folders that go;
- `fs`: the file-system rules (the store root, opening beneath it without following links);
- `catalog`: the persistent index every process on the folder shares, and its capacity
  (`rows`: how it names groups and objects; `reconcile`: the folder scan's side of it);
- `scan`: the folder scan that builds or reconciles that index.
"""

from .files import SUFFIX, data_offset
from .tier import STALE_TEMP_S, DiskCounters, DiskTier

__all__ = ["DiskCounters", "DiskTier", "STALE_TEMP_S", "SUFFIX", "data_offset"]
