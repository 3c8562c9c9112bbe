"""kvpack.ops: block gather/scatter between an engine's paged KV cache and kvpack's
contiguous staging buffers, all layers in one call.

    kv = PagedKV.from_layers(kv_caches)                     # vLLM, one tensor per layer
    kv = PagedKV.from_sglang_host_pool(buf, "page_first", page_size=64)
    out = torch.empty(len(ids) * staging_bytes_per_block(kv), dtype=torch.uint8)
    gather_blocks(kv, ids, out)                             # cache -> staging
    scatter_blocks(kv, ids, out)                            # staging -> cache

Staging layout (uint8): ``[block_i][layer][segment][outer][inner][row_bytes]``;
see ``kvpack.ops.layout``. For a cache on a GPU, adapters stage through
`kvpack.transfers` (`Staging`: pinned rows, a side stream per direction, an event per batch)
and pass its lane's stream as ``stream=``; `upload_ids` puts a batch's ids on the
device once. Backends: CUDA kernel, C++ kernel, pure torch; the
kernels are JIT-built on first use (``kvpack.ops._build``). Importing this module
builds nothing and needs no CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exports import LazyExports

if TYPE_CHECKING:  # imported on first use (`kvpack.exports`): importing the package imports no torch
    from ._build import ExtensionStatus, load_extension
    from .copy import (
        Backend,
        UploadedIds,
        gather_blocks,
        scatter_blocks,
        select_backend,
        staging_bytes_per_block,
        upload_ids,
    )
    from .layout import KVLayout, KVLayoutKind, LayoutError, LoopDim
    from .natives import object_reader, object_remover, object_writer, region_copier
    from .paged import PagedKV

__all__ = [
    "Backend",
    "ExtensionStatus",
    "KVLayout",
    "KVLayoutKind",
    "LayoutError",
    "LoopDim",
    "PagedKV",
    "gather_blocks",
    "load_extension",
    "object_reader",
    "object_remover",
    "object_writer",
    "region_copier",
    "scatter_blocks",
    "select_backend",
    "staging_bytes_per_block",
    "UploadedIds",
    "upload_ids",
]

__getattr__ = LazyExports.read(__name__, __file__).resolve
