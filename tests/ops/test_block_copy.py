"""gather_blocks / scatter_blocks on every layout, dtype and backend.

The expected bytes come from kvcases' hand-written per-layout views, not from
kvpack.ops' own layout parser, and every staging buffer is poisoned first so an
unwritten (or over-written) byte fails the comparison.
"""

from __future__ import annotations

import random

import pytest
import torch
from kvcases import BUILDERS, DTYPES, NUM_BLOCKS, TOKENS, Case, build, expected_staging, token_range, tokens

from kvpack.ops import Backend, gather_blocks, load_extension, scatter_blocks, staging_bytes_per_block

POISON = 0xAB


def backends() -> list[Backend]:
    out = [Backend.TORCH]
    if load_extension().available:
        out.append(Backend.CPP)
    return out


def devices_for(backend: Backend) -> list[str]:
    if backend is Backend.CPP:
        return ["cpu"]
    if backend is Backend.CUDA:
        return ["cuda"]
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


BACKENDS = backends() + ([Backend.CUDA] if torch.cuda.is_available() and load_extension().has_cuda else [])
PARAMS = [(b, d) for b in BACKENDS for d in devices_for(b)]


def test_cpp_backend_is_built() -> None:
    # With a compiler on this machine the kernel must build; otherwise the fallback is all we test.
    status = load_extension()
    assert status.available, status.reason


def _staging(case: Case, n: int, device: str, pinned: bool = False) -> torch.Tensor:
    nbytes = n * staging_bytes_per_block(case.kv)
    t = torch.full((nbytes,), POISON, dtype=torch.uint8)
    if device == "cuda" and pinned:
        return t.pin_memory()
    return t.to(device)


def _ids(rng: random.Random, n: int) -> list[int]:
    """Unsorted ids with at least one repeat."""
    ids = [rng.randrange(NUM_BLOCKS) for _ in range(n - 1)]
    ids.insert(rng.randrange(n), ids[0])
    return ids


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("layout", sorted(BUILDERS))
@pytest.mark.parametrize("backend,device", PARAMS, ids=lambda p: p.value if isinstance(p, Backend) else p)
def test_gather_whole_blocks(layout: str, dtype: torch.dtype, backend: Backend, device: str) -> None:
    rng = random.Random(hash((layout, str(dtype))))
    case = build(layout, dtype, device)
    ids = _ids(rng, 6)
    for pinned in [False, True] if device == "cuda" else [False]:
        out = _staging(case, len(ids), device, pinned)
        used = gather_blocks(case.kv, ids, out, backend=backend)
        assert used is backend
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(out.cpu(), expected_staging(case, ids, POISON))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", sorted(n for n in BUILDERS if n != "vllm_cpu"))
@pytest.mark.parametrize("backend,device", PARAMS, ids=lambda p: p.value if isinstance(p, Backend) else p)
def test_gather_partial_first_and_last(layout: str, dtype: torch.dtype, backend: Backend, device: str) -> None:
    case = build(layout, dtype, device)
    rng = random.Random(layout)
    for ids, first, last in [
        (_ids(rng, 5), 1, 3),
        (_ids(rng, 2), TOKENS - 1, 1),
        ([rng.randrange(NUM_BLOCKS)], 1, TOKENS - 1),  # one block: tokens [1, T-1)
        ([rng.randrange(NUM_BLOCKS)], 0, 1),
    ]:
        out = _staging(case, len(ids), device)
        gather_blocks(case.kv, ids, out, first_token_offset=first, last_token_count=last, backend=backend)
        assert torch.equal(out.cpu(), expected_staging(case, ids, POISON, first, last)), (ids, first, last)


def _expected_cache(zeroed: Case, source: Case, ids: list[int], first: int, last: int | None) -> list[torch.Tensor]:
    """Bytes of every tensor of `zeroed` after copying `ids` from `source` through phys views."""
    lay = source.kv.layout
    for i, b in enumerate(ids):
        t0, t1 = token_range(source, i, len(ids), first, last)
        for l in range(lay.num_layers):
            for s in range(lay.num_segments):
                tokens(zeroed.phys(l, s, b), zeroed.token_dim, t0, t1).copy_(
                    tokens(source.phys(l, s, b), source.token_dim, t0, t1)
                )
    return [t.cpu().view(torch.uint8).clone() for t in zeroed.tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn], ids=["fp32", "fp16", "fp8"])
@pytest.mark.parametrize("layout", sorted(BUILDERS))
@pytest.mark.parametrize("backend,device", PARAMS, ids=lambda p: p.value if isinstance(p, Backend) else p)
def test_round_trip_into_zeroed_cache(layout: str, dtype: torch.dtype, backend: Backend, device: str) -> None:
    source = build(layout, dtype, device)
    rng = random.Random(layout + "rt")
    ids = _ids(rng, 5)  # repeats hold equal bytes, so the scatter result is defined
    partial = source.token_dim is not None
    uniq = list(dict.fromkeys(ids))
    runs = [(ids, 0, None)] + ([(uniq, 1, TOKENS - 1)] if partial else [])
    for run_ids, first, last in runs:
        staging = _staging(source, len(run_ids), device)
        gather_blocks(source.kv, run_ids, staging, first_token_offset=first, last_token_count=last, backend=backend)
        target = source.clone_zeroed()
        scatter_blocks(target.kv, run_ids, staging, first_token_offset=first, last_token_count=last, backend=backend)
        got = [t.cpu().view(torch.uint8).clone() for t in target.tensors]
        want = _expected_cache(source.clone_zeroed(), source, run_ids, first, last)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (run_ids, first, last)
        # The copy reached the blocks and nothing else: some bytes non-zero, others still zero.
        assert any(bool(g.any()) for g in got)


@pytest.mark.parametrize("layout", ["vllm_cpu", "flash_kv_first", "sglang_mha_page_first"])
def test_cpp_matches_fallback_bytewise(layout: str) -> None:
    if Backend.CPP not in BACKENDS:
        pytest.skip(f"C++ kernel unavailable: {load_extension().reason}")
    case = build(layout, torch.bfloat16)
    ids = _ids(random.Random(7), 7)
    a, b = _staging(case, len(ids), "cpu"), _staging(case, len(ids), "cpu")
    gather_blocks(case.kv, ids, a, backend=Backend.CPP)
    gather_blocks(case.kv, ids, b, backend=Backend.TORCH)
    assert torch.equal(a, b)


def test_list_of_tensors_and_tensor_ids_accepted() -> None:
    case = build("flash_block_first", torch.float16)
    ids = torch.tensor([4, 0, 4, 8])
    out = _staging(case, 4, "cpu")
    gather_blocks(list(case.kv.tensors), ids, out)  # layout inferred from the list
    assert torch.equal(out, expected_staging(case, ids.tolist(), POISON))


def test_empty_block_list_is_a_no_op() -> None:
    case = build("vllm_cpu", torch.float32)
    out = torch.full((4,), POISON, dtype=torch.uint8)
    for backend in BACKENDS:
        gather_blocks(case.kv, [], out, backend=backend)
        scatter_blocks(case.kv, [], out, backend=backend)
    assert bool((out == POISON).all())


@pytest.mark.parametrize("layout", sorted(BUILDERS))
def test_fallback_per_block_path(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback copies big blocks one by one; force that path on these small blocks."""
    from kvpack.ops import _reference

    monkeypatch.setattr(_reference, "_PER_BLOCK_COPY_BYTES", 0)
    case = build(layout, torch.bfloat16)
    ids = _ids(random.Random(layout), 5)
    out = _staging(case, len(ids), "cpu")
    gather_blocks(case.kv, ids, out, backend=Backend.TORCH)
    assert torch.equal(out, expected_staging(case, ids, POISON))
    target = case.clone_zeroed()
    scatter_blocks(target.kv, ids, out, backend=Backend.TORCH)
    want = _expected_cache(case.clone_zeroed(), case, ids, 0, None)
    assert all(torch.equal(t.view(torch.uint8), w) for t, w in zip(target.tensors, want))
