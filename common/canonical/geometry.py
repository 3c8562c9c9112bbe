"""Canonical KV objects: one chunk of every layer in one engine-neutral byte layout.

An object holds, for one chunk of ``tokens`` tokens and a range of KV heads::

    object[layer][kv][head][token][dim]      kv: K then V (MLA: the latent only)

elements in the model's KV dtype (``elem_bytes`` each, the bytes as the engine
stores them). The same bytes come out of vLLM's CPU packings (`vec`, `vec16`,
`amx`), vLLM's ``[B, H, N, C]`` block views in any of their six stride orders
(`from_block_views`; GPU backends and MLA), and SGLang's host pools, so an
object written by one is read by another; a writer at TP=t stores its own heads,
a reader at TP=r copies the heads it holds out of whichever objects cover them
(`CanonicalGeometry.copy`'s ``obj_h0``/``cache_h0``).

Engine side (`TilePacking`): head h of block b of layer l's K (or V) starts at
``base[l][kv] + b * block_stride + h * head_stride``; inside that tile, tokens and
dims are each split in two levels with their own strides. Row-major tiles (GPU,
SGLang, vLLM CPU V) copy a run per token; panel tiles (vLLM CPU K: ``vec`` packs
[D][T], ``amx`` [T/16][D/2][16][2]) are transposed in SIMD blocks; any other
split (vLLM CPU V under ``amx``, [D/16][T/2][16][2]) element by element. The
conversion happens inside the copy: no second pass over the bytes.

Backends: the C++ kernel (csrc/canonical_copy_cpu.cpp) for caches on the CPU, the
CUDA kernel (csrc/canonical_copy.cu, one launch for all layers, K/V and heads) for
caches on a GPU when the extension was built with it, the pure-torch path
(`_torch_copy`) everywhere else (no compiler, a torch without CUDA headers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import LayoutError
from ..identity.heads import HeadRange
from ..ops import load_extension
from ..ops.layout import KVLayoutKind, vector_alignment
from ..ops.paged import PagedKV
from ..ops.scratch import on_cache_device
from ..ops.simd import CpuSimd
from .addressed import address_runs, bytes_at
from .vllm_views import ViewContent, map_block_views

CANONICAL_FORMAT = 1
"""Version of the object layout above; in every canonical group fingerprint."""


def cpu_simd() -> CpuSimd | None:
    """The level the C++ canonical copy uses on this CPU; None without the extension."""
    if not load_extension().available:
        return None
    return CpuSimd(int(torch.ops.kvpack.cpu_simd()))


@dataclass(frozen=True)
class TilePacking:
    """Where element (t, d) of one head's K (or V) tile of a block sits, in bytes from the
    tile's start: ``(t // tg) * t_outer + (t % tg) * t_inner + (d // dg) * d_outer + (d % dg) * d_inner``.

    Invariants: ``tg`` divides the block's tokens and ``dg`` the head dim."""

    tg: int
    t_inner: int
    t_outer: int
    dg: int
    d_inner: int
    d_outer: int

    @classmethod
    def row_major(cls, token_stride: int, head_dim: int, elem_bytes: int, tokens: int) -> TilePacking:
        """Tokens `token_stride` bytes apart, each a run of `head_dim` elements."""
        return cls(tokens, token_stride, 0, head_dim, elem_bytes, 0)

    @classmethod
    def panels(cls, pack: int, group: int, head_dim: int, elem_bytes: int) -> TilePacking:
        """``[tokens / group][head_dim / pack][group][pack]`` densely (vLLM CPU K: ``vec`` is
        pack 1 in one group of all tokens, ``amx`` pack 2 in groups of 16)."""
        unit = pack * elem_bytes
        return cls(group, unit, group * head_dim * elem_bytes, pack, elem_bytes, group * unit)

    @classmethod
    def token_pairs(cls, pair: int, dims: int, tokens: int, elem_bytes: int) -> TilePacking:
        """``[head_dim / dims][tokens / pair][dims][pair]`` densely (vLLM CPU V under ``amx``:
        pair 2, dims 16)."""
        return cls(pair, elem_bytes, dims * pair * elem_bytes, dims, pair * elem_bytes, tokens * dims * elem_bytes)

    def fields(self) -> list[int]:
        return [self.tg, self.t_inner, self.t_outer, self.dg, self.d_inner, self.d_outer]


@dataclass(frozen=True, eq=False)
class CanonicalGeometry:
    """One engine cache (a run of equal layers) seen as canonical objects.

    Invariants: ``len(bases) == num_layers * len(packing)``, in (layer, kv) order;
    every address lies in ``tensors`` (which keep the memory alive); the cache holds
    ``heads`` KV heads of ``head_dim`` elements per block.
    """

    tensors: tuple[torch.Tensor, ...]
    bases: tuple[int, ...]
    num_blocks: int
    block_stride: int
    head_stride: int
    heads: int
    tokens: int
    head_dim: int
    elem_bytes: int
    packing: tuple[TilePacking, ...]
    """One per kv (K, V), or one for MLA."""

    @classmethod
    def from_block_views(
        cls, tensors: Sequence[torch.Tensor], num_blocks: int, *, heads: int, head_size: int, head_size_v: int
    ) -> CanonicalGeometry:
        """vLLM's per-layer ``[B, H, N, C]`` views (0.32+, any of the six stride orders, kernel-block
        splits) of `heads` KV heads whose cell is K (`head_size`) then V (`head_size_v`; 0: one
        MLA latent), addressed by `num_blocks` blocks (`kvpack.canonical.vllm_views`). Raises
        LayoutError naming the stride order and the content when they are not that."""
        m = map_block_views(tensors, ViewContent(heads, head_size, head_size_v), num_blocks)
        rows = TilePacking(m.kernel_tokens, m.token_stride, m.kernel_stride, m.head_dim, m.elem_bytes, 0)
        return cls(
            tuple(tensors),
            m.bases,
            num_blocks,
            m.block_stride,
            m.head_stride,
            m.heads,
            m.tokens,
            m.head_dim,
            m.elem_bytes,
            (rows,) * m.num_kv,
        )

    @property
    def num_layers(self) -> int:
        return len(self.bases) // len(self.packing)

    @property
    def num_kv(self) -> int:
        return len(self.packing)

    def object_bytes(self, heads: int) -> int:
        """Bytes of one object holding `heads` KV heads."""
        return self.num_layers * self.num_kv * heads * self.tokens * self.head_dim * self.elem_bytes

    def describe(self) -> str:
        """What decides the object bytes besides dtype and heads (for fingerprints and logs)."""
        return (
            f"canon{CANONICAL_FORMAT}:L{self.num_layers}:kv{self.num_kv}:T{self.tokens}"
            f":D{self.head_dim}:E{self.elem_bytes}"
        )

    def copy(
        self,
        block_ids: Sequence[int],
        staging: torch.Tensor,
        *,
        gather: bool,
        obj_heads: int,
        obj_h0: int = 0,
        cache_h0: int = 0,
        n_heads: int | None = None,
        use_kernel: bool | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Blocks <-> objects: object i (``staging`` row i, `object_bytes(obj_heads)` bytes)
        is block ``block_ids[i]``; heads ``[obj_h0, obj_h0 + n_heads)`` of the object are
        heads ``[cache_h0, cache_h0 + n_heads)`` of the cache. Other object bytes are left
        as they are. `use_kernel` forces (True) or forbids (False) the C++ kernel.

        On a GPU everything runs on `stream` (default: the current stream), asynchronously:
        the base table is uploaded once per device and cached, the block ids go through
        pinned memory with ``non_blocking`` (no host stall behind queued work)."""
        n = obj_heads - obj_h0 if n_heads is None else n_heads
        if not (0 <= obj_h0 and n > 0 and obj_h0 + n <= obj_heads and 0 <= cache_h0 and cache_h0 + n <= self.heads):
            raise ValueError(
                f"kvpack.ops: heads [{obj_h0}, {obj_h0 + n}) of a {obj_heads}-head object do not map onto "
                f"cache heads [{cache_h0}, {cache_h0 + n}) of {self.heads}"
            )
        ids = [int(b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise IndexError(f"kvpack.ops: block ids {bad[:8]} outside [0, {self.num_blocks})")
        need = len(ids) * self.object_bytes(obj_heads)
        if staging.dtype != torch.uint8 or not staging.is_contiguous() or staging.numel() < need:
            raise ValueError(f"kvpack.ops: staging must be contiguous uint8 of >= {need} bytes")
        if not ids:
            return
        kernel = use_kernel if use_kernel is not None else self._kernel_usable(staging)
        device = self.tensors[0].device
        if device.type != "cuda":
            if kernel:
                self._kernel(ids, staging, gather, (obj_heads, obj_h0, cache_h0, n), 0)
            else:
                _torch_copy(self, ids, staging, gather, obj_heads, obj_h0, cache_h0, n)
            return
        with torch.cuda.device(device):
            s = stream if stream is not None else torch.cuda.current_stream(device)
            with torch.cuda.stream(s):
                if kernel:
                    self._kernel(ids, staging, gather, (obj_heads, obj_h0, cache_h0, n), int(s.cuda_stream))
                    return
                need, some_heads = len(ids) * self.object_bytes(obj_heads), n != obj_heads
                with on_cache_device(staging, need, device, gather=gather, keep=some_heads) as rows:
                    _torch_copy(self, ids, rows, gather, obj_heads, obj_h0, cache_h0, n)

    def copy_at(
        self,
        block_ids: Sequence[int],
        addrs: Sequence[int],
        *,
        gather: bool,
        use_kernel: bool | None = None,
        simd: CpuSimd = CpuSimd.AVX512,
        threads: int = 1,
    ) -> CpuSimd | None:
        """Blocks <-> objects of all the cache's heads (`object_bytes(heads)` each), object i
        at host address ``addrs[i]`` (a tier's slots: anywhere, in any order; objects must not
        overlap, and the memory stays valid until this returns): one kernel call over the
        batch at SIMD level <= `simd` (the GIL released once inside it; the batch cut into
        `threads` pieces, one native thread each, the caller's included) for a CPU cache
        with the extension, else one `copy` per run of objects back to back (`address_runs`),
        on this thread. Returns the SIMD level the kernel used, or None when it copied by runs."""
        ids = [int(b) for b in block_ids]
        if len(addrs) != len(ids):
            raise ValueError(f"kvpack.ops: {len(addrs)} object addresses for {len(ids)} blocks")
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise IndexError(f"kvpack.ops: block ids {bad[:8]} outside [0, {self.num_blocks})")
        status, on_cpu = load_extension(), self.tensors[0].device.type == "cpu"
        kernel = use_kernel if use_kernel is not None else status.available and on_cpu
        if kernel and not (status.available and on_cpu):
            raise RuntimeError(f"kvpack.ops: the per-address copy runs on CPU caches with the kernel ({status.reason})")
        if not ids or not kernel:
            size = self.object_bytes(self.heads)
            for run_ids, low in address_runs(ids, addrs, size):
                rows = bytes_at(low, size * len(run_ids))
                self.copy(run_ids, rows, gather=gather, obj_heads=self.heads, use_kernel=use_kernel)
            return None
        fields = self._fields(self.heads, 0, 0, self.heads)
        index = torch.tensor(ids, dtype=torch.int64)
        where = torch.tensor(addrs, dtype=torch.int64)
        table = self._table(self.tensors[0].device)
        level = torch.ops.kvpack.canonical_copy_at(
            list(self.tensors), table, index, where, fields, int(simd), gather, max(1, threads)
        )
        return CpuSimd(int(level))

    def _kernel(self, ids: list[int], staging: torch.Tensor, gather: bool, heads: tuple[int, ...], raw: int) -> None:
        status = load_extension()
        device = self.tensors[0].device
        if not status.available or (device.type == "cuda" and not status.has_cuda):
            raise RuntimeError(f"kvpack.ops: the {device.type} kernel is unavailable ({status.reason})")
        fields = self._fields(*heads)
        if device.type != "cuda":
            table = self._table(device)
            index = torch.tensor(ids, dtype=torch.int64)
            torch.ops.kvpack.canonical_copy(list(self.tensors), table, index, staging, fields, 16, 0, gather)
            return
        index = _upload_ids(ids, device)
        table = self._table(device)
        torch.ops.kvpack.canonical_copy(
            list(self.tensors), table, index, staging, fields, self.ptr_alignment(), raw, gather
        )

    def _table(self, device: torch.device) -> torch.Tensor:
        """The segment base table on `device`: uploaded once (synchronously), then cached."""
        cache: dict[str, torch.Tensor] = self.__dict__.setdefault("_tables", {})
        key = str(device)
        table = cache.get(key)
        if table is None:
            table = torch.tensor(self.bases, dtype=torch.int64).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # once: later launches on any stream may read it
            cache[key] = table
        return table

    def scatter_heads(
        self,
        block_ids: Sequence[int],
        src: torch.Tensor,
        stored: HeadRange,
        part: HeadRange,
        own: HeadRange,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Rows of `src`, objects of the model's heads `stored`: their heads `part` (inside
        `stored` and `own`) into the blocks of a cache that holds the heads `own`."""
        self.copy(
            block_ids,
            src.contiguous().view(-1),
            gather=False,
            obj_heads=stored.size,
            obj_h0=part.start - stored.start,
            cache_h0=part.start - own.start,
            n_heads=part.size,
            stream=stream,
        )

    def copy_at_simd(
        self, block_ids: Sequence[int], staging: torch.Tensor, *, gather: bool, obj_heads: int, simd: CpuSimd
    ) -> CpuSimd:
        """Test aid: the C++ copy of all heads of a CPU cache at SIMD level <= `simd`, so one
        CPU checks every level it has. Returns the level used."""
        status = load_extension()
        if not status.available:
            raise RuntimeError(f"kvpack.ops: the cpu kernel is unavailable ({status.reason})")
        fields = self._fields(obj_heads, 0, 0, obj_heads)
        table = torch.tensor(self.bases, dtype=torch.int64)
        index = torch.tensor([int(b) for b in block_ids], dtype=torch.int64)
        return CpuSimd(
            int(
                torch.ops.kvpack.canonical_copy_simd(
                    list(self.tensors), table, index, staging, fields, int(simd), gather
                )
            )
        )

    def ptr_alignment(self) -> int:
        """The largest power of two (<= 16) dividing every segment base address."""
        return vector_alignment(*self.bases)

    def _kernel_usable(self, staging: torch.Tensor) -> bool:
        """CPU cache: the C++ kernel. GPU cache: the CUDA kernel when built and the objects are
        on the GPU or pinned (the device reads them); unpinned host objects take the torch path."""
        status = load_extension()
        device = self.tensors[0].device.type
        if device == "cuda":
            return status.available and status.has_cuda and (staging.is_cuda or staging.is_pinned())
        return status.available and device == "cpu"

    def _fields(self, obj_heads: int, obj_h0: int, cache_h0: int, n: int) -> list[int]:
        """KvpCanonGeometry (csrc/canonical_copy.h) in declaration order."""
        k = self.packing[0]
        v = self.packing[-1]
        head = [
            self.num_layers,
            self.num_kv,
            self.block_stride,
            self.head_stride,
            self.tokens,
            self.head_dim,
            self.elem_bytes,
        ]
        return head + k.fields() + v.fields() + [obj_heads, obj_h0, cache_h0, n, self.num_blocks]


def _elem_view(geo: CanonicalGeometry, layer: int, kv: int) -> torch.Tensor:
    """Strided element view of one (layer, kv): ``[blocks, heads, T/tg, tg, D/dg, dg]``."""
    owner = geo.tensors[0] if len(geo.tensors) == 1 else geo.tensors[layer]
    storage = owner.untyped_storage()
    e = geo.elem_bytes
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[e]
    flat = torch.empty(0, dtype=torch.uint8, device=owner.device).set_(storage)
    flat = flat[: storage.nbytes() - storage.nbytes() % e].view(word)
    pk = geo.packing[kv]
    base = geo.bases[layer * geo.num_kv + kv] - storage.data_ptr()
    for value in (base, geo.block_stride, geo.head_stride, pk.t_inner, pk.t_outer, pk.d_inner, pk.d_outer):
        if value % e:
            raise LayoutError(f"kvpack.ops: canonical view needs element-aligned strides, got {value} B")
    view = flat.as_strided(
        (geo.num_blocks, geo.heads, geo.tokens // pk.tg, pk.tg, geo.head_dim // pk.dg, pk.dg),
        (
            geo.block_stride // e,
            geo.head_stride // e,
            pk.t_outer // e,
            pk.t_inner // e,
            pk.d_outer // e,
            pk.d_inner // e,
        ),
        base // e,
    )
    return view  # [blocks, heads, token groups, tokens in group, dim groups, dims in group]


def _torch_copy(
    geo: CanonicalGeometry,
    ids: list[int],
    staging: torch.Tensor,
    gather: bool,
    obj_heads: int,
    obj_h0: int,
    cache_h0: int,
    n: int,
) -> None:
    """The reference: same bytes as the kernel, by strided views (any device)."""
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[geo.elem_bytes]
    objs = staging[: len(ids) * geo.object_bytes(obj_heads)].view(word)
    objs = objs.view(len(ids), geo.num_layers, geo.num_kv, obj_heads, geo.tokens, geo.head_dim)
    device = geo.tensors[0].device
    index = _upload_ids(ids, device) if device.type == "cuda" else torch.tensor(ids, dtype=torch.int64)
    for layer in range(geo.num_layers):
        for kv in range(geo.num_kv):
            view = _elem_view(geo, layer, kv)[:, cache_h0 : cache_h0 + n]
            pk = geo.packing[kv]
            shape = (len(ids), n, geo.tokens // pk.tg, pk.tg, geo.head_dim // pk.dg, pk.dg)
            dst = objs[:, layer, kv, obj_h0 : obj_h0 + n]
            if gather:
                dst.copy_(view[index].reshape(len(ids), n, geo.tokens, geo.head_dim).to(dst.device))
            else:  # one indexed write through the strided view (repeated ids: unspecified winner)
                view.index_put_((index,), dst.to(view.device).reshape(shape))


def _upload_ids(ids: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on a CUDA `device`: pinned host copy, non-blocking on the current stream
    (torch keeps the pinned buffer until that copy completed)."""
    return torch.tensor(ids, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


def vllm_cpu_geometry(tensors: Sequence[torch.Tensor], k: TilePacking, v: TilePacking) -> CanonicalGeometry:
    """vLLM's CPU cache, one ``[num_blocks, kv_heads, block_size, 2 * head_size]`` tensor per
    layer (K in the first half of each head's block, V in the second), with the packings
    `k` and `v` its attention ISA writes (`vllm_plugin.packing` finds them)."""
    first = tensors[0]
    if first.dim() != 4 or first.device.type != "cpu":
        raise LayoutError(f"kvpack.ops: not a vLLM CPU KV cache: shape {tuple(first.shape)} on {first.device}")
    nb, heads, tokens, two_d = (int(x) for x in first.shape)
    if two_d % 2 or not first.is_contiguous():
        raise LayoutError(
            f"kvpack.ops: vLLM CPU KV cache {tuple(first.shape)} must be contiguous with an even last dim"
        )
    for t in tensors:
        if (t.shape, t.stride(), t.dtype) != (first.shape, first.stride(), first.dtype):
            raise LayoutError("kvpack.ops: every layer of a run must have the same shape, strides and dtype")
    e = first.element_size()
    d = two_d // 2
    tile = tokens * d * e
    bases = tuple(a for t in tensors for a in (t.data_ptr(), t.data_ptr() + tile))
    return CanonicalGeometry(tuple(tensors), bases, nb, heads * 2 * tile, 2 * tile, heads, tokens, d, e, (k, v))


def paged_geometry(paged: PagedKV) -> CanonicalGeometry:
    """A token-addressable `PagedKV` (vLLM's 5-D NHD/HND layouts, SGLang host pools, MLA): row-major
    tiles. vLLM 0.32+'s 4-D block views need the cache spec to tell K from V inside a cell:
    `CanonicalGeometry.from_block_views`."""
    lay = paged.layout
    if lay.token_dim is None or lay.kind is KVLayoutKind.VLLM_BLOCK_VIEW:
        raise LayoutError(
            f"kvpack.ops: {lay.kind.value} has no canonical mapping from its layout alone"
            + (" (use CanonicalGeometry.from_block_views)" if lay.kind is KVLayoutKind.VLLM_BLOCK_VIEW else "")
        )
    tokens_dim, heads_dim = (lay.outer, lay.inner) if lay.outer.name == "tokens" else (lay.inner, lay.outer)
    e = lay.dtype.itemsize
    d = lay.row_bytes // e
    rows = TilePacking.row_major(tokens_dim.stride, d, e, tokens_dim.count)
    return CanonicalGeometry(
        paged.tensors,
        paged.segment_addresses,
        lay.num_blocks,
        lay.block_stride,
        heads_dim.stride,
        heads_dim.count,
        tokens_dim.count,
        d,
        e,
        (rows,) * lay.num_segments,
    )
