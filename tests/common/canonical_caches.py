"""Caches the canonical-copy tests build: vLLM CPU-shaped geometries, zeroed or random, and a byte compare."""

from __future__ import annotations

import torch

from kvpack.canonical.geometry import CanonicalGeometry, TilePacking, vllm_cpu_geometry


def vllm_cpu_cache(
    nb: int,
    layers: int,
    heads: int,
    tokens: int,
    dim: int,
    dtype: torch.dtype,
    k: TilePacking,
    v: TilePacking,
    seed: int | None = None,
) -> CanonicalGeometry:
    """A vLLM CPU-shaped cache of `nb` blocks: zeros, or random bytes from `seed`."""
    geo = vllm_cpu_geometry([torch.zeros((nb, heads, tokens, 2 * dim), dtype=dtype) for _ in range(layers)], k, v)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in geo.tensors:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    return geo


def same_bytes(a: CanonicalGeometry, b: CanonicalGeometry) -> bool:
    """The caches hold the same bytes (random bytes hold NaNs, so values would not compare)."""
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a.tensors, b.tensors))
