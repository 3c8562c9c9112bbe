"""The CUDA kernel's indexing, checked on the CPU.

block_copy.cu cannot run without a GPU, but its address arithmetic lives in
block_copy_geometry.h (kvp_plan, kvp_pick_vec, kvp_word_offsets). The extension's
`emulate_cuda_copy` op walks every unit word by word with those same functions and
fails on any word address that is not a multiple of the chosen word size (a load
the GPU would fault on). Staging buffers at offsets 0/1/4/8 force 16-, 1-, 4- and
8-byte words.
"""

from __future__ import annotations

import random

import pytest
import torch
from kvcases import BUILDERS, NUM_BLOCKS, TOKENS, Case, build, expected_staging, token_range, tokens

from kvpack.ops import load_extension
from kvpack.ops.layout import vector_alignment

POISON = 0xAB

pytestmark = pytest.mark.skipif(
    not load_extension().available, reason=f"extension unavailable: {load_extension().reason}"
)


def _emulate(case: Case, ids: list[int], staging: torch.Tensor, first: int, last: int | None, gather: bool) -> None:
    kv, lay = case.kv, case.kv.layout
    geometry = lay.kernel_geometry(len(ids), first, lay.tokens_per_block if last is None else last)
    torch.ops.kvpack.emulate_cuda_copy(
        list(kv.tensors),
        kv.pointer_table(),
        torch.tensor(ids, dtype=torch.int64),
        staging,
        geometry,
        vector_alignment(kv.address_alignment()),
        gather,
    )


def _offset_staging(n_bytes: int, offset: int) -> torch.Tensor:
    buf = torch.full((n_bytes + 32,), POISON, dtype=torch.uint8)
    return buf[offset : offset + n_bytes]


@pytest.mark.parametrize("offset", [0, 1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("layout", sorted(BUILDERS))
def test_emulated_kernel_gather_and_round_trip(layout: str, dtype: torch.dtype, offset: int) -> None:
    case = build(layout, dtype)
    rng = random.Random(layout + str(offset))
    ids = [rng.randrange(NUM_BLOCKS) for _ in range(4)] + [0]
    runs = [(ids, 0, None)]
    if case.token_dim is not None:
        runs += [(list(dict.fromkeys(ids)), 1, TOKENS - 1), ([ids[0]], 1, 3)]
    for run_ids, first, last in runs:
        staging = _offset_staging(len(run_ids) * case.kv.layout.slot_bytes, offset)
        _emulate(case, run_ids, staging, first, last, gather=True)
        assert torch.equal(staging, expected_staging(case, run_ids, POISON, first, last)), (run_ids, first, last)

        target = case.clone_zeroed()
        _emulate(target, run_ids, staging, first, last, gather=False)
        want = case.clone_zeroed()
        for i, b in enumerate(run_ids):
            t0, t1 = token_range(case, i, len(run_ids), first, last)
            for l in range(case.kv.layout.num_layers):
                for s in range(case.kv.layout.num_segments):
                    tokens(want.phys(l, s, b), want.token_dim, t0, t1).copy_(
                        tokens(case.phys(l, s, b), case.token_dim, t0, t1)
                    )
        for g, w in zip(target.tensors, want.tensors):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


def test_emulation_catches_misaligned_words() -> None:
    """A segment base that breaks the claimed alignment is reported, not silently copied."""
    case = build("flash_kv_first", torch.float32)
    kv, lay = case.kv, case.kv.layout
    staging = torch.empty(lay.slot_bytes, dtype=torch.uint8)
    table = kv.pointer_table().clone()
    table[0] += 4  # claim 16-byte alignment below, but the address is only 4-aligned
    with pytest.raises(RuntimeError, match="misaligned"):
        torch.ops.kvpack.emulate_cuda_copy(
            list(kv.tensors), table, torch.tensor([0]), staging, lay.kernel_geometry(1, 0, TOKENS), 16, True
        )
