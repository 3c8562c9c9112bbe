"""The local-disk tier: one marked folder, one file per object, a shared SQLite index.

Modules, each with one job:

- `tier`: `DiskTier`, the `Tier` the store talks to (batched contains / get / put / remove);
- `files`: the bytes of one object file (header, padding, payload) and their verified read;
- `paths`: where an object's file lives, and the emptied folders that go;
- `fs`: the file-system rules (the store root, opening beneath it without following links);
- `writes`, `reads`, `removes`: a batch of object files written, read, removed (native or Python);
- `scan`: the folder scan that builds or reconciles the folder's index (`kvpack.tiers.index`, the
  one the host store holds too), and `reconcile` its rows (`FolderReconcile`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...exports import LazyExports

if TYPE_CHECKING:  # imported on first use (`kvpack.exports`)
    from .files import SUFFIX, data_offset
    from .tier import STALE_TEMP_S, DiskCounters, DiskTier

__all__ = ["DiskCounters", "DiskTier", "STALE_TEMP_S", "SUFFIX", "data_offset"]

__getattr__ = LazyExports.read(__name__, __file__).resolve
