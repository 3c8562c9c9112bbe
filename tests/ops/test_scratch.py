"""The torch path moves staging with one non-blocking copy per direction, not one per layer.

On a GPU without kernels (no compiler, a refused build) the torch path copies every
(layer, segment) through a strided view; straight into pinned host staging each of
those was a blocking cross-device copy (issue 27, point 4). `kvpack.ops.scratch`
stages through one device scratch. This machine has no GPU, so the tests force the
bounce on the CPU and record every aten op that touches the staging's memory.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kvcases import build
from torch.utils._python_dispatch import TorchDispatchMode

from kvpack.canonical import paged_geometry
from kvpack.ops import PagedKV
from kvpack.ops._reference import gather_reference, scatter_reference
from kvpack.ops.scratch import on_cache_device


class StagingOps(TorchDispatchMode):
    """Records (op name, non_blocking) of every op reading or writing `staging`'s storage."""

    def __init__(self, staging: torch.Tensor) -> None:
        super().__init__()
        self.ptr = staging.untyped_storage().data_ptr()
        self.ops: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        touched = any(
            isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.untyped_storage().data_ptr() == self.ptr
            for a in (*args, *kwargs.values())
        )
        name = str(func.overloadpacket.__name__)
        if touched and name not in ("view", "slice", "as_strided", "_reshape_alias", "detach", "alias"):
            flag = kwargs.get("non_blocking", args[2] if name == "copy_" and len(args) > 2 else False)
            self.ops.append((name, bool(flag)))
        return func(*args, **kwargs)


def _copies(staging: torch.Tensor, fn: Callable[[], None]) -> list[tuple[str, bool]]:
    with StagingOps(staging) as rec:
        fn()
    return rec.ops


@pytest.mark.parametrize("partial", [False, True], ids=["whole-blocks", "token-range"])
def test_block_gather_through_scratch_is_one_copy_out_and_exact(partial: bool) -> None:
    case = build("flash_kv_first", torch.float32)
    kv = case.kv
    lay = kv.layout
    ids = [4, 1, 7]
    first, last = (1, 3) if partial else (0, lay.tokens_per_block)
    want = torch.randint(0, 256, (len(ids) * lay.slot_bytes,), dtype=torch.uint8)
    staging = want.clone()
    gather_reference(kv, ids, want, first, last)

    def gather() -> None:
        with on_cache_device(staging, staging.numel(), kv.device, gather=True, keep=partial, bounce=True) as rows:
            gather_reference(kv, ids, rows, first, last)

    ops = _copies(staging, gather)
    assert torch.equal(staging, want)  # untouched bytes of a token range kept
    assert ops == [("copy_", True)] * (2 if partial else 1), ops
    # without the scratch the same gather touches the staging once per layer and segment
    assert len(_copies(staging, lambda: gather_reference(kv, ids, staging, first, last))) >= lay.num_layers


def test_block_scatter_through_scratch_is_one_copy_in_and_exact() -> None:
    case = build("flash_kv_first", torch.bfloat16)
    kv = case.kv
    lay = kv.layout
    ids = [2, 8]
    src = torch.randint(0, 256, (len(ids) * lay.slot_bytes,), dtype=torch.uint8)
    want = case.clone_zeroed().kv  # a second cache that the plain torch path scatters into
    scatter_reference(want, ids, src, 0, lay.tokens_per_block)

    def scatter() -> None:
        with on_cache_device(src, src.numel(), kv.device, gather=False, keep=False, bounce=True) as rows:
            scatter_reference(kv, ids, rows, 0, lay.tokens_per_block)

    assert _copies(src, scatter) == [("copy_", True)]
    every = list(range(lay.num_blocks))
    got, expect = (torch.empty(len(every) * lay.slot_bytes, dtype=torch.uint8) for _ in range(2))
    gather_reference(kv, every, got, 0, lay.tokens_per_block)
    gather_reference(want, every, expect, 0, lay.tokens_per_block)
    assert torch.equal(got.view(-1, lay.slot_bytes)[ids], expect.view(-1, lay.slot_bytes)[ids])


def test_canonical_head_subrange_through_scratch_keeps_the_other_heads() -> None:
    cache = torch.randn(2, 6, 4, 4, 8)  # flash [K/V, blocks, tokens, heads, dim]
    geo = paged_geometry(PagedKV.from_layers([cache, cache.clone()]))
    ids = [5, 0]
    need = len(ids) * geo.object_bytes(4)
    want = torch.randint(0, 256, (need,), dtype=torch.uint8)
    staging = want.clone()
    geo.copy(ids, want, gather=True, obj_heads=4, obj_h0=1, cache_h0=2, n_heads=2, use_kernel=False)

    def gather() -> None:
        with on_cache_device(staging, need, cache.device, gather=True, keep=True, bounce=True) as rows:
            geo.copy(ids, rows, gather=True, obj_heads=4, obj_h0=1, cache_h0=2, n_heads=2, use_kernel=False)

    assert _copies(staging, gather) == [("copy_", True), ("copy_", True)]
    assert torch.equal(staging, want)


def test_staging_already_on_the_cache_device_is_used_as_is() -> None:
    staging = torch.zeros(64, dtype=torch.uint8)
    with on_cache_device(staging, 32, staging.device, gather=True, keep=False) as rows:
        assert rows is staging
