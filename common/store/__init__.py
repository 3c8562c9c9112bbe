"""The store: one `KVStore` composed of parts with one job each (after vLLM's ``kv_offload``).

- `store` (`KVStore`): owns the tiers (fastest first): lookups, evictions, clears, start and close;
  holds the parts below and pairs their verbs (`prepare_load` / `complete_load`,
  `prepare_store` / `complete_store`).
- `writer` (`Writer`, `KVStore.writes`): store, write-through, write-back, and the one count of what is stored.
- `reader` (`Reader`, `KVStore.reads`; `LentLoad`): load plans, read-through and lending; a lent load's result
  carries its views and the re-check (`LentLoad.lost`) every caller runs after copying.
- `reads` (`TierReads`, `LoadItem`, `PageReads`): the read-through over the tiers.
- `lifecycle` (`PlanBook`, `LoadPlan`): open load plans (pins) and prepared stores (de-dup).
- `writeback` (`WriteBack`): the bounded queue and threads behind the front tier.
- `page_loads` (`PagePart`, `load_pages`): several objects per engine page, one plan.
- `located` (`LocatedHints`): where a lookup found each object, for the load that follows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exports import LazyExports

if TYPE_CHECKING:  # imported on first use (`kvpack.exports`)
    from .lifecycle import LoadPlan, PlanBook
    from .reader import LentLoad, Reader
    from .reads import LoadItem, PageReads, TierReads
    from .store import KVStore
    from .writer import Writer

__all__ = ["KVStore", "LentLoad", "LoadItem", "LoadPlan", "PageReads", "PlanBook", "Reader", "TierReads", "Writer"]

__getattr__ = LazyExports.read(__name__, __file__).resolve
