"""vLLM's per-layer block views (0.32 and later) as canonical objects.

vLLM allocates one byte buffer and hands a connector one 4-D view per attention layer,
``[B, H, N, C]`` (blocks, KV head slots, tokens, content), in one of six stride orders
(``vllm.v1.kv_cache_layout.KVCacheLayout``: LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC);
every stride is read from the tensor here, none is assumed. A cell ``C`` holds one token
of one head: K then V (``head_size + head_size_v`` elements), or one MLA latent (no V).
With kernel-block splitting (an attention kernel's block smaller than the allocator's),
the view has ``ratio`` kernel blocks per allocator block, ``ratio`` consecutive entries
of ``B`` a constant stride apart: allocator block ``b`` is kernel blocks
``[b * ratio, (b + 1) * ratio)``, its token ``t`` is token ``t % N`` of kernel block
``t // N`` (vLLM's ``group_kernel_blocks``).

`map_block_views` maps that onto canonical tiles (`CanonicalGeometry.from_block_views`):
per layer one base for K (byte 0 of ``C``) and one for V (byte ``head_size * elem`` of ``C``), or one for the latent;
row-major tiles whose tokens are split in two levels (``N`` tokens of a kernel block,
``ratio`` kernel blocks). What it cannot map exactly (content that is not K|V of one
head, K and V of different sizes, a non-contiguous cell) is refused with a LayoutError
that names the stride order and the content, never misread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import LayoutError


@dataclass(frozen=True)
class ViewContent:
    """What one cell ``C`` of a view holds, as the engine's cache spec says (elements).

    Invariants: ``head_size > 0``; ``head_size_v == 0`` means one latent (MLA)."""

    heads: int
    """KV heads the view holds (its ``H``): this rank's heads; 1 for MLA."""
    head_size: int
    """K elements of a cell (MLA: the latent, e.g. 576)."""
    head_size_v: int
    """V elements of a cell after K; 0 for MLA."""

    @property
    def mla(self) -> bool:
        return self.head_size_v == 0

    def describe(self) -> str:
        if self.mla:
            return f"MLA latent of {self.head_size} x {self.heads} head(s)"
        return f"K {self.head_size} + V {self.head_size_v} elements x {self.heads} KV heads"


def stride_order(tensors: Sequence[torch.Tensor]) -> str:
    """The physical order of per-layer ``[B, H, N, C]`` views as vLLM names it (``LBNHC``...),
    read from the strides and the layers' addresses (for errors and logs). Dims of size 1
    and equal strides make several names describe the same bytes; the first in logical
    order wins."""
    first = tensors[0]
    if first.dim() != 4:
        return f"{first.dim()}-D"
    strides = {"B": first.stride(0), "H": first.stride(1), "N": first.stride(2)}
    es = first.element_size()
    bytes_of = {k: v * es for k, v in strides.items()}
    if len(tensors) > 1 and tensors[1].untyped_storage().data_ptr() == first.untyped_storage().data_ptr():
        bytes_of["L"] = abs(tensors[1].data_ptr() - first.data_ptr())
    else:
        bytes_of["L"] = max(bytes_of.values()) * max(1, int(first.shape[0])) + 1  # one layer: outermost
    logical = "LBHN"
    ordered = sorted(logical, key=lambda d: (-bytes_of[d], logical.index(d)))
    return "".join(ordered) + "C"


@dataclass(frozen=True)
class BlockViewMap:
    """Where the canonical tiles of a run of views are (bytes; see `CanonicalGeometry`):
    per layer one base per kv, tiles of ``heads`` heads ``head_stride`` apart, blocks
    ``block_stride`` apart; inside a tile token ``t`` at ``(t // kernel_tokens) *
    kernel_stride + (t % kernel_tokens) * token_stride`` and its ``head_dim`` elements
    contiguous."""

    bases: tuple[int, ...]
    num_kv: int
    block_stride: int
    head_stride: int
    heads: int
    tokens: int
    head_dim: int
    elem_bytes: int
    kernel_tokens: int
    token_stride: int
    kernel_stride: int


def map_block_views(tensors: Sequence[torch.Tensor], content: ViewContent, num_blocks: int) -> BlockViewMap:
    """The tiles of a run of per-layer ``[B, H, N, C]`` views (see the module docstring)
    addressed by `num_blocks` allocator blocks. Raises LayoutError naming the stride order
    and `content` when the views are not that content in a layout kvpack maps exactly."""
    if not tensors:
        raise LayoutError("kvpack: no KV cache views given")
    first = tensors[0]
    order = stride_order(tensors)

    def refuse(why: str) -> LayoutError:
        return LayoutError(
            f"kvpack: vLLM KV cache view {tuple(first.shape)} / strides {tuple(first.stride())} "
            f"({first.dtype}, order {order}) holding {content.describe()}: {why}; kvpack cannot store it "
            "as canonical objects"
        )

    if first.dim() != 4:
        raise refuse("not a 4-D [blocks, heads, tokens, content] view")
    for t in tensors:
        if (t.shape, t.stride(), t.dtype, t.device) != (first.shape, first.stride(), first.dtype, first.device):
            raise refuse("the layers differ in shape, strides, dtype or device")
    nb, heads, tokens, cell = (int(x) for x in first.shape)
    e = first.element_size()
    if int(first.stride(3)) != 1 and cell > 1:
        raise refuse("a cell is not contiguous")
    if heads != content.heads:
        raise refuse(f"H is {heads}, the cache spec holds {content.heads} KV heads per block")
    if cell != content.head_size + content.head_size_v:
        raise refuse(f"C is {cell} elements, not K + V of one head ({content.head_size} + {content.head_size_v})")
    if not content.mla and content.head_size != content.head_size_v:
        raise refuse("K and V differ in size (canonical objects hold equal K and V tiles)")
    if num_blocks <= 0 or nb % num_blocks:
        raise refuse(f"its {nb} kernel blocks are not a whole number per block of {num_blocks}")
    ratio = nb // num_blocks
    kernel_stride, head_stride, token_stride = (int(s) * e for s in first.stride()[:3])
    d = content.head_size
    offsets = (0,) if content.mla else (0, d * e)
    return BlockViewMap(
        bases=tuple(t.data_ptr() + off for t in tensors for off in offsets),
        num_kv=len(offsets),
        block_stride=ratio * kernel_stride,
        head_stride=head_stride,
        heads=heads,
        tokens=ratio * tokens,
        head_dim=d,
        elem_bytes=e,
        kernel_tokens=tokens,
        token_stride=token_stride,
        kernel_stride=kernel_stride if ratio > 1 else 0,
    )
