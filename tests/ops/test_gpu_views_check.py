"""The GPU check's vllm-views step builds the views vLLM builds: for every stride order, spec
and kernel-block split, `gpu_views_check.build_views` gives the shapes, strides and offsets of
vLLM's own ``create_kv_cache_views`` over the strides vLLM's allocator plans
(``compute_layout_strides``). Needs vLLM (the GPU machine has none: it runs the step only)."""

from __future__ import annotations

import pytest
import torch
from gpu_views_check import ORDERS, ViewCase, build_views, cases

kv_cache_interface = pytest.importorskip("vllm.v1.kv_cache_interface")


def _vllm_views(case: ViewCase) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    block = case.tokens
    if case.head_size_v == 0:
        spec = kv_cache_interface.MLAAttentionSpec(
            block_size=block, num_kv_heads=1, head_size=case.head_size, dtype=case.dtype
        )
    else:
        spec = kv_cache_interface.FullAttentionSpec(
            block_size=block, num_kv_heads=case.heads, head_size=case.head_size, dtype=case.dtype
        )
    layout = KVCacheLayout[case.order]
    layer_stride, block_stride, *_ = kv_cache_interface.compute_layout_strides(spec, case.blocks, case.layers, layout)
    size = spec.page_size_bytes * case.blocks * case.layers
    tensor = kv_cache_interface.KVCacheTensor(
        size=size, layers=[f"l{i}" for i in range(case.layers)], layer_stride=layer_stride, block_stride=block_stride
    )
    raw = torch.zeros(size, dtype=torch.int8, device="meta")
    kernel = case.tokens // case.ratio if case.ratio > 1 else None
    return raw, kv_cache_interface.create_kv_cache_views(raw, spec, case.blocks, layout, tensor, kernel)


@pytest.mark.parametrize("case", cases(quick=False), ids=lambda c: c.name)
def test_the_step_builds_vllms_views(case: ViewCase) -> None:
    raw, want = _vllm_views(case)
    got = build_views(case, raw)
    assert len(got) == len(want) == case.layers
    for g, w in zip(got, want):
        assert (g.shape, g.stride(), g.storage_offset(), g.dtype) == (w.shape, w.stride(), w.storage_offset(), w.dtype)


def test_every_order_is_covered() -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert {o.name: o.value for o in KVCacheLayout} == ORDERS
