"""gather_blocks / scatter_blocks: paged KV blocks <-> one contiguous staging buffer.

Three backends, picked per call unless forced: the CUDA kernel (cache on a CUDA
device and the extension built with CUDA), the C++ kernel (cache on the CPU), and
the pure-torch fallback (anything else, e.g. no compiler). All three write the
same bytes: the staging layout of ``kvpack.ops.layout``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from ._build import load_extension
from ._reference import gather_reference, scatter_reference
from .layout import KVLayout, vector_alignment
from .paged import PagedKV, as_paged
from .scratch import on_cache_device


class Backend(str, Enum):
    """Copy implementation."""

    CUDA = "cuda"  # csrc/block_copy.cu, one launch for all layers
    CPP = "cpp"  # csrc/block_copy_cpu.cpp, OpenMP, one memcpy per contiguous run
    TORCH = "torch"  # pure torch (index_select / index_copy_), always available


@dataclass(frozen=True, eq=False)
class UploadedIds:
    """Block ids already on the cache's device (`upload_ids`): a call given these launches
    without a host-to-device copy of its ids (benchmarks time the kernel alone; a caller
    that copies the same blocks again reuses them). `ids` is the host copy (validation)."""

    ids: tuple[int, ...]
    tensor: torch.Tensor


BlockIds = Sequence[int] | torch.Tensor | UploadedIds


def upload_ids(kv: PagedKV | Sequence[torch.Tensor], block_ids: Sequence[int]) -> UploadedIds:
    """`block_ids` as int64 on the cache's device (through pinned memory, non_blocking, on
    the current stream: order the first use after it, or synchronize once)."""
    kv = as_paged(kv)
    ids = tuple(int(b) for b in block_ids)
    t = torch.tensor(ids, dtype=torch.int64)
    if kv.device.type == "cuda":
        t = t.pin_memory().to(kv.device, non_blocking=True)
    return UploadedIds(ids, t)


def staging_bytes_per_block(kv: PagedKV | Sequence[torch.Tensor]) -> int:
    """Bytes one block occupies in a staging buffer (all layers, all segments)."""
    return as_paged(kv).layout.slot_bytes


def select_backend(kv: PagedKV) -> Backend:
    """The backend an unforced call on `kv` uses (builds the extension on first call)."""
    status = load_extension()
    if not status.available:
        return Backend.TORCH
    if kv.device.type == "cuda":
        return Backend.CUDA if status.has_cuda else Backend.TORCH
    return Backend.CPP if kv.device.type == "cpu" else Backend.TORCH


def _block_id_list(block_ids: BlockIds) -> list[int]:
    if isinstance(block_ids, UploadedIds):
        return list(block_ids.ids)
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
            raise ValueError(
                f"kvpack.ops: block_ids must be a 1-D integer tensor, got {block_ids.dtype} {tuple(block_ids.shape)}"
            )
        return list(map(int, block_ids.tolist()))
    return list(map(int, block_ids))


def _validate(
    lay: KVLayout, ids: list[int], staging: torch.Tensor, name: str, first_offset: int, last_count: int | None
) -> int:
    """Checks arguments; returns the effective last_token_count."""
    t = lay.tokens_per_block
    last = t if last_count is None else last_count
    if ids and (min(ids) < 0 or max(ids) >= lay.num_blocks):
        bad = [b for b in ids if b < 0 or b >= lay.num_blocks]
        raise IndexError(f"kvpack.ops: block ids {bad[:8]} outside [0, {lay.num_blocks})")
    if (first_offset, last) != (0, t):
        if not lay.token_addressable:
            raise ValueError(
                f"kvpack.ops: {lay.kind.value} copies whole blocks only "
                f"(got first_token_offset={first_offset}, last_token_count={last_count})"
            )
        if not (0 <= first_offset < t and 0 < last <= t):
            raise ValueError(
                f"kvpack.ops: need 0 <= first_token_offset < {t} and 0 < last_token_count <= {t}, "
                f"got {first_offset}, {last}"
            )
        if len(ids) == 1 and first_offset >= last:
            raise ValueError(f"kvpack.ops: one block with first_token_offset={first_offset} >= last_token_count={last}")
    if staging.dtype != torch.uint8 or not staging.is_contiguous():
        raise ValueError(f"kvpack.ops: {name} must be a contiguous uint8 tensor, got {staging.dtype}")
    need = len(ids) * lay.slot_bytes
    if staging.numel() < need:
        raise ValueError(
            f"kvpack.ops: {name} holds {staging.numel()} bytes, need {need} ({len(ids)} blocks x {lay.slot_bytes} B)"
        )
    return last


@contextlib.contextmanager
def _on_stream(kv: PagedKV, stream: torch.cuda.Stream | None) -> Iterator[int]:
    """Makes the cache's device (and `stream`) current; yields the raw stream handle."""
    if kv.device.type != "cuda":
        yield 0
        return
    with torch.cuda.device(kv.device):
        s = stream if stream is not None else torch.cuda.current_stream(kv.device)
        with torch.cuda.stream(s):
            yield int(s.cuda_stream)


def _run(
    kv: PagedKV | Sequence[torch.Tensor],
    block_ids: BlockIds,
    staging: torch.Tensor,
    first_token_offset: int,
    last_token_count: int | None,
    stream: torch.cuda.Stream | None,
    backend: Backend | None,
    gather: bool,
) -> Backend:
    kv = as_paged(kv)
    lay = kv.layout
    ids = _block_id_list(block_ids)
    last = _validate(lay, ids, staging, "out" if gather else "src", first_token_offset, last_token_count)
    chosen = backend if backend is not None else select_backend(kv)
    if not ids:
        return chosen
    if chosen is not Backend.TORCH:
        status = load_extension()
        if not status.available or (chosen is Backend.CUDA and not status.has_cuda):
            raise RuntimeError(f"kvpack.ops: backend {chosen.value} unavailable ({status.reason})")
        want = "cuda" if chosen is Backend.CUDA else "cpu"
        if kv.device.type != want:
            raise ValueError(f"kvpack.ops: backend {chosen.value} needs the cache on {want}, it is on {kv.device}")
    with _on_stream(kv, stream) as raw_stream:
        if chosen is Backend.TORCH:
            partial = first_token_offset > 0 or last < lay.tokens_per_block
            with on_cache_device(staging, len(ids) * lay.slot_bytes, kv.device, gather=gather, keep=partial) as rows:
                (gather_reference if gather else scatter_reference)(kv, ids, rows, first_token_offset, last)
            return chosen
        op = torch.ops.kvpack.gather_blocks if gather else torch.ops.kvpack.scatter_blocks
        if isinstance(block_ids, UploadedIds):
            ids_t = block_ids.tensor
        else:
            ids_t = torch.tensor(ids, dtype=torch.int64)
            if kv.device.type == "cuda":
                ids_t = ids_t.pin_memory().to(kv.device, non_blocking=True)
        align = vector_alignment(kv.address_alignment(), staging.data_ptr())
        op(
            list(kv.tensors),
            kv.pointer_table(),
            ids_t,
            staging,
            lay.kernel_geometry(len(ids), first_token_offset, last),
            align,
            raw_stream,
        )
    return chosen


def gather_blocks(
    kv: PagedKV | Sequence[torch.Tensor],
    block_ids: BlockIds,
    out: torch.Tensor,
    *,
    first_token_offset: int = 0,
    last_token_count: int | None = None,
    stream: torch.cuda.Stream | None = None,
    backend: Backend | None = None,
) -> Backend:
    """Copies blocks `block_ids` of every layer into `out`; returns the backend used.

    kv:        a PagedKV, or one tensor per layer (layout inferred each call; build a
               PagedKV once instead on hot paths).
    block_ids: n block ids, in [0, num_blocks); any order, repeats allowed.
    out:       contiguous uint8, >= n * staging_bytes_per_block(kv) bytes; on the CPU
               (pinned for the CUDA backend) or on the cache's device. Slot i gets
               block_ids[i] in the layout ``[layer][segment][outer][inner][row]``.
    first_token_offset / last_token_count: copy only tokens [offset, block_size)
               of the first block and [0, count) of the last (one block: [offset,
               count)). Other staging bytes of those slots are left untouched.
               Token-addressable layouts only (not VLLM_CPU).
    stream:    CUDA stream to run on (default: the current stream); the copy is
               asynchronous on CUDA, synchronous on CPU.
    backend:   force a backend (default: select_backend).
    """
    return _run(kv, block_ids, out, first_token_offset, last_token_count, stream, backend, gather=True)


def scatter_blocks(
    kv: PagedKV | Sequence[torch.Tensor],
    block_ids: BlockIds,
    src: torch.Tensor,
    *,
    first_token_offset: int = 0,
    last_token_count: int | None = None,
    stream: torch.cuda.Stream | None = None,
    backend: Backend | None = None,
) -> Backend:
    """The reverse of gather_blocks: slot i of `src` -> block block_ids[i] of every layer.

    Only the addressed bytes of the cache are written. With repeated block ids,
    which slot lands is unspecified unless those slots hold equal bytes.
    """
    return _run(kv, block_ids, src, first_token_offset, last_token_count, stream, backend, gather=False)
