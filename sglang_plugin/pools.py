"""One SGLang host pool bound to one kvpack group member, and its page copies.

SGLang describes where a page of a host pool lives with the pool's own buffer
metadata, ``host_pool.get_page_buffer_meta(host_indices)``: for every page, in
the pool's order, ``parts`` (pointer, size) regions. kvpack's object for a
page is those regions concatenated, so every host layout (``layer_first``,
``page_first``, ``page_first_direct``; MHA, MLA, Mamba, indexer...) is
handled by the same code, and the object bytes equal SGLang's zero-copy
order for that pool. Objects are only interchangeable between pools with the
same layout fingerprint (`PoolBinding.member_fingerprint`), which every load
checks.

Pages are handed to the tiers in place, as views of the pool's memory: one
view when a page's regions are one contiguous run (MLA ``page_first``),
else one per region (K and V of MHA ``page_first``; every layer of
``layer_first``); the tiers copy region by region, no staging copy. Views
are slices of one view over the pool's buffer when the regions lie in it
(the usual case: a slice costs a fraction of a ctypes view). No per-token
Python loop anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import (
    CanonicalGeometry,
    HeadRange,
    HeadSplit,
    KVLayoutSpec,
    LayoutError,
    MemberObject,
    MemberRole,
    MemberSpec,
    Payload,
    StoredRange,
    address_of,
    canonical_group_spec,
    checkpoint_kv_heads,
    head_range_fingerprint,
    identify_model,
    member_name,
    paged_geometry,
    split_sources,
)
from ..ops import PagedKV
from .conversion import StagingRows, copy_runs, row_views
from .regions import PageRegions

CANONICAL_HOST_LAYOUTS = frozenset({"layer_first", "page_first", "page_first_direct"})
"""MHA host layouts whose KV pool is stored as canonical objects (`kvpack.canonical`)."""

DRAFT_POOLS = frozenset({"draft", "draft_indexer", "draft_swa"})
"""SGLang pools that hold speculative-decoding draft state (sidecars)."""


def pool_name(name: Any) -> str:
    """The plain string of a PoolName enum member or a string."""
    return str(name.value) if isinstance(name, Enum) else str(name)


def role_of(name: str) -> MemberRole:
    if name == "kv":
        return MemberRole.TARGET
    if name in DRAFT_POOLS:
        return MemberRole.DRAFT
    return MemberRole.STATE


def is_replicated(host_pool: Any, name: str, is_mla_model: bool) -> bool:
    """True when every TP rank holds the same bytes for this pool (MLA KV).

    Replicated pools are written once per DCP shard (``is_storage_writer``)
    and keyed without the TP rank; TP-sharded pools (MHA KV, Mamba state, an
    MHA draft on an MLA target) are keyed per rank.
    """
    try:
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    except Exception:  # pragma: no cover - sglang missing: only MHA pools exist
        return False
    if isinstance(host_pool, MLATokenToKVPoolHost):
        return True
    return name == "kv" and is_mla_model and not hasattr(host_pool, "v_buffer")


def computes_on_host_cpu(host_pool: Any) -> bool:
    """Whether SGLang's forward pass runs on the host's CPU: the device the host pool moves
    pages to and from (``_transfer_device`` of SGLang 0.5.23's MHA pools, from the device
    pool's buffers: ``cuda`` on a GPU server, ``cpu`` on a CPU one). True when the pool does
    not say (the answer that takes no core from the forward pass)."""
    device = getattr(host_pool, "_transfer_device", None)
    kind = getattr(device, "type", device)
    return not isinstance(kind, str) or kind == "cpu"


def _model_dir(model_name: str | None) -> tuple[str, str]:
    """SGLang's ``storage_config.model_name`` as (checkpoint directory or name, format tag):
    ``<name>-<storage_format_tag>`` when the host pool has a page format of its own."""
    name = str(model_name or "")
    if name and not Path(name).is_dir():
        cut = name.rfind("-")
        while cut > 0:
            if Path(name[:cut]).is_dir():
                return name[:cut], name[cut + 1 :]
            cut = name.rfind("-", 0, cut)
    return name, ""


def sglang_kv_heads(model_name: str | None) -> int:
    """The model's KV heads over all TP ranks (`kvpack.checkpoint_kv_heads` of the checkpoint
    SGLang's ``model_name`` names); 0 when it is no local checkpoint or says nothing."""
    base, _tag = _model_dir(model_name)
    return checkpoint_kv_heads(base) if base else 0


def sglang_model_identity(model_name: str | None, model_id: str = "") -> str:
    """The cache identity of SGLang's ``storage_config.model_name`` (`kvpack.identify_model`).

    SGLang gives the served model name (by default the model path), tagged
    ``<name>-<storage_format_tag>`` when the host pool has a page format of its own: the
    core is handed the checkpoint and the tag (``|format=<tag>``, which `model_id` never
    replaces)."""
    base, tag = _model_dir(model_name)
    return identify_model(base, model_id=model_id, page_format=tag).value


def _nothing_after_load(_ok: Sequence[bool], _views: Sequence[memoryview | None]) -> None:
    """In-place loads: the tier wrote straight into the host pool's pages."""


def canonical_kv(name: str, host_pool: Any, par: ParallelInfo, layout_name: str) -> CanonicalGeometry | None:
    """The KV pool as canonical objects, shared with vLLM (`kvpack.canonical`): an MHA pool
    in a `CANONICAL_HOST_LAYOUTS` layout, unquantized, at PP=1, at any TP size whose rank's
    head range is known (`rank_heads`). Anything else (MLA, other pools, a rank of one head
    whose model KV head count is unknown) keeps SGLang's own page bytes. None then."""
    if name != "kv" or par.pp_size != 1 or par.is_mla_model or layout_name not in CANONICAL_HOST_LAYOUTS:
        return None
    buf = getattr(host_pool, "kv_buffer", None)
    if (
        not isinstance(buf, torch.Tensor)
        or buf.device.type != "cpu"
        or buf.dtype not in (torch.float32, torch.float16, torch.bfloat16)
    ):
        return None
    try:
        geo = paged_geometry(
            PagedKV.from_sglang_host_pool(buf, layout_name, int(getattr(host_pool, "page_size", 1) or 1))
        )
    except (LayoutError, ValueError):
        return None
    return geo if rank_heads(geo, par) is not None else None


def rank_heads(geo: CanonicalGeometry, par: ParallelInfo) -> tuple[HeadSplit, HeadRange] | None:
    """The model's KV heads over SGLang's TP ranks and this rank's range (`kvpack.identity.heads`),
    or None when they are not known for sure. A rank holding several heads holds
    ``heads / tp_size`` of them (replication gives every rank exactly one); a rank of one
    head needs the checkpoint's count (`ParallelInfo.kv_heads`): the model may have
    ``tp_size`` heads or fewer, replicated."""
    local = geo.heads
    total = local if par.tp_size == 1 else par.kv_heads or (local * par.tp_size if local > 1 else 0)
    if total <= 0:
        return None
    split = HeadSplit(total, geo.head_dim, par.tp_size)
    try:
        own = split.own(par.tp_rank)
    except ValueError:
        return None
    return (split, own) if own.size == local else None


def canonical_group(host_pool: Any, par: ParallelInfo, layout_name: str) -> KVLayoutSpec | None:
    """The canonical group of the KV pool `host_pool`, or None when it keeps SGLang's bytes."""
    if canonical_kv("kv", host_pool, par, layout_name) is None:
        return None
    dtype = str(getattr(host_pool, "dtype", "unknown"))
    return canonical_group_spec(par.model, dtype, int(getattr(host_pool, "page_size", 1) or 1))


@dataclass(frozen=True)
class ParallelInfo:
    """What of SGLang's HiCacheStorageConfig decides keys and writers."""

    model: str
    """The model's cache identity (`sglang_model_identity`), not its path."""
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dcp_rank: int
    dcp_size: int
    is_mla_model: bool
    is_storage_writer: bool
    kv_heads: int = 0
    """The model's KV heads over all TP ranks (`sglang_kv_heads`; 0: unknown)."""
    model_name: str = ""
    """SGLang's name for the model (its path or hub name): names the fingerprint for operators."""


class PoolBinding:
    """A registered host pool as one member of every page's kvpack group.

    Attributes:
        name: SGLang pool name (``kv``, ``draft``, ``mamba``...).
        member: kvpack member name (pool + shard suffix, e.g. ``kv@1of2``).
        spec: the MemberSpec (role TARGET for kv, DRAFT for draft pools).
        page_size: tokens (slots) per page of this pool.
        part_sizes: byte size of each region of one page, in metadata order.
        page_bytes: one object's payload size.
        writes: False on replicated pools of a rank that is not the storage writer.
    """

    def __init__(self, name: str, host_pool: Any, par: ParallelInfo, layout_name: str, copy_threads: int = 1) -> None:
        self.name = name
        self.host_pool = host_pool
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        probe = torch.arange(self.page_size, dtype=torch.int64)
        ptrs, sizes = host_pool.get_page_buffer_meta(probe)
        if not ptrs or len(ptrs) != len(sizes):
            raise ValueError(f"pool {name}: get_page_buffer_meta gave {len(ptrs)} pointers, {len(sizes)} sizes")
        self.part_sizes = tuple(int(s) for s in sizes)
        self.parts = len(self.part_sizes)
        self.page_bytes = sum(self.part_sizes)
        self.replicated = is_replicated(host_pool, name, par.is_mla_model)
        if self.replicated:
            shard, shards = par.dcp_rank, par.dcp_size
            self.writes = par.is_storage_writer
        else:
            shard, shards = par.tp_rank, par.tp_size
            self.writes = True
        self.member = member_name(name, shard, shards, stage=par.pp_rank, stages=par.pp_size)
        dtype = str(getattr(host_pool, "dtype", "unknown")).removeprefix("torch.")
        extra = {
            "pool": name,
            "class": type(host_pool).__name__,
            "host_layout": str(getattr(host_pool, "layout", "")),
            "replicated": str(self.replicated),
            "shard": f"{shard}/{shards}",
            "dcp": f"{par.dcp_rank}/{par.dcp_size}" if self.replicated else "-",
            "mla_model": str(par.is_mla_model),
        }
        for attr in (
            "layer_num",
            "target_layer_num",
            "head_num",
            "head_dim",
            "v_head_dim",
            "kv_cache_dim",
            "start_layer",
            "end_layer",
        ):
            value = getattr(host_pool, attr, None)
            if isinstance(value, (int, str)):
                extra[attr] = str(value)
        self.layout = KVLayoutSpec(
            engine=f"sglang:{layout_name}",
            model=par.model,
            dtype=dtype,
            chunk_tokens=self.page_size,
            tp_size=par.tp_size,
            pp_size=par.pp_size,
            tp_rank=shard,
            pp_rank=par.pp_rank,
            layer_names=(name,),
            layer_shape=self.part_sizes,
            extra=tuple(sorted(extra.items())),
        )
        self.member_fingerprint = self.layout.member_fingerprint
        self.canonical = canonical_kv(name, host_pool, par, layout_name)
        """The pool as canonical objects (shared with vLLM); None: SGLang's own page bytes."""
        self.sources: tuple[tuple[StoredRange, ...], ...] = ()
        """Canonical pools: per head split a writer at some TP size stores (this pool's own,
        all heads in one object, first), its objects (`kvpack.canonical.split_sources`)."""
        self.own: HeadRange | None = None
        """Canonical pools: the model's KV heads this rank holds (global indices)."""
        if self.canonical is not None:
            geo = self.canonical
            group = canonical_group_spec(par.model, dtype, self.page_size)
            split, own = rank_heads(geo, par)  # type: ignore[misc]  # canonical_kv checked it
            self.own = own
            self.member = split.member(own)
            self.page_bytes = geo.object_bytes(own.size)
            self.layout = group
            self.member_fingerprint = head_range_fingerprint(group, split, own, geo.num_layers)
            self.sources = split_sources(group, split, own, geo.num_layers)
            self.writes = split.writes(par.tp_rank)  # a replicated head is stored by its first rank
        self.spec = MemberSpec(self.member, self.member_fingerprint, role_of(name))
        self.obj = MemberObject(self.member, self.member_fingerprint, self.page_size, self.page_bytes)
        """The pool's object per page, as the session saves and loads it (`kvpack.session`)."""
        self.pages = PageRegions(name, host_pool, self.page_size, self.part_sizes)
        """Page ids, regions and in-place payloads of the pool's pages."""
        self._staging = StagingRows()
        """Canonical pools: the conversion's staging, kept between saves and loads."""
        self.copy_threads = max(1, copy_threads)
        """Canonical pools: threads converting one call's pages, the caller's included (`kvpack.conversion_threads`)."""

    def store_payloads(self, host_indices: torch.Tensor, n_pages: int) -> tuple[list[Payload], Callable[[], None]]:
        """What to store for each page, and what to call once the store returned: in place
        (`page_payloads`; nothing to do after), or canonical objects gathered into staging
        rows (the conversion is the copy), given back after."""
        if self.canonical is None:
            return self.pages.page_payloads(host_indices, n_pages), lambda: None
        staging = self._staging.take(n_pages, self.page_bytes)
        base, size = int(staging.ctypes.data), self.page_bytes
        self._convert(
            self.pages.page_ids(host_indices, n_pages), [base + i * size for i in range(n_pages)], gather=True
        )
        return row_views(staging), lambda: self._staging.give_back(staging)

    def fill_objects(self, host_indices: torch.Tensor, n_pages: int, dsts: Sequence[np.ndarray]) -> None:
        """Canonical pools: page j's object gathered straight into ``dsts[j]`` (a tier's slot
        lent by `kvpack.Session.save_pages` with ``fill``): the conversion is the only copy."""
        geo = self.canonical
        assert geo is not None, "fill_objects is for canonical pools"
        if len(dsts) != n_pages or any(d.nbytes != self.page_bytes for d in dsts):
            raise ValueError(f"pool {self.name}: {len(dsts)} destinations for {n_pages} objects of {self.page_bytes} B")
        self._convert(self.pages.page_ids(host_indices, n_pages), [address_of(d) for d in dsts], gather=True)

    def _convert(self, ids: Sequence[int], addrs: Sequence[int], *, gather: bool) -> None:
        """`copy_runs` on this binding's threads."""
        assert self.canonical is not None
        copy_runs(self.canonical, ids, addrs, gather=gather, threads=self.copy_threads)

    def load_buffers(
        self, host_indices: torch.Tensor, n_pages: int
    ) -> tuple[list[Payload], Callable[[Sequence[bool], Sequence[memoryview | None]], None]]:
        """Where each page's object is read to, and what to call with the per-page results
        and lent views (`kvpack.Session.complete_load` with ``lend``: a page's object read in place
        from a tier, not copied into its row): in place (nothing to do after), or each
        loaded page's object, from its view or its staging row, scattered into the page."""
        if self.canonical is None:
            return self.pages.page_payloads(host_indices, n_pages), _nothing_after_load
        ids = self.pages.page_ids(host_indices, n_pages)
        rows = self._staging.take(n_pages, self.page_bytes)
        base, size = int(rows.ctypes.data), self.page_bytes

        def finish(ok: Sequence[bool], views: Sequence[memoryview | None]) -> None:
            sel: list[int] = []
            addrs: list[int] = []
            for i, (good, view) in enumerate(zip(ok, views)):
                if not good:
                    continue
                if view is None:
                    addrs.append(base + i * size)
                elif view.nbytes != size:
                    raise ValueError(f"pool {self.name}: a lent object is not {size} B")
                else:
                    addrs.append(address_of(view))
                sel.append(ids[i])
            self._convert(sel, addrs, gather=False)
            self._staging.give_back(rows)

        return row_views(rows), finish

    def range_load_buffers(
        self, host_indices: torch.Tensor, n_pages: int, obj: StoredRange
    ) -> tuple[list[Payload], Callable[[Sequence[bool], Sequence[memoryview | None]], None]]:
        """`load_buffers` for objects of the head range `obj.heads` (a writer at another TP
        size): rows of its size (a lent view is copied into its row first); the heads
        `obj.part` this rank holds are scattered into the pages that loaded."""
        geo, own = self.canonical, self.own
        assert geo is not None and own is not None
        ids = self.pages.page_ids(host_indices, n_pages)
        rows = self._staging.take(n_pages, geo.object_bytes(obj.heads.size))

        def finish(ok: Sequence[bool], views: Sequence[memoryview | None]) -> None:
            sel = [i for i, good in enumerate(ok) if good]
            for i in sel:
                view = views[i]
                if view is not None:
                    rows[i] = np.frombuffer(view, dtype=np.uint8)
            if sel:
                geo.scatter_heads([ids[i] for i in sel], torch.from_numpy(rows[sel]), obj.heads, obj.part, own)
            self._staging.give_back(rows)

        return row_views(rows), finish
