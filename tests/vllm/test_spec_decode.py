"""Speculative decoding with kvpack on the real vLLM CPU engine: the draft state survives a hit.

The failure of the field: a tiered cache restored the target model's KV but not
the draft model's; the hit rate looked perfect and the accept rate collapsed.
Here the drafter is a copy of the tiny target (``method: draft_model``, 3
speculative tokens), so without kvpack every draft token is accepted (R0 = 1.0).

Engine lifetimes (in-process, one at a time, module scoped):

1. baseline: speculative decoding, no kvpack -> tokens, logprobs, R0.
2. packed store (draft layers inside each ``kv`` object), then a packed hit
   engine: full hit == baseline, R == R0; the same engine with the draft layers
   skipped on load (`draft_faults.without_draft_loads`) -> R falls (the failure,
   reproduced: this suite can see it).
3. sidecar store (``draft`` member beside ``kv``): prompt A whole, prompt C
   with the draft member not stored (`draft_faults.without_draft_saves`); then a
   ``recompute`` hit engine (A: full hit == baseline; C: partial, no hit,
   == baseline, R == R0) and a ``target_only`` hit engine (C: partial hit
   counted by member, target KV used, R falls). Hit engines are
   ``kv_consumer`` so they never repair the store for the next one.

Queries share a long prefix with a stored prompt (680 of 700 tokens: 5 blocks
and 40 tokens of the stored tail) and then diverge, so the hit engine prefills
20 tokens. A query equal to a stored prompt (A itself) hits n - 2 with a
drafter model, not n - 1: vLLM 0.32's drafter loses a whole draft round after
a prefill step of one token, whatever the cache (`scopes.min_prefill_tokens`;
measured 36/39 accepted after vLLM's own prefix-cache hit of 512 of 513 tokens,
36/36 with 2 or 3 tokens to prefill: `prefix_cache_hits`, a fourth engine with
vLLM's prefix cache and no kvpack), so that hit must accept exactly what the
no-cache run and vLLM's own prefix-cache hit of A accept, round for round.

Greedy speculative decoding is lossless: damaged draft state changes only the
accept rate, never the tokens, so every run is also compared with the baseline.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from draft_faults import without_draft_loads, without_draft_saves
from vllm_helpers import BLOCK, Run, close_llm, kv_config, make_llm, metric, prompt, run, same_output

pytestmark = pytest.mark.vllm

SPEC_TOKENS = 3
GEN = 48
N = 700  # stored prompts: 5 whole blocks + a 60-token tail
SHARED = 680  # a query's prefix shared with a stored prompt: what a hit loads
A = prompt(21, N)  # stored with its draft state (packed and sidecar)
B = prompt(22, N)  # packed; its hit skips the draft layers on load
C = prompt(23, N)  # sidecar; stored without the draft member
QA, QB, QC = (p[:SHARED] + prompt(30 + i, N - SHARED) for i, p in enumerate((A, B, C)))
ONE = prompt(24, 4 * BLOCK + 1)  # vLLM's prefix cache leaves it a one-token prefill step
PROMPTS = {"A": A, "B": B, "C": C, "QA": QA, "QB": QB, "QC": QC}
TOLERANCE = 0.02
"""An accept rate after a hit may differ from R0 by at most this much."""
DROP = 0.25
"""A damaged draft state must lower the accept rate by at least this much (measured: ~0.9)."""


@dataclass(frozen=True)
class SpecRun:
    out: Run
    accepted: int
    drafted: int

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def spec_counters(llm: Any) -> tuple[int, int]:
    """(accepted, drafted) tokens so far, from vLLM's own metrics."""
    values = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return int(values.get("vllm:spec_decode_num_accepted_tokens", 0)), int(
        values.get("vllm:spec_decode_num_draft_tokens", 0)
    )


def spec_run(llm: Any, ids: list[int]) -> SpecRun:
    a0, d0 = spec_counters(llm)
    out = run(llm, ids, max_tokens=GEN)
    a1, d1 = spec_counters(llm)
    return SpecRun(out, a1 - a0, d1 - d0)


def spec_llm(target: Path, draft: Path, kv: dict[str, Any] | None = None, **kw: Any) -> Any:
    return make_llm(
        target,
        kv,
        speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": SPEC_TOKENS},
        disable_log_stats=False,
        **kw,
    )


def members_on_disk(store: Path) -> dict[str, set[str]]:
    """chunk -> member names of the objects under `store` (``<chunk>.<member>.kvp``)."""
    out: dict[str, set[str]] = {}
    for p in store.rglob("*.kvp"):
        chunk, member, _ = p.name.rsplit(".", 2)
        out.setdefault(chunk, set()).add(member)
    return out


def chunks_of(ids: list[int]) -> list[str]:
    from kvpack.identity.keys import chunk_hashes

    return list(chunk_hashes(ids, BLOCK))


def assert_same_as_baseline(r: SpecRun, base: SpecRun) -> None:
    assert same_output(r.out, base.out), (r.out.tokens, base.out.tokens)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec-store")
    return {"packed": root / "packed", "sidecar": root / "sidecar"}


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path, tiny_llama_draft: Path, prefix_cache_hits: dict[str, SpecRun]) -> dict[str, SpecRun]:
    """The no-cache runs; after `prefix_cache_hits`, so that engine without a connector runs
    before any kvpack engine is alive (vLLM's KV transfer group is per process)."""
    llm = spec_llm(tiny_llama, tiny_llama_draft)
    try:
        return {name: spec_run(llm, ids) for name, ids in PROMPTS.items()}
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def prefix_cache_hits(tiny_llama: Path, tiny_llama_draft: Path) -> dict[str, SpecRun]:
    """vLLM's own prefix cache, no kvpack: A run twice (the second hits its 5 whole blocks,
    60 tokens to prefill), and ONE (4 blocks and 1 token) twice (the second prefills 1 token)."""
    llm = spec_llm(tiny_llama, tiny_llama_draft, enable_prefix_caching=True)
    try:
        out = {"A_cold": spec_run(llm, A), "A": spec_run(llm, A)}
        out |= {"ONE_cold": spec_run(llm, ONE), "ONE": spec_run(llm, ONE)}
        return out
    finally:
        close_llm(llm)


def _store_engine(target: Path, draft: Path, extra: dict[str, Any], runs: list[tuple[str, bool]]) -> dict[str, SpecRun]:
    """One storing engine: each (prompt, keep_draft) once, saved in the steps that computed it,
    so while the fault is on; but a request's last partial block is saved at its finish,
    in the next run's first step (`CaptureTracker.finish_tail`), under that run's fault: a prompt
    stored without its draft goes first, so no later run's fault drops a kept draft's tail."""
    llm = spec_llm(target, draft, kv_config(extra, "kv_producer"))
    out: dict[str, SpecRun] = {}
    try:
        for name, keep_draft in runs:
            with pytest.MonkeyPatch.context() as mp:
                if not keep_draft:
                    without_draft_saves(mp)
                out[name] = spec_run(llm, PROMPTS[name])
        return out
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def packed_stored(tiny_llama: Path, tiny_llama_draft: Path, stores: dict[str, Path], baseline) -> dict[str, SpecRun]:  # type: ignore[no-untyped-def]
    return _store_engine(
        tiny_llama, tiny_llama_draft, {"disk": {"path": str(stores["packed"])}}, [("A", True), ("B", True)]
    )


@pytest.fixture(scope="module")
def packed_hits(tiny_llama: Path, tiny_llama_draft: Path, stores: dict[str, Path], packed_stored) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """A new engine on the packed store: A hit whole, B hit with the draft layers skipped on load."""
    extra = {"disk": {"path": str(stores["packed"])}}
    llm = spec_llm(tiny_llama, tiny_llama_draft, kv_config(extra, "kv_consumer"))
    try:
        out: dict[str, Any] = {"QA": spec_run(llm, QA), "loaded_QA": metric("loaded_tokens"), "A": spec_run(llm, A)}
        with pytest.MonkeyPatch.context() as mp:
            without_draft_loads(mp)
            out["QB"] = spec_run(llm, QB)
        return out
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def sidecar_stored(tiny_llama: Path, tiny_llama_draft: Path, stores: dict[str, Path], baseline) -> dict[str, SpecRun]:  # type: ignore[no-untyped-def]
    extra = {"disk": {"path": str(stores["sidecar"])}, "draft_placement": "sidecar"}
    return _store_engine(tiny_llama, tiny_llama_draft, extra, [("C", False), ("A", True)])


def _sidecar_hit_engine(target: Path, draft: Path, store: Path, policy: str) -> Iterator[Any]:
    extra = {"disk": {"path": str(store)}, "draft_placement": "sidecar", "draft_policy": policy}
    llm = spec_llm(target, draft, kv_config(extra, "kv_consumer"))
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def sidecar_recompute(tiny_llama: Path, tiny_llama_draft: Path, stores: dict[str, Path], sidecar_stored):  # type: ignore[no-untyped-def]
    yield from _sidecar_hit_engine(tiny_llama, tiny_llama_draft, stores["sidecar"], "recompute")


@pytest.fixture(scope="module")
def sidecar_target_only(tiny_llama: Path, tiny_llama_draft: Path, stores: dict[str, Path], sidecar_stored):  # type: ignore[no-untyped-def]
    yield from _sidecar_hit_engine(tiny_llama, tiny_llama_draft, stores["sidecar"], "target_only")


# -- tests ----------------------------------------------------------------------


def test_baseline_accepts_drafts(baseline: dict[str, SpecRun]) -> None:
    for name, r in baseline.items():
        assert r.drafted >= GEN // (SPEC_TOKENS + 1) * SPEC_TOKENS // 2, name
        assert r.accept_rate >= 0.9, (name, r.accept_rate)  # the drafter is a copy of the target
        assert len(set(r.out.tokens)) > GEN // 2  # varied greedy output (initializer_range 0.15)


def test_packed_store_keeps_one_object_per_block(packed_stored, baseline, stores) -> None:  # type: ignore[no-untyped-def]
    for name, r in packed_stored.items():
        assert r.out.cached == 0
        assert_same_as_baseline(r, baseline[name])
    on_disk = members_on_disk(stores["packed"])
    for chunk in chunks_of(A):
        assert on_disk[chunk] == {"kv"}  # draft layers packed inside: no extra object


def test_packed_hit_keeps_accept_rate(packed_hits, baseline) -> None:  # type: ignore[no-untyped-def]
    r, base = packed_hits["QA"], baseline["QA"]
    assert r.out.cached == SHARED
    assert packed_hits["loaded_QA"] >= SHARED
    assert_same_as_baseline(r, base)
    assert abs(r.accept_rate - base.accept_rate) <= TOLERANCE, (r.accept_rate, base.accept_rate)


def assert_same_draft_rounds(r: SpecRun, base: SpecRun) -> None:
    """Every draft round of `base` again: as many drafted and accepted tokens, none lost."""
    assert (r.accepted, r.drafted) == (base.accepted, base.drafted), (
        f"accepted {r.accepted} of {r.drafted} after the hit, {base.accepted} of {base.drafted} without a cache"
    )


def test_packed_hit_of_a_whole_stored_prompt_keeps_every_draft_round(packed_hits, baseline) -> None:  # type: ignore[no-untyped-def]
    """Regression (issue 26): a hit of n - 1 left vLLM a one-token prefill and one draft round was lost."""
    r, base = packed_hits["A"], baseline["A"]
    assert_same_as_baseline(r, base)
    assert_same_draft_rounds(r, base)
    assert r.out.cached == N - 2  # n - 2: vLLM's drafter needs two tokens in the prefill step


def test_kvpack_hit_accepts_what_a_vllm_prefix_cache_hit_accepts(
    prefix_cache_hits, packed_hits, sidecar_recompute
) -> None:  # type: ignore[no-untyped-def]
    """Issue 26's case: the stored prompt again, hit by kvpack (n - 2, packed and sidecar)
    and by vLLM's own prefix cache (whole blocks): the same draft rounds, tokens equal."""
    ref = prefix_cache_hits["A"]
    assert ref.out.cached == 5 * BLOCK and ref.out.tokens == prefix_cache_hits["A_cold"].out.tokens
    for r in (packed_hits["A"], spec_run(sidecar_recompute, A)):
        assert r.out.cached == N - 2 and r.out.tokens == ref.out.tokens
        assert (r.accepted, r.drafted) == (ref.accepted, ref.drafted)


def test_vllm_loses_a_draft_round_after_a_one_token_prefill(prefix_cache_hits) -> None:  # type: ignore[no-untyped-def]
    """The cause, in vLLM itself: its own prefix cache leaving one token to prefill costs one
    draft round (measured 36/39 vs 36/36), tokens equal. This is why a hit leaves two
    (`scopes.min_prefill_tokens`); when a vLLM release fixes it, this fails and the cap can go."""
    cold, hit = prefix_cache_hits["ONE_cold"], prefix_cache_hits["ONE"]
    assert hit.out.cached == len(ONE) - 1 and hit.out.tokens == cold.out.tokens
    assert hit.accepted == cold.accepted and hit.drafted == cold.drafted + SPEC_TOKENS


def test_packed_hit_without_draft_layers_drops_accept_rate(packed_hits, baseline) -> None:  # type: ignore[no-untyped-def]
    """Negative control: the field's failure (target restored, draft not) is visible here."""
    r, base = packed_hits["QB"], baseline["QB"]
    assert r.out.cached == SHARED  # the same "perfect" hit...
    assert_same_as_baseline(r, base)  # ...and the same tokens (lossless)...
    assert r.accept_rate <= base.accept_rate - DROP, (r.accept_rate, base.accept_rate)  # ...but drafts fail


def test_sidecar_store_writes_a_draft_member(sidecar_stored, baseline, stores) -> None:  # type: ignore[no-untyped-def]
    for name, r in sidecar_stored.items():
        assert r.out.cached == 0
        assert_same_as_baseline(r, baseline[name])
    on_disk = members_on_disk(stores["sidecar"])
    for chunk in chunks_of(A):
        assert on_disk[chunk] == {"kv", "draft"}
    for chunk in chunks_of(C):
        assert on_disk[chunk] == {"kv"}  # `without_draft_saves` left the draft member out


def test_sidecar_hit_keeps_accept_rate(sidecar_recompute, baseline) -> None:  # type: ignore[no-untyped-def]
    before = metric("full_hits", role="SCHEDULER")
    r, base = spec_run(sidecar_recompute, QA), baseline["QA"]
    assert r.out.cached == SHARED
    assert_same_as_baseline(r, base)
    assert abs(r.accept_rate - base.accept_rate) <= TOLERANCE, (r.accept_rate, base.accept_rate)
    assert metric("full_hits", role="SCHEDULER") >= before + 1


def test_sidecar_hit_of_a_whole_stored_prompt_keeps_every_draft_round(sidecar_recompute, baseline) -> None:  # type: ignore[no-untyped-def]
    r, base = spec_run(sidecar_recompute, A), baseline["A"]
    assert_same_as_baseline(r, base)
    assert_same_draft_rounds(r, base)
    assert r.out.cached == N - 2


def test_sidecar_missing_draft_under_recompute_is_no_hit(sidecar_recompute, baseline) -> None:  # type: ignore[no-untyped-def]
    before = metric("partial_hits", role="SCHEDULER", missing_member="draft")
    r, base = spec_run(sidecar_recompute, QC), baseline["QC"]
    assert metric("partial_hits", role="SCHEDULER", missing_member="draft") >= before + SHARED // BLOCK
    assert r.out.cached == 0  # reported, not used: the engine recomputes target and draft
    assert_same_as_baseline(r, base)
    assert abs(r.accept_rate - base.accept_rate) <= TOLERANCE, (r.accept_rate, base.accept_rate)


def test_sidecar_missing_draft_under_target_only_is_partial(sidecar_target_only, baseline) -> None:  # type: ignore[no-untyped-def]
    """target_only uses the target KV and counts the partial hit; the accept rate shows the cost."""
    before = metric("partial_hits", role="SCHEDULER", missing_member="draft")
    full_before = metric("full_hits", role="SCHEDULER")
    r, base = spec_run(sidecar_target_only, QC), baseline["QC"]
    assert metric("partial_hits", role="SCHEDULER", missing_member="draft") >= before + SHARED // BLOCK
    assert metric("full_hits", role="SCHEDULER") == full_before  # partial, never reported as full
    assert r.out.cached == SHARED
    assert_same_as_baseline(r, base)
    assert r.accept_rate <= base.accept_rate - DROP, (r.accept_rate, base.accept_rate)


# -- draft layers told apart by the speculative config (no engine) ---------------


def _vllm_config(method: str | None, target_layers: int = 2) -> Any:
    spec = None
    if method is not None:
        spec = SimpleNamespace(
            method=method,
            model="/m/draft",
            num_speculative_tokens=3,
            uses_draft_kv_cache=lambda: method not in ("ngram", "suffix", "medusa"),
        )
    model = SimpleNamespace(get_total_num_hidden_layers=lambda: target_layers)
    return SimpleNamespace(speculative_config=spec, model_config=model)


TARGET = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@pytest.mark.parametrize(("method", "tokens"), [(None, 1), ("ngram", 1), ("draft_model", 2), ("eagle", 2)])
def test_min_prefill_tokens_is_two_with_a_drafter_model(method: str | None, tokens: int) -> None:
    from kvpack.vllm_plugin.scopes import min_prefill_tokens

    assert min_prefill_tokens(_vllm_config(method)) == tokens


def test_split_draft_model_layers_by_prefix() -> None:
    from kvpack.vllm_plugin.scopes import split_draft_layers

    draft = ("draft_model.model.layers.0.self_attn.attn", "draft_model.model.layers.1.self_attn.attn")
    assert split_draft_layers(_vllm_config("draft_model"), TARGET + draft) == (TARGET, draft)


def test_split_eagle_head_by_layer_index_not_position() -> None:
    from kvpack.vllm_plugin.scopes import split_draft_layers

    head = ("model.layers.2.self_attn.attn",)  # an EAGLE head after the target's 2 layers
    names = (TARGET[0], *head, TARGET[1])  # registration order does not matter
    assert split_draft_layers(_vllm_config("eagle"), names) == (TARGET, head)


@pytest.mark.parametrize("method", [None, "ngram"])
def test_no_draft_kv_no_draft_member(method: str | None) -> None:
    from kvpack import DraftPlacement, KVPackConfig
    from kvpack.vllm_plugin.scopes import resolve_draft_placement, split_draft_layers

    cfg = _vllm_config(method)
    names = TARGET + ("model.layers.2.self_attn.attn",)
    assert split_draft_layers(cfg, names) == (names, ())
    for placement in ("auto", "packed", "sidecar"):
        config = KVPackConfig.from_dict({"draft_placement": placement})
        assert resolve_draft_placement(cfg, config) is DraftPlacement.NONE


@pytest.mark.parametrize(("setting", "expected"), [("auto", "packed"), ("packed", "packed"), ("sidecar", "sidecar")])
def test_placement_resolution(setting: str, expected: str) -> None:
    from kvpack import KVPackConfig
    from kvpack.vllm_plugin.scopes import resolve_draft_placement

    config = KVPackConfig.from_dict({"draft_placement": setting})
    assert resolve_draft_placement(_vllm_config("draft_model"), config).value == expected
