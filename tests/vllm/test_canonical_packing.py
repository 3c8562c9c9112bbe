"""vLLM's CPU block packings, as vLLM's own write kernel produces them, become canonical objects.

For every CPU attention ISA this host can run (`vec`, `vec16`, and `amx` on AMX hosts),
random K/V for several blocks are written with vLLM's ``cpu_attn_reshape_and_cache`` (the
op the attention layers call), then gathered with kvpack's canonical copy: the objects
must be exactly those K/V values as ``[layer][kv][head][token][dim]``, and scattering
them into an empty cache must give vLLM's bytes back. A packing kvpack does not know is
refused at start-up (`find_packing` -> None), never misread.
"""

from __future__ import annotations

import pytest
import torch

from kvpack.cpu_features import host_has_amx
from kvpack.vllm_plugin.packing import find_packing

pytestmark = pytest.mark.vllm

CASES = [
    pytest.param(torch.float32, 32, 64, "vec", id="vec-fp32"),
    pytest.param(torch.bfloat16, 32, 64, "vec", id="vec-bf16"),
    pytest.param(torch.float32, 16, 64, "vec16", id="vec16-fp32"),
    pytest.param(torch.float32, 128, 128, "vec", id="vec-fp32-block128"),
    pytest.param(
        torch.bfloat16, 32, 64, "amx", id="amx-bf16", marks=pytest.mark.skipif(not host_has_amx(), reason="needs AMX")
    ),
    pytest.param(
        torch.bfloat16,
        128,
        128,
        "amx",
        id="amx-bf16-block128",
        marks=pytest.mark.skipif(not host_has_amx(), reason="needs AMX"),
    ),
]


@pytest.mark.parametrize(("dtype", "block", "head", "isa"), CASES)
def test_vllm_written_blocks_gather_to_their_kv_values(dtype: torch.dtype, block: int, head: int, isa: str) -> None:
    from kvpack.canonical import vllm_cpu_geometry
    from vllm import _custom_ops as ops

    packing = find_packing(dtype, block, head, isa)
    assert packing is not None
    heads, blocks, layers = 2, 6, 2
    ids = [4, 1, 5]
    g = torch.Generator().manual_seed(7)
    values = torch.randn((len(ids), layers, 2, heads, block, head), generator=g).to(dtype)
    caches = [torch.zeros((blocks, heads, block, 2 * head), dtype=dtype) for _ in range(layers)]
    slots = torch.cat([torch.arange(b * block, (b + 1) * block) for b in ids])
    for layer, cache in enumerate(caches):
        key_cache, value_cache = cache.view(blocks, heads, 2 * block, head).chunk(2, dim=2)
        k = values[:, layer, 0].permute(0, 2, 1, 3).reshape(-1, heads, head)  # [tokens, heads, dim]
        v = values[:, layer, 1].permute(0, 2, 1, 3).reshape(-1, heads, head)
        ops.cpu_attn_reshape_and_cache(
            k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
        )
    geo = vllm_cpu_geometry(caches, *packing)
    out = torch.zeros(len(ids) * geo.object_bytes(heads), dtype=torch.uint8)
    geo.copy(ids, out, gather=True, obj_heads=heads)
    assert torch.equal(out, values.contiguous().view(torch.uint8).view(-1))
    empty = [torch.zeros_like(c) for c in caches]
    vllm_cpu_geometry(empty, *packing).copy(ids, out, gather=False, obj_heads=heads)
    assert all(torch.equal(a, b) for a, b in zip(empty, caches))  # vLLM's bytes, exactly


def test_an_unknown_packing_is_refused() -> None:
    assert find_packing(torch.float32, 32, 64, "no-such-isa") is None
