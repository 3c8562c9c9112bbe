"""Layout inference: known layouts are read from shapes and strides; anything else is a clear error."""

from __future__ import annotations

import pytest
import torch
from kvcases import build

from kvpack.errors import KVPackError
from kvpack.ops import Backend, KVLayoutKind, LayoutError, PagedKV, gather_blocks, scatter_blocks


def test_unknown_rank_names_shape_and_strides() -> None:
    t = torch.zeros(3, 4, 5, 6, 7, 8)
    with pytest.raises(LayoutError) as e:
        PagedKV.from_layers([t])
    msg = str(e.value)
    assert "(3, 4, 5, 6, 7, 8)" in msg and str(t.stride()) in msg and "6 dims" in msg
    assert isinstance(e.value, KVPackError) and isinstance(e.value, ValueError)


def test_five_dims_without_a_kv_dim() -> None:
    with pytest.raises(LayoutError, match=r"K/V dim of size 2"):
        PagedKV.from_layers([torch.zeros(3, 4, 5, 6, 7)])


def test_ambiguous_kv_dim_asks_for_kind() -> None:
    t = torch.zeros(2, 2, 4, 3, 8)
    with pytest.raises(LayoutError, match=r"ambiguous.*kind="):
        PagedKV.from_layers([t])
    kv = PagedKV.from_layers([t], kind=KVLayoutKind.VLLM_FLASH_BLOCK_FIRST)
    assert kv.layout.num_blocks == 2 and kv.layout.num_segments == 2


def test_non_contiguous_rows_rejected() -> None:
    t = torch.zeros(5, 3, 4, 16)[..., ::2]
    with pytest.raises(LayoutError, match=r"last dim must be contiguous"):
        PagedKV.from_layers([t])


def test_overlapping_blocks_rejected() -> None:
    t = torch.zeros(512).as_strided((5, 2, 4, 8), (8, 32, 8, 1))  # blocks 8 elements apart, 64 long
    with pytest.raises(LayoutError, match=r"overlap"):
        PagedKV.from_layers([t], kind=KVLayoutKind.VLLM_BLOCK_VIEW)


def test_layers_must_agree() -> None:
    with pytest.raises(LayoutError, match=r"layer 1 has shape"):
        PagedKV.from_layers([torch.zeros(5, 3, 4, 16), torch.zeros(5, 3, 4, 8)])
    with pytest.raises(LayoutError, match=r"bfloat16"):
        PagedKV.from_layers([torch.zeros(5, 3, 4, 16), torch.zeros(5, 3, 4, 16, dtype=torch.bfloat16)])


def test_block_size_hint_checked() -> None:
    with pytest.raises(LayoutError, match=r"block size 3 != expected 7"):
        PagedKV.from_layers([torch.zeros(2, 5, 3, 4, 8)], block_size=7)


def test_sglang_pool_errors() -> None:
    with pytest.raises(LayoutError, match=r"unknown SGLang MHA host layout 'page_last'"):
        PagedKV.from_sglang_host_pool(torch.zeros(2, 3, 8, 2, 4), "page_last", 4)
    with pytest.raises(LayoutError, match=r"not a multiple of page_size"):
        PagedKV.from_sglang_host_pool(torch.zeros(2, 3, 10, 2, 4), "layer_first", 4)
    with pytest.raises(LayoutError, match=r"expected 6 dims"):
        PagedKV.from_sglang_host_pool(torch.zeros(2, 3, 8, 2, 4), "page_first_direct", 4)
    with pytest.raises(LayoutError, match=r"host-pool layout"):
        PagedKV.from_layers([torch.zeros(2, 3, 8, 2, 4)], kind=KVLayoutKind.SGLANG_MHA_PAGE_FIRST)


def test_vllm_cpu_copies_whole_blocks_only() -> None:
    case = build("vllm_cpu", torch.float32)
    assert not case.kv.layout.token_addressable
    out = torch.empty(2 * case.kv.layout.slot_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"whole blocks only"):
        gather_blocks(case.kv, [1, 2], out, last_token_count=1)


@pytest.mark.parametrize("backend", [Backend.TORCH, Backend.CPP])
def test_bad_arguments(backend: Backend) -> None:
    case = build("flash_kv_first", torch.float16)
    slot = case.kv.layout.slot_bytes
    out = torch.empty(2 * slot, dtype=torch.uint8)
    with pytest.raises(IndexError, match=r"outside \[0, 9\)"):
        gather_blocks(case.kv, [1, 9], out, backend=backend)
    with pytest.raises(IndexError):
        scatter_blocks(case.kv, [-1], out, backend=backend)
    with pytest.raises(ValueError, match=r"need 3 \* |need 3"):
        gather_blocks(case.kv, [1, 2, 3], out, backend=backend)
    with pytest.raises(ValueError, match=r"uint8"):
        gather_blocks(case.kv, [1], torch.empty(slot, dtype=torch.float16), backend=backend)
    with pytest.raises(ValueError, match=r"first_token_offset=2 >= last_token_count=2"):
        gather_blocks(case.kv, [1], out, first_token_offset=2, last_token_count=2, backend=backend)
    with pytest.raises(ValueError, match=r"0 < last_token_count"):
        gather_blocks(case.kv, [1, 2], out, last_token_count=0, backend=backend)


def test_layout_descriptor_values() -> None:
    # [2, B, T, H, D] bf16: K/V segments, tokens outer, heads inner, dense block.
    kv = build("flash_kv_first", torch.bfloat16).kv
    lay = kv.layout
    assert lay.kind is KVLayoutKind.VLLM_FLASH_KV_FIRST
    assert (lay.num_layers, lay.num_blocks, lay.num_segments, lay.tokens_per_block) == (3, 9, 2, 4)
    assert (lay.outer.name, lay.outer.count, lay.outer.stride) == ("tokens", 4, 3 * 8 * 2)
    assert (lay.inner.name, lay.inner.count, lay.inner.stride) == ("heads", 3, 8 * 2)
    assert lay.row_bytes == 16 and lay.block_stride == 4 * 3 * 8 * 2
    assert lay.slot_bytes == 3 * 2 * 4 * 3 * 16
    t = kv.tensors[0]
    assert kv.segment_addresses[:2] == (t.data_ptr(), t.data_ptr() + t.stride(0) * 2)
    assert lay.fingerprint() == "vllm_flash_kv_first:bfloat16:L3:S2:tokens4xheads3x16B"
