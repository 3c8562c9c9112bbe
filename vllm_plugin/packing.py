"""How vLLM's CPU attention packs a block: found by asking its own write kernel.

vLLM's CPU backend writes K and V into a block in its ISA's packing
(``cpu_attn._get_attn_isa``: ``amx``, ``vec``, ``vec16``, ``neon``...), and the
packing is nowhere declared. Measured on x86 (vLLM 0.32): V is row-major
``[T][D]`` under ``vec``/``vec16``; K is ``[D][T]`` under ``vec``/``vec16`` and
``[T/16][D/2][16][2]`` under ``amx`` (AMX tiles of 16 rows), and V under
``amx`` is ``[D/16][T/2][16][2]``. Rather than hard-code that, `find_packing` writes
random K/V for one block with the engine's own ``cpu_attn_reshape_and_cache``
and keeps the candidate `TilePacking` that reproduces the block's bytes exactly.
So a vLLM release that packs differently is either recognised or refused at
start-up (kvpack then keeps the engine-native object format for that worker,
with the ISA in its fingerprint); it is never misread.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvpack import TilePacking, vllm_cpu_geometry

log = logging.getLogger("kvpack.vllm")


@functools.cache  # one probe per process and geometry (a pure function of its arguments)
def find_packing(
    dtype: torch.dtype, block_size: int, head_size: int, isa: str
) -> tuple[TilePacking, TilePacking] | None:
    """(K, V) packings the engine's write kernel uses, or None when no candidate matches."""
    try:
        from vllm import _custom_ops as ops
    except Exception as exc:  # not a vLLM CPU build
        log.info("kvpack: vLLM CPU ops unavailable (%s); canonical layout off", exc)
        return None
    heads, blocks = 2, 2
    cache = torch.zeros((blocks, heads, block_size, 2 * head_size), dtype=dtype)
    key_cache, value_cache = cache.view(blocks, heads, block_size * 2, head_size).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(1234)
    key = torch.randn((block_size, heads, head_size), generator=gen).to(dtype)
    value = torch.randn((block_size, heads, head_size), generator=gen).to(dtype)
    slots = torch.arange(block_size, 2 * block_size, dtype=torch.int64)  # block 1 only
    try:
        ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
        )
    except Exception as exc:
        log.warning("kvpack: probing vLLM's %s block packing failed (%s); canonical layout off", isa, exc)
        return None
    e = cache.element_size()
    candidates = [TilePacking.row_major(head_size * e, head_size, e, block_size)]
    candidates += [
        TilePacking.panels(p, g, head_size, e)
        for p in (1, 2, 4, 8, 16)
        if p < head_size and head_size % p == 0
        for g in dict.fromkeys((block_size, 16, 32))
        if block_size % g == 0
    ]
    candidates += [
        TilePacking.token_pairs(pair, dims, block_size, e)
        for pair in (2, 4)
        for dims in (16, 32)
        if block_size % pair == 0 and head_size % dims == 0
    ]
    found: list[TilePacking] = []
    for half, want in ((0, key), (1, value)):
        hit = next((c for c in candidates if _reproduces(cache, half, want, c)), None)
        if hit is None:
            log.warning(
                "kvpack: vLLM's %s packing of %s is not one kvpack knows; canonical layout off", isa, "KV"[half]
            )
            return None
        found.append(hit)
    log.debug("kvpack: vLLM %s %s block %d head %d packs K as %s, V as %s", isa, dtype, block_size, head_size, *found)
    return found[0], found[1]


def _reproduces(cache: torch.Tensor, half: int, want: torch.Tensor, packing: TilePacking) -> bool:
    """Does writing `want` ([T, heads, D]) with `packing` give the engine's bytes of block 1?"""
    blocks, heads, tokens, two_d = cache.shape
    d = two_d // 2
    ours = torch.zeros_like(cache)
    rows = TilePacking.row_major(d * cache.element_size(), d, cache.element_size(), tokens)
    k, v = (packing, rows) if half == 0 else (rows, packing)
    geo = vllm_cpu_geometry([ours], k, v)
    obj = torch.zeros((geo.object_bytes(heads),), dtype=torch.uint8)
    canon = obj.view(cache.dtype).view(1, 2, heads, tokens, d)
    canon[0, half].copy_(want.permute(1, 0, 2))
    geo.copy([1], obj, gather=False, obj_heads=heads, use_kernel=False)
    tile = ours.view(blocks, heads, 2, tokens * d)[1, :, half]
    theirs = cache.view(blocks, heads, 2, tokens * d)[1, :, half]
    return bool(torch.equal(tile.view(torch.uint8) if tile.dtype.itemsize == 1 else tile, theirs))
