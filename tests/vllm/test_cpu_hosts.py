"""Right on every x86 host: objects are canonical, whatever the CPU attention ISA packs.

vLLM's CPU attention packs each KV block in its ISA's order (`amx` for bf16 on
AMX hosts, `vec` on AVX-512 hosts such as an AMD EPYC, `vec16`...). Measured
before kvpack converted: a block written under `vec` and read under `amx` was
"reused" (699 tokens) and 0 of 12 output tokens were right; then, with the ISA
in the fingerprint, such a block was refused and recomputed. Now the copy
converts every packing to the canonical layout (`kvpack.canonical`), so a
store written on one CPU type is a hit on another.

- Two engines with different attention ISAs on one host (the writer's ISA is
  forced in its own process, as on another CPU): the reader reuses n - 1 tokens
  and answers as its no-cache run (fp32: logprobs within LOGPROB_TOL; bf16 under
  AMX: tokens equal, the split point moves logprobs, see ENGINES.md).
- A fresh multi-process engine whose first request is an n - 1 hit (a 1-token
  step over a restored prefix) runs: on an AMX host that step used to be the
  process's first AMX use, which Linux refuses with SIGILL unless the process
  asked for AMX state (kvpack asks at worker registration).
- The facts that reach the fingerprint of a native object, listed per engine.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm_helpers import (
    close_llm,
    engine_process,
    kv_config,
    make_llm,
    metric,
    prompt,
    run,
    same_output,
    start_engine_process,
)

from kvpack.cpu_features import host_has_amx

pytestmark = pytest.mark.vllm

P = prompt(61, 301)

FORCE_VEC16 = "import vllm.v1.attention.backends.cpu_attn as a; a._get_attn_isa = lambda *args, **kw: 'vec16'"
"""The writer packs blocks as `vec16` (what vLLM picks on a host without 32-wide vectors)."""
HIDE_AMX = "import torch; torch.cpu._is_amx_tile_supported = lambda: False"
"""The writer picks `vec`, as on an AVX-512 host without AMX (an AMD EPYC)."""


@pytest.mark.parametrize(
    ("writer_preamble", "dtype"),
    [
        pytest.param(FORCE_VEC16, "float32", id="writer-vec16-fp32"),
        pytest.param(
            HIDE_AMX,
            "bfloat16",
            id="writer-vec-reader-amx-bf16",
            marks=pytest.mark.skipif(not host_has_amx(), reason="needs an AMX host (the reader's ISA is amx)"),
        ),
    ],
)
def test_blocks_packed_under_another_attention_isa_are_a_hit(
    tiny_llama: Path, tmp_path: Path, writer_preamble: str, dtype: str
) -> None:
    extra = {"disk": {"path": str(tmp_path / "kv")}}
    writer = start_engine_process(
        tiny_llama, extra, {"P": P}, tmp_path / "writer.log", preamble=writer_preamble, dtype=dtype
    )
    try:  # the no-cache run here while the writer runs in its own process
        baseline_llm = make_llm(tiny_llama, dtype=dtype)
        try:
            baseline = run(baseline_llm, P)
        finally:
            close_llm(baseline_llm)
    finally:
        written = writer.result()
    assert written["P"].cached == 0
    llm = make_llm(tiny_llama, kv_config(extra), dtype=dtype)
    try:
        before = metric("rejected_objects", reason="fingerprint")
        hit = run(llm, P)
        assert hit.cached == len(P) - 1  # every block and the tail, written under the other packing
        assert metric("rejected_objects", reason="fingerprint") == before
        assert hit.tokens == baseline.tokens
        if dtype == "float32":
            assert same_output(hit, baseline)
    finally:
        close_llm(llm)


def test_fresh_multiprocess_engine_whose_first_request_is_an_n_minus_1_hit(tiny_llama: Path, tmp_path: Path) -> None:
    extra = {"disk": {"path": str(tmp_path / "kv")}}
    first = engine_process(tiny_llama, extra, {"P": P}, tmp_path / "writer.log", dtype="bfloat16")
    assert first["P"].cached == 0
    # default multi-process mode: the worker's first forward is the 1-token step (no warm-up prefill)
    second = engine_process(tiny_llama, extra, {"P": P}, tmp_path / "reader.log", multiprocess=True, dtype="bfloat16")
    assert second["P"].cached == len(P) - 1  # the engine survived its first attention call
    assert second["P"].tokens == first["P"].tokens


def test_the_facts_that_reach_a_vllm_member_fingerprint() -> None:
    """vLLM: backend, CPU ISA, KV cache dtype and scale handling (plus dtype, shape and strides
    per layer from `BlockLayout.description`); each one, changed, changes the facts."""
    from kvpack.vllm_plugin.byte_facts import block_byte_facts

    def config(isa: str, backend: str = "CPU_ATTN", cache_dtype: str = "auto", k_scale: float = 1.0):  # type: ignore[no-untyped-def]
        layer = SimpleNamespace(
            isa=isa, attn_backend=SimpleNamespace(get_name=lambda: backend), _k_scale=k_scale, _v_scale=1.0
        )
        return SimpleNamespace(
            compilation_config=SimpleNamespace(static_forward_context={"model.layers.0.attn": layer}),
            cache_config=SimpleNamespace(cache_dtype=cache_dtype, calculate_kv_scales=False),
        )

    facts = block_byte_facts(config("amx"), ["model.layers.0.attn"], "cpu")  # type: ignore[arg-type]
    assert [name for name, _ in facts.as_extra()] == ["attn_backend", "cpu_attn_isa", "kv_cache_dtype", "kv_scales"]
    assert facts.as_extra() == (
        ("attn_backend", "CPU_ATTN"),
        ("cpu_attn_isa", "amx"),
        ("kv_cache_dtype", "auto"),
        ("kv_scales", "-"),
    )
    variants = [
        config("vec"),
        config("amx", backend="FLASHINFER"),
        config("amx", cache_dtype="fp8_e4m3"),
    ]
    for other in variants:
        assert block_byte_facts(other, ["model.layers.0.attn"], "cpu") != facts  # type: ignore[arg-type]
    fp8 = block_byte_facts(config("amx", cache_dtype="fp8_e4m3"), ["model.layers.0.attn"], "cpu")  # type: ignore[arg-type]
    fp8_rescaled = block_byte_facts(config("amx", cache_dtype="fp8_e4m3", k_scale=0.5), ["model.layers.0.attn"], "cpu")  # type: ignore[arg-type]
    assert fp8.kv_scales != fp8_rescaled.kv_scales  # another checkpoint scale: other bytes
    gpu = block_byte_facts(config("amx", backend="FLASH_ATTN"), ["model.layers.0.attn"], "cuda")  # type: ignore[arg-type]
    assert gpu.cpu_attn_isa == "-"
