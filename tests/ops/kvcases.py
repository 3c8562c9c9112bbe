"""Small KV caches in every known layout, with an independent way to address a block.

Each case builds real tensors in an engine's layout (random bytes) and a `phys`
function written by hand from the engine's documented shape: phys(layer, segment,
block) is a *view* of that block's bytes in physical order, shape
[outer, inner, row_bytes]. Tests compare the kernels against these views, so a
wrong layout parse in kvpack.ops cannot hide behind the torch fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvpack.ops import KVLayoutKind, PagedKV

NUM_BLOCKS = 9  # never 2: a size-2 block dim would make the K/V dim ambiguous
LAYERS = 3
TOKENS = 4  # block / page size
HEADS = 3
HEAD = 8  # head_size (elements)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)

Phys = Callable[[int, int, int], torch.Tensor]


@dataclass
class Case:
    name: str
    kv: PagedKV
    phys: Phys  # (layer, segment, block) -> uint8 view [outer, inner, row_bytes]
    token_dim: int | None  # which phys dim is tokens; None: whole blocks only
    tensors: list[torch.Tensor]  # the tensors that own the memory

    def clone_zeroed(self) -> Case:
        """The same layout over fresh zeroed memory (same shapes and strides)."""
        return BUILDERS[self.name](self.kv.tensors[0].dtype, self.kv.device, zero=True)


def _rand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, zero: bool) -> torch.Tensor:
    """A contiguous tensor of random bytes (any bit pattern, NaNs included) or zeros."""
    es = torch.empty(0, dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    if zero:
        raw = torch.zeros(n * es, dtype=torch.uint8)
    else:
        raw = torch.randint(0, 256, (n * es,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


def _b(t: torch.Tensor) -> torch.Tensor:
    """Byte view of a tensor whose last dim is contiguous: [..., D] -> [..., D * es]."""
    return t.view(torch.uint8)


def _per_layer(
    name: str,
    phys_shape: tuple[int, ...],
    to_logical: Callable[[torch.Tensor], torch.Tensor],
    phys_block: Callable[[torch.Tensor, int, int], torch.Tensor],
    token_dim: int | None,
    kind: KVLayoutKind | None = None,
    block_size: int | None = None,
) -> Callable[[torch.dtype, torch.device, bool], Case]:
    def build(dtype: torch.dtype, device: torch.device, zero: bool = False) -> Case:
        raws = [_rand(phys_shape, dtype, device, zero) for _ in range(LAYERS)]
        layers = [to_logical(r) for r in raws]
        kv = PagedKV.from_layers(layers, kind=kind, block_size=block_size)
        return Case(name, kv, lambda l, s, b: _b(phys_block(raws[l], s, b)), token_dim, raws)

    return build


def _cross_layer(dtype: torch.dtype, device: torch.device, zero: bool = False) -> Case:
    # vLLM >= 0.32 BLHNC: one raw [B, L, H, T, C] buffer, per-layer [B, H, T, C] views.
    raw = _rand((NUM_BLOCKS, LAYERS, HEADS, TOKENS, 2 * HEAD), dtype, device, zero)
    kv = PagedKV.from_layers([raw[:, l] for l in range(LAYERS)], kind=KVLayoutKind.VLLM_BLOCK_VIEW)
    return Case("vllm_cross_layer", kv, lambda l, s, b: _b(raw[b, l]), 1, [raw])


def _pool(
    name: str,
    shape: Callable[[], tuple[int, ...]],
    layout: str,
    mla: bool,
    phys_block: Callable[[torch.Tensor, int, int, int], torch.Tensor],
    token_dim: int,
) -> Callable[[torch.dtype, torch.device, bool], Case]:
    def build(dtype: torch.dtype, device: torch.device, zero: bool = False) -> Case:
        buf = _rand(shape(), dtype, device, zero)
        kv = PagedKV.from_sglang_host_pool(buf, layout, TOKENS, mla=mla)
        return Case(name, kv, lambda l, s, b: _b(phys_block(buf, l, s, b)), token_dim, [buf])

    return build


B, L, T, H, D = NUM_BLOCKS, LAYERS, TOKENS, HEADS, HEAD
SLOTS = NUM_BLOCKS * TOKENS
MLA_DIM = 24


def _pages(b: int) -> slice:
    return slice(b * T, (b + 1) * T)


BUILDERS: dict[str, Callable[..., Case]] = {
    # vLLM CPU: [B, H, T, 2D]; whole blocks only.
    "vllm_cpu": _per_layer("vllm_cpu", (B, H, T, 2 * D), lambda r: r, lambda r, s, b: r[b], None),
    # vLLM >= 0.32 block views [B, H, T, C]: head-major (LBHNC) and token-major (LBNHC) strides.
    "vllm_view_hnc": _per_layer(
        "vllm_view_hnc",
        (B, H, T, 2 * D),
        lambda r: r,
        lambda r, s, b: r[b],
        1,
        kind=KVLayoutKind.VLLM_BLOCK_VIEW,
    ),
    "vllm_view_nhc": _per_layer(
        "vllm_view_nhc",
        (B, T, H, 2 * D),
        lambda r: r.permute(0, 2, 1, 3),
        lambda r, s, b: r[b],
        0,
        kind=KVLayoutKind.VLLM_BLOCK_VIEW,
    ),
    "vllm_cross_layer": _cross_layer,
    "vllm_mla": _per_layer("vllm_mla", (B, T, 5 * D), lambda r: r, lambda r, s, b: r[b].unsqueeze(1), 0),
    # Flash-attention: K/V first [2, B, T, H, D] (NHD), HND as a strided logical view and as a
    # physical [2, B, H, T, D] tensor (needs block_size).
    "flash_kv_first": _per_layer("flash_kv_first", (2, B, T, H, D), lambda r: r, lambda r, s, b: r[s, b], 0),
    "flash_kv_first_hnd_view": _per_layer(
        "flash_kv_first_hnd_view",
        (2, B, H, T, D),
        lambda r: r.permute(0, 1, 3, 2, 4),
        lambda r, s, b: r[s, b],
        1,
    ),
    "flash_kv_first_hnd": _per_layer(
        "flash_kv_first_hnd", (2, B, H, T, D), lambda r: r, lambda r, s, b: r[s, b], 1, block_size=T
    ),
    "flash_block_first": _per_layer("flash_block_first", (B, 2, T, H, D), lambda r: r, lambda r, s, b: r[b, s], 0),
    "flash_block_first_hnd_view": _per_layer(
        "flash_block_first_hnd_view",
        (B, 2, H, T, D),
        lambda r: r.permute(0, 1, 3, 2, 4),
        lambda r, s, b: r[b, s],
        1,
    ),
    "flash_block_first_hnd": _per_layer(
        "flash_block_first_hnd", (B, 2, H, T, D), lambda r: r, lambda r, s, b: r[b, s], 1, block_size=T
    ),
    # SGLang 0.5.23 host pools (memory_pool_host / pool_host/{mha,mla}.py init_kv_buffer).
    "sglang_mha_layer_first": _pool(
        "sglang_mha_layer_first",
        lambda: (2, L, SLOTS, H, D),
        "layer_first",
        False,
        lambda t, l, s, b: t[s, l, _pages(b)],
        0,
    ),
    "sglang_mha_page_first": _pool(
        "sglang_mha_page_first",
        lambda: (2, SLOTS, L, H, D),
        "page_first",
        False,
        lambda t, l, s, b: t[s, _pages(b), l],
        0,
    ),
    "sglang_mha_page_first_direct": _pool(
        "sglang_mha_page_first_direct",
        lambda: (2, B, L, T, H, D),
        "page_first_direct",
        False,
        lambda t, l, s, b: t[s, b, l],
        0,
    ),
    "sglang_mha_page_head": _pool(
        "sglang_mha_page_head",
        lambda: (2, B, H, T, L, D),
        "page_head",
        False,
        lambda t, l, s, b: t[s, b, :, :, l],
        1,
    ),
    "sglang_mla_layer_first": _pool(
        "sglang_mla_layer_first",
        lambda: (L, SLOTS, 1, MLA_DIM),
        "layer_first",
        True,
        lambda t, l, s, b: t[l, _pages(b)],
        0,
    ),
    "sglang_mla_page_first": _pool(
        "sglang_mla_page_first",
        lambda: (SLOTS, L, 1, MLA_DIM),
        "page_first",
        True,
        lambda t, l, s, b: t[_pages(b), l],
        0,
    ),
    "sglang_mla_page_first_direct": _pool(
        "sglang_mla_page_first_direct",
        lambda: (B, L, T, 1, MLA_DIM),
        "page_first_direct",
        True,
        lambda t, l, s, b: t[b, l],
        0,
    ),
}


def build(name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> Case:
    """Case `name` with random contents."""
    return BUILDERS[name](dtype, torch.device(device))


def expected_staging(
    case: Case, ids: list[int], poison: int, first_offset: int = 0, last_count: int | None = None
) -> torch.Tensor:
    """Staging bytes gather must produce, from the hand-written phys views (CPU tensor)."""
    lay = case.kv.layout
    n = len(ids)
    out = torch.full((n * lay.slot_bytes,), poison, dtype=torch.uint8)
    slots = out.view(n, lay.num_layers, lay.num_segments, lay.outer.count, lay.inner.count, lay.row_bytes)
    for i, b in enumerate(ids):
        t0, t1 = token_range(case, i, n, first_offset, last_count)
        for l in range(lay.num_layers):
            for s in range(lay.num_segments):
                src = tokens(case.phys(l, s, b), case.token_dim, t0, t1).cpu()
                tokens(slots[i, l, s], case.token_dim, t0, t1).copy_(src)
    return out


def token_range(case: Case, i: int, n: int, first_offset: int, last_count: int | None) -> tuple[int, int]:
    """Tokens [t0, t1) of block i of n, per the documented partial-block rule."""
    last = TOKENS if last_count is None else last_count
    return (first_offset if i == 0 else 0), (last if i == n - 1 else TOKENS)


def tokens(v: torch.Tensor, token_dim: int | None, t0: int, t1: int) -> torch.Tensor:
    """Tokens [t0, t1) of a [outer, inner, row] view."""
    if token_dim == 0:
        return v[t0:t1]
    if token_dim == 1:
        return v[:, t0:t1]
    assert (t0, t1) == (0, TOKENS)
    return v
