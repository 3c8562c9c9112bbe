"""PagedKV: an engine's KV cache tensors bound to their checked layout.

Build one per cache at registration time (vLLM ``register_kv_caches``, SGLang
host pool creation) and reuse it for every copy: the layout is parsed once and the
per-device pointer table (segment base addresses) is built once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .layout import (
    SGLANG_HOST_LAYOUTS,
    KVLayout,
    KVLayoutKind,
    LayoutError,
    check_in_bounds,
    infer_layer_layout,
    parse_pool_layout,
    vector_alignment,
)


@dataclass(frozen=True, eq=False)
class PagedKV:
    """Cache tensors + layout + the address of every (layer, segment).

    Invariants: ``len(segment_addresses) == layout.num_layers * layout.num_segments``
    in (layer, segment) order; every addressed byte lies inside ``tensors``'
    storage (checked at construction); ``tensors`` keep that memory alive.
    """

    tensors: tuple[torch.Tensor, ...]
    layout: KVLayout
    segment_addresses: tuple[int, ...]
    _tables: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_layers(
        cls,
        tensors: Sequence[torch.Tensor],
        *,
        kind: KVLayoutKind | None = None,
        block_size: int | None = None,
    ) -> PagedKV:
        """One tensor per layer (vLLM). See ``layout.infer_layer_layout`` for kind/block_size."""
        tensors = tuple(tensors)
        layout, seg_offsets = infer_layer_layout(tensors, kind=kind, block_size=block_size)
        addrs = tuple(t.data_ptr() + off for t in tensors for off in seg_offsets)
        for i, t in enumerate(tensors):
            check_in_bounds(t, layout, addrs[i * len(seg_offsets) : (i + 1) * len(seg_offsets)])
        return cls(tensors=tensors, layout=layout, segment_addresses=addrs)

    @classmethod
    def from_sglang_host_pool(
        cls, kv_buffer: torch.Tensor, layout: str | KVLayoutKind, page_size: int, *, mla: bool = False
    ) -> PagedKV:
        """One SGLang host pool tensor holding every layer; a block is a page.

        `layout` is SGLang's name (``layer_first``, ``page_first``,
        ``page_first_direct``, ``page_head``) or a KVLayoutKind. Block id p is the
        page of host token indices [p * page_size, (p + 1) * page_size).
        """
        if isinstance(layout, KVLayoutKind):
            kind = layout
        else:
            try:
                kind = SGLANG_HOST_LAYOUTS[(layout, mla)]
            except KeyError:
                names = sorted({n for n, m in SGLANG_HOST_LAYOUTS if m == mla})
                raise LayoutError(
                    f"kvpack.ops: unknown SGLang {'MLA' if mla else 'MHA'} host layout {layout!r}; known: {names}"
                ) from None
        parsed, layer_stride, seg_offsets = parse_pool_layout(kv_buffer, kind, page_size)
        base = kv_buffer.data_ptr()
        addrs = tuple(base + layer * layer_stride + off for layer in range(parsed.num_layers) for off in seg_offsets)
        check_in_bounds(kv_buffer, parsed, addrs)
        return cls(tensors=(kv_buffer,), layout=parsed, segment_addresses=addrs)

    @property
    def device(self) -> torch.device:
        """Device of the cache memory."""
        return self.tensors[0].device

    def pointer_table(self) -> torch.Tensor:
        """int64 tensor of segment addresses on the cache's device (built once, cached)."""
        with self._lock:
            table = self._tables.get(self.device)
            if table is None:
                table = torch.tensor(self.segment_addresses, dtype=torch.int64).to(self.device)
                self._tables[self.device] = table
            return table

    def address_alignment(self) -> int:
        """Largest power of two <= 16 dividing every segment address."""
        return vector_alignment(*self.segment_addresses)


def as_paged(kv: PagedKV | Sequence[torch.Tensor]) -> PagedKV:
    """`kv` itself, or a PagedKV inferred from a list of per-layer tensors."""
    return kv if isinstance(kv, PagedKV) else PagedKV.from_layers(kv)
