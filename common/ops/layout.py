"""KV cache layouts: which bytes of an engine's paged KV cache make up one block.

A layout is read from the tensors' shapes and strides (never assumed) and reduced
to one small geometry that every copy backend understands (all sizes in bytes):

* each layer has ``num_segments`` segments: 2 where K and V live apart
  (flash-attention and SGLang MHA layouts), 1 where K|V are fused in the row
  (vLLM CPU / vLLM >= 0.32 block views) or for MLA;
* block ``b`` of a segment starts ``b * block_stride`` bytes after the segment's
  base address and holds ``outer.count x inner.count`` rows of ``row_bytes``
  contiguous bytes; row ``(a, i)`` sits at ``a * outer.stride + i * inner.stride``.
  ``outer``/``inner`` are the token and head dims in physical (memory) order.

kvpack's staging ("object") layout for n blocks is fixed and dense::

    staging[block_i][layer][segment][outer][inner][row_bytes]      (uint8)

so one block's slot is ``slot_bytes = num_layers * num_segments * segment_bytes``.
The object layout follows the engine's physical order inside a block, so objects
are only interchangeable between caches with equal ``KVLayout.fingerprint()``.

Dimension letters used by the layout specs below:
``K`` K/V pair (size 2), ``B`` block, ``T`` token within a block, ``S`` token slot
across pages (size num_blocks * page_size), ``L`` layer, ``H`` kv head,
``D`` the contiguous row (head_size, 2*head_size or the MLA latent), ``1`` size 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from ..errors import LayoutError


class KVLayoutKind(str, Enum):
    """Known engine layouts, with the shape of one tensor (spec letters above).

    vLLM (one tensor per layer, in ``register_kv_caches`` order):
      VLLM_CPU                  [num_blocks, kv_heads, block_size, 2*head_size]  (BHTD);
                                the order inside a block is ISA dependent, so only
                                whole blocks are copied (no token addressing).
      VLLM_BLOCK_VIEW           [num_blocks, kv_heads, block_size, content]       (BHTD);
                                vLLM >= 0.32 logical view, any stride order (LBHNC,
                                LBNHC, cross-layer BL.. layouts); token addressable.
      VLLM_MLA                  [num_blocks, block_size, head_size]               (BTD)
      VLLM_FLASH_KV_FIRST       [2, num_blocks, block_size, kv_heads, head_size]  (KBTHD)
      VLLM_FLASH_KV_FIRST_HND   [2, num_blocks, kv_heads, block_size, head_size]  (KBHTD)
      VLLM_FLASH_BLOCK_FIRST    [num_blocks, 2, block_size, kv_heads, head_size]  (BKTHD)
      VLLM_FLASH_BLOCK_FIRST_HND [num_blocks, 2, kv_heads, block_size, head_size] (BKHTD)
      (a logical NHD view with HND strides is recognised from its strides.)

    SGLang 0.5.23 host pools (one tensor holding every layer; block = page):
      SGLANG_MHA_LAYER_FIRST        [2, layers, tokens, heads, head_dim]          (KLSHD)
      SGLANG_MHA_PAGE_FIRST         [2, tokens, layers, heads, head_dim]          (KSLHD)
      SGLANG_MHA_PAGE_FIRST_DIRECT  [2, pages, layers, page_size, heads, head_dim] (KBLTHD)
      SGLANG_MHA_PAGE_HEAD          [2, pages, heads, page_size, layers, head_dim] (KBHTLD)
      SGLANG_MLA_LAYER_FIRST        [layers, tokens, 1, kv_cache_dim]             (LS1D)
      SGLANG_MLA_PAGE_FIRST         [tokens, layers, 1, kv_cache_dim]             (SL1D)
      SGLANG_MLA_PAGE_FIRST_DIRECT  [pages, layers, page_size, 1, kv_cache_dim]   (BLT1D)
    """

    VLLM_CPU = "vllm_cpu"
    VLLM_BLOCK_VIEW = "vllm_block_view"
    VLLM_MLA = "vllm_mla"
    VLLM_FLASH_KV_FIRST = "vllm_flash_kv_first"
    VLLM_FLASH_KV_FIRST_HND = "vllm_flash_kv_first_hnd"
    VLLM_FLASH_BLOCK_FIRST = "vllm_flash_block_first"
    VLLM_FLASH_BLOCK_FIRST_HND = "vllm_flash_block_first_hnd"
    SGLANG_MHA_LAYER_FIRST = "sglang_mha_layer_first"
    SGLANG_MHA_PAGE_FIRST = "sglang_mha_page_first"
    SGLANG_MHA_PAGE_FIRST_DIRECT = "sglang_mha_page_first_direct"
    SGLANG_MHA_PAGE_HEAD = "sglang_mha_page_head"
    SGLANG_MLA_LAYER_FIRST = "sglang_mla_layer_first"
    SGLANG_MLA_PAGE_FIRST = "sglang_mla_page_first"
    SGLANG_MLA_PAGE_FIRST_DIRECT = "sglang_mla_page_first_direct"

    @property
    def spec(self) -> str:
        """Dimension letters of one tensor of this kind (see the module docstring)."""
        return _SPECS[self]

    @property
    def is_pool(self) -> bool:
        """True for kinds where one tensor holds every layer (an ``L`` dim)."""
        return "L" in self.spec


_SPECS: dict[KVLayoutKind, str] = {
    KVLayoutKind.VLLM_CPU: "BHTD",
    KVLayoutKind.VLLM_BLOCK_VIEW: "BHTD",
    KVLayoutKind.VLLM_MLA: "BTD",
    KVLayoutKind.VLLM_FLASH_KV_FIRST: "KBTHD",
    KVLayoutKind.VLLM_FLASH_KV_FIRST_HND: "KBHTD",
    KVLayoutKind.VLLM_FLASH_BLOCK_FIRST: "BKTHD",
    KVLayoutKind.VLLM_FLASH_BLOCK_FIRST_HND: "BKHTD",
    KVLayoutKind.SGLANG_MHA_LAYER_FIRST: "KLSHD",
    KVLayoutKind.SGLANG_MHA_PAGE_FIRST: "KSLHD",
    KVLayoutKind.SGLANG_MHA_PAGE_FIRST_DIRECT: "KBLTHD",
    KVLayoutKind.SGLANG_MHA_PAGE_HEAD: "KBHTLD",
    KVLayoutKind.SGLANG_MLA_LAYER_FIRST: "LS1D",
    KVLayoutKind.SGLANG_MLA_PAGE_FIRST: "SL1D",
    KVLayoutKind.SGLANG_MLA_PAGE_FIRST_DIRECT: "BLT1D",
}

#: SGLang ``--hicache-mem-layout`` names -> kinds, keyed by (layout, is_mla).
SGLANG_HOST_LAYOUTS: dict[tuple[str, bool], KVLayoutKind] = {
    ("layer_first", False): KVLayoutKind.SGLANG_MHA_LAYER_FIRST,
    ("page_first", False): KVLayoutKind.SGLANG_MHA_PAGE_FIRST,
    ("page_first_direct", False): KVLayoutKind.SGLANG_MHA_PAGE_FIRST_DIRECT,
    ("page_head", False): KVLayoutKind.SGLANG_MHA_PAGE_HEAD,
    ("layer_first", True): KVLayoutKind.SGLANG_MLA_LAYER_FIRST,
    ("page_first", True): KVLayoutKind.SGLANG_MLA_PAGE_FIRST,
    ("page_first_direct", True): KVLayoutKind.SGLANG_MLA_PAGE_FIRST_DIRECT,
}


@dataclass(frozen=True)
class LoopDim:
    """One of the two row dims inside a block: ``count`` rows, ``stride`` bytes apart."""

    name: str  # "tokens" or "heads"
    count: int
    stride: int


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one block of a paged KV cache, in bytes (see the module docstring).

    Invariants: ``outer.stride >= inner.stride`` unless a count is 1; rows are
    ``row_bytes`` contiguous bytes; ``token_dim`` is 0 (outer is tokens), 1 (inner
    is tokens) or None (whole blocks only, e.g. VLLM_CPU).
    """

    kind: KVLayoutKind
    dtype: torch.dtype
    num_layers: int
    num_blocks: int
    num_segments: int
    block_stride: int
    outer: LoopDim
    inner: LoopDim
    row_bytes: int
    token_dim: int | None

    @property
    def tokens_per_block(self) -> int:
        """Tokens in one block (block_size / page_size)."""
        for d in (self.outer, self.inner):
            if d.name == "tokens":
                return d.count
        raise AssertionError("layout without a token dim")  # construction guarantees one

    @property
    def token_addressable(self) -> bool:
        """Whether a token range inside a block can be copied (else whole blocks only)."""
        return self.token_dim is not None

    @property
    def segment_bytes(self) -> int:
        """Bytes of one (block, layer, segment) in the staging layout."""
        return self.outer.count * self.inner.count * self.row_bytes

    @property
    def slot_bytes(self) -> int:
        """Staging bytes per block: all layers and segments of one block."""
        return self.num_layers * self.num_segments * self.segment_bytes

    def fingerprint(self) -> str:
        """A stable string naming everything that decides the staging bytes."""
        return (
            f"{self.kind.value}:{str(self.dtype).removeprefix('torch.')}:L{self.num_layers}"
            f":S{self.num_segments}:{self.outer.name}{self.outer.count}"
            f"x{self.inner.name}{self.inner.count}x{self.row_bytes}B"
        )

    def kernel_geometry(self, n_ids: int, first_offset: int, last_count: int) -> list[int]:
        """The block-copy kernels' KvpGeometry (csrc/block_copy_geometry.h) for a call of
        `n_ids` blocks, packed in declaration order (byte strides and counts)."""
        return [
            self.num_layers,
            self.num_segments,
            self.block_stride,
            self.outer.count,
            self.outer.stride,
            self.inner.count,
            self.inner.stride,
            self.row_bytes,
            -1 if self.token_dim is None else self.token_dim,
            first_offset,
            last_count,
            self.num_blocks,
        ]

    def describe(self) -> str:
        """One line for logs and errors."""
        return (
            f"{self.kind.value}: {self.num_layers} layers x {self.num_segments} segments x "
            f"{self.num_blocks} blocks, block = {self.outer.name}[{self.outer.count}] x "
            f"{self.inner.name}[{self.inner.count}] x {self.row_bytes} B "
            f"(slot {self.slot_bytes} B, token addressable: {self.token_addressable})"
        )


@dataclass(frozen=True)
class _Parsed:
    layout: KVLayout
    layer_stride: int  # bytes between layers inside one tensor (pool kinds), else 0
    segment_offsets: tuple[int, ...]  # bytes from a layer's base to each segment


def _shape_error(kind: KVLayoutKind | None, t: torch.Tensor, why: str) -> LayoutError:
    name = kind.value if kind is not None else "any known layout"
    known = ", ".join(f"{k.value} {k.spec}" for k in KVLayoutKind)
    return LayoutError(
        f"kvpack.ops: tensor of shape {tuple(t.shape)}, strides {tuple(t.stride())}, "
        f"dtype {t.dtype} does not match {name}: {why}. Known layouts (dims): {known}"
    )


def _parse(t: torch.Tensor, kind: KVLayoutKind, page_size: int | None, num_layers: int) -> _Parsed:
    """Reads one tensor as `kind`; `num_layers` is used only for per-layer kinds."""
    spec = kind.spec
    if t.dim() != len(spec):
        raise _shape_error(kind, t, f"expected {len(spec)} dims ({spec}), got {t.dim()}")
    es = t.element_size()
    dims = {c: (int(n), int(s) * es) for c, n, s in zip(spec, t.shape, t.stride())}
    if dims["D"][1] != es and dims["D"][0] != 1:
        raise _shape_error(kind, t, "the last dim must be contiguous (stride 1)")
    if min(n for n, _ in dims.values()) <= 0:
        raise _shape_error(kind, t, "empty dimension")
    if "K" in dims and dims["K"][0] != 2:
        raise _shape_error(kind, t, f"the K/V dim must have size 2, got {dims['K'][0]}")
    if "1" in dims and dims["1"][0] != 1:
        raise _shape_error(kind, t, f"expected a size-1 dim, got {dims['1'][0]}")
    row_bytes = dims["D"][0] * es

    if "S" in dims:
        if page_size is None or page_size <= 0:
            raise _shape_error(kind, t, "page_size is required for SGLang host pools")
        slots, slot_stride = dims["S"]
        if slots % page_size:
            raise _shape_error(kind, t, f"{slots} token slots is not a multiple of page_size {page_size}")
        num_blocks, block_stride = slots // page_size, page_size * slot_stride
        tokens = LoopDim("tokens", page_size, slot_stride)
    else:
        num_blocks, block_stride = dims["B"]
        tokens = LoopDim("tokens", *dims["T"])
        if page_size is not None and tokens.count != page_size:
            raise _shape_error(kind, t, f"block size {tokens.count} != expected {page_size}")
    heads = LoopDim("heads", *dims["H"]) if "H" in dims else LoopDim("heads", 1, row_bytes)

    # Physical order: the larger stride is outer; size-1 dims never decide it.
    if heads.count > 1 and tokens.count > 1 and heads.stride > tokens.stride:
        outer, inner, token_dim = heads, tokens, 1
    else:
        outer, inner, token_dim = tokens, heads, 0
    if inner.count == 1:
        inner = LoopDim(inner.name, 1, row_bytes)
    if outer.count == 1:
        outer = LoopDim(outer.name, 1, inner.count * inner.stride)
    if inner.stride < row_bytes or outer.stride < inner.stride * (inner.count - 1) + row_bytes:
        raise _shape_error(kind, t, "rows of one block overlap (strides too small)")

    overlap = rows_overlap(
        ((num_blocks, block_stride), (outer.count, outer.stride), (inner.count, inner.stride)), row_bytes
    )
    if overlap:
        raise _shape_error(kind, t, f"blocks overlap ({overlap})")

    layers = dims["L"][0] if "L" in dims else num_layers
    layout = KVLayout(
        kind=kind,
        dtype=t.dtype,
        num_layers=layers,
        num_blocks=num_blocks,
        num_segments=2 if "K" in dims else 1,
        block_stride=block_stride,
        outer=outer,
        inner=inner,
        row_bytes=row_bytes,
        token_dim=None if kind is KVLayoutKind.VLLM_CPU else token_dim,
    )
    return _Parsed(
        layout=layout,
        layer_stride=dims["L"][1] if "L" in dims else 0,
        segment_offsets=(0, dims["K"][1]) if "K" in dims else (0,),
    )


def rows_overlap(dims: Sequence[tuple[int, int]], row_bytes: int) -> str | None:
    """Whether rows of `row_bytes` bytes at ``sum(i_k * stride_k)`` (``0 <= i_k < count_k`` for
    each ``(count, stride)`` of `dims`, strides >= 0) can share a byte: None when they provably
    cannot, else why not.

    The proof: taken by increasing stride, each dim's stride is at least the extent of
    the rows spanned by the dims before it, so every index tuple starts a disjoint row
    (nested dims in any order; blocks that interleave with heads, vLLM's LHBNC, pass).
    A layout it cannot prove disjoint is refused, never copied."""
    extent = row_bytes
    for count, stride in sorted((d for d in dims if d[0] > 1), key=lambda d: d[1]):
        if stride < extent:
            return f"a stride of {stride} B under an extent of {extent} B"
        extent = (count - 1) * stride + extent
    return None


def vllm_layer_kind(t: torch.Tensor) -> KVLayoutKind:
    """Kind of a vLLM 0.32+ per-layer 4-D ``[B, H, N, C]`` view, from where it lives: on the CPU,
    vLLM's CPU attention packs each block for its ISA, so only whole blocks are copied
    (VLLM_CPU); on any other device (CUDA, XPU, or ``meta`` in a test that registers
    without bytes) the view is token addressable (VLLM_BLOCK_VIEW)."""
    return KVLayoutKind.VLLM_CPU if t.device.type == "cpu" else KVLayoutKind.VLLM_BLOCK_VIEW


def _guess_kind(t: torch.Tensor, block_size: int | None) -> KVLayoutKind:
    """Kind of a per-layer vLLM tensor from its shape (see KVLayoutKind)."""
    shape = tuple(t.shape)
    if t.dim() == 3:
        return KVLayoutKind.VLLM_MLA
    if t.dim() == 4:
        return vllm_layer_kind(t)
    if t.dim() == 5:
        kv_first, block_first = shape[0] == 2, shape[1] == 2
        if kv_first and block_first:
            raise _shape_error(None, t, "both dim 0 and dim 1 have size 2 (K/V dim ambiguous); pass kind=")
        if not (kv_first or block_first):
            raise _shape_error(None, t, "a 5-D KV cache needs a K/V dim of size 2 at dim 0 or 1")
        hnd = block_size is not None and shape[2] != block_size and shape[3] == block_size
        if kv_first:
            return KVLayoutKind.VLLM_FLASH_KV_FIRST_HND if hnd else KVLayoutKind.VLLM_FLASH_KV_FIRST
        return KVLayoutKind.VLLM_FLASH_BLOCK_FIRST_HND if hnd else KVLayoutKind.VLLM_FLASH_BLOCK_FIRST
    raise _shape_error(None, t, f"no known per-layer layout has {t.dim()} dims")


def infer_layer_layout(
    tensors: Sequence[torch.Tensor],
    *,
    kind: KVLayoutKind | None = None,
    block_size: int | None = None,
) -> tuple[KVLayout, tuple[int, ...]]:
    """Layout of a list of per-layer tensors (vLLM), plus each segment's byte offset.

    `kind` overrides the guess from the shape; `block_size` (tokens per block), if
    given, is checked and picks HND for 5-D tensors whose dim 3 is block_size. A
    contiguous 5-D tensor without block_size is read as [.., block_size, heads, D].
    Every layer must have the same shape, strides, dtype and device.
    Raises LayoutError naming the shape and strides when nothing matches.
    """
    if not tensors:
        raise LayoutError("kvpack.ops: no KV cache tensors given")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if (t.shape, t.stride(), t.dtype, t.device) != (first.shape, first.stride(), first.dtype, first.device):
            raise LayoutError(
                f"kvpack.ops: layer {i} has shape {tuple(t.shape)}, strides {tuple(t.stride())}, "
                f"{t.dtype} on {t.device}; layer 0 has {tuple(first.shape)}, {tuple(first.stride())}, "
                f"{first.dtype} on {first.device}: all layers must match"
            )
    kind = kind if kind is not None else _guess_kind(first, block_size)
    if kind.is_pool:
        raise LayoutError(f"kvpack.ops: {kind.value} is a host-pool layout; use PagedKV.from_sglang_host_pool")
    parsed = _parse(first, kind, block_size, num_layers=len(tensors))
    return parsed.layout, parsed.segment_offsets


def parse_pool_layout(
    buffer: torch.Tensor, kind: KVLayoutKind, page_size: int
) -> tuple[KVLayout, int, tuple[int, ...]]:
    """Layout of one all-layer pool tensor: (layout, layer stride in bytes, segment offsets)."""
    if not kind.is_pool:
        raise LayoutError(f"kvpack.ops: {kind.value} is a per-layer layout; use PagedKV.from_layers")
    parsed = _parse(buffer, kind, page_size, num_layers=0)
    return parsed.layout, parsed.layer_stride, parsed.segment_offsets


def check_in_bounds(t: torch.Tensor, layout: KVLayout, segment_addresses: Sequence[int]) -> None:
    """Raises LayoutError if any byte the layout addresses lies outside t's storage."""
    storage = t.untyped_storage()
    lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    last_row = (
        (layout.num_blocks - 1) * layout.block_stride
        + (layout.outer.count - 1) * layout.outer.stride
        + (layout.inner.count - 1) * layout.inner.stride
        + layout.row_bytes
    )
    for addr in segment_addresses:
        if addr < lo or addr + last_row > hi:
            raise LayoutError(
                f"kvpack.ops: {layout.describe()} addresses bytes outside the tensor's storage "
                f"(shape {tuple(t.shape)}, strides {tuple(t.stride())})"
            )


def vector_alignment(*values: int) -> int:
    """Largest power of two <= 16 dividing every value (0 divides by anything)."""
    g = 0
    for v in values:
        g = math.gcd(g, v)
    if g == 0:
        return 16
    return min(16, g & -g)
