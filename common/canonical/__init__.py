"""The canonical object layout: what vLLM at any TP size, on any CPU type, and an SGLang
server write and read alike. One package for the core's part of it:

- `kvpack.canonical.geometry`: the bytes. `CanonicalGeometry` describes an engine's cache
  (`TilePacking` per K/V; `paged_geometry` for NHD/HND/SGLang pools, `vllm_cpu_geometry`
  for vLLM's CPU packings) and copies blocks <-> objects for any head sub-range (C++
  and CUDA kernels in csrc/canonical_copy*, a torch path everywhere else).
- `kvpack.canonical.identity`: the fingerprints. A canonical group names the model
  identity, KV dtype, chunk tokens and `CANONICAL_FORMAT`, never the writer; a member
  adds its head range (`kvpack.identity.heads`: how TP ranks split the KV heads).

What stays in an adapter is only the engine's own facts: whether an engine's set-up
qualifies and which packing its CPU attention uses (vllm_plugin/canonical_blocks.py and
packing.py), which host pools are canonical (sglang_plugin/pools.py).
"""

from .addressed import address_of, upload_runs
from .geometry import CANONICAL_FORMAT, CanonicalGeometry, TilePacking, cpu_simd, paged_geometry, vllm_cpu_geometry
from .identity import ENGINE, StoredRange, group_spec, head_range_fingerprint, split_sources

__all__ = [
    "CANONICAL_FORMAT",
    "ENGINE",
    "CanonicalGeometry",
    "StoredRange",
    "TilePacking",
    "address_of",
    "upload_runs",
    "cpu_simd",
    "group_spec",
    "head_range_fingerprint",
    "paged_geometry",
    "split_sources",
    "vllm_cpu_geometry",
]
