"""KVPackConnector on a sliding-window hybrid: vLLM's hybrid allocator, four KV cache groups.

The model (a tiny Llama built by `build_tiny_llama`) has one full-attention
layer and three sliding-window layers (window 48 tokens, block 128), so vLLM
gives it one KV cache group per layer and frees a sliding-window block once
the window has moved past it. kvpack stores each group as a member of the
chunk's group (``kv``, ``kv_g1``..``kv_g3``), needs the sliding-window
members only in the chunk the window still sees at the hit boundary, and
captures those blocks while the request runs (at finish vLLM no longer has
them). Every assertion compares greedy tokens and logprobs with a run
without kvpack; the negative controls show where the window members matter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_helpers import (
    BLOCK,
    Run,
    close_llm,
    corrupt_payload,
    kv_config,
    live_connectors,
    make_llm,
    metric,
    prompt,
    run,
    same_output,
)

pytestmark = pytest.mark.vllm

WINDOW = 48
LAYERS = ("full_attention", "sliding_attention", "sliding_attention", "sliding_attention")
WINDOW_MEMBERS = ("kv_g1", "kv_g2", "kv_g3")

P = prompt(11, 301)  # stored whole: 2 blocks + tail
Q = P[:283] + prompt(12, 37)  # shares 283 tokens with P (27 into P's tail)
L = prompt(13, 700)  # 5 blocks + tail; its early window blocks are freed while it runs
M = L[:400] + prompt(14, 60)  # shares 3 whole blocks with L: needs L's window block 2, captured mid-run
X = prompt(15, 301)  # its window members of block 1 are deleted before engine 2 starts
Y = prompt(16, 301)  # a window member of its block 1 gets corrupted
ALL = {"P": P, "Q": Q, "L": L, "M": M, "X": X, "Y": Y}


def objects(store: Path, ids: list[int], chunk_index: int, members: tuple[str, ...]) -> list[Path]:
    """The files of block `chunk_index` of `ids` (default tenant), one per member."""
    from kvpack.identity.keys import chunk_hashes

    chunk = chunk_hashes(ids, BLOCK)[chunk_index]
    return [p for m in members for p in (store / "default").rglob(f"{chunk}.{m}.kvp")]


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpack.tools.tinymodel import build_tiny_llama

    return build_tiny_llama(
        tmp_path_factory.mktemp("models") / "tiny-swa", num_layers=4, sliding_window=WINDOW, layer_types=LAYERS
    )


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid-store") / "kv"


@pytest.fixture(scope="module")
def baseline(swa_model: Path) -> dict[str, Run]:
    llm = make_llm(swa_model, dtype="float32")
    try:
        return {name: run(llm, ids) for name, ids in ALL.items()}
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def stored(swa_model: Path, store_dir: Path, baseline: dict[str, Run]) -> dict[str, Run]:
    """Engine 1 stores P, L, X, Y; then X's window members of block 1 are deleted."""
    from kvpack.identity.model_identity import model_identity

    llm = make_llm(swa_model, kv_config({"disk": {"path": str(store_dir)}}), dtype="float32")
    try:
        scopes = [c.scope for c in live_connectors() if model_identity(swa_model).value in c.scope.spec.model]
        assert scopes and all(len(s.groups) == 4 for s in scopes)  # the hybrid allocator is on
        out = {name: run(llm, ALL[name]) for name in ("P", "L", "X", "Y")}
    finally:
        close_llm(llm)
    doomed = objects(store_dir, X, 1, WINDOW_MEMBERS)
    assert len(doomed) == 3
    for path in doomed:
        path.unlink()
    return out


@pytest.fixture(scope="module")
def engine2(swa_model: Path, store_dir: Path, stored: dict[str, Run]):  # type: ignore[no-untyped-def]
    llm = make_llm(swa_model, kv_config({"disk": {"path": str(store_dir)}}), dtype="float32")
    yield llm
    close_llm(llm)


def test_misses_equal_baseline_and_every_group_is_stored(
    stored: dict[str, Run], baseline: dict[str, Run], store_dir: Path
) -> None:
    for name, r in stored.items():
        assert r.cached == 0
        assert same_output(r, baseline[name]), name
    every = ("kv", *WINDOW_MEMBERS)
    assert len(objects(store_dir, P, 0, every)) == 4
    # L's block 0 left the window long before L finished: its window members exist only
    # because the connector captured them in the step that computed them
    assert len(objects(store_dir, L, 0, every)) == 4


def test_whole_prompts_hit_n_minus_1(engine2, baseline: dict[str, Run]) -> None:  # type: ignore[no-untyped-def]
    for name in ("P", "L"):
        r = run(engine2, ALL[name])
        assert r.cached == len(ALL[name]) - 1, name
        assert same_output(r, baseline[name]), name


def test_tail_common_prefix(engine2, baseline: dict[str, Run]) -> None:  # type: ignore[no-untyped-def]
    r = run(engine2, Q)
    assert r.cached == 283
    assert same_output(r, baseline["Q"])


def test_prefix_of_a_long_prompt_uses_captured_window_blocks(engine2, baseline: dict[str, Run]) -> None:  # type: ignore[no-untyped-def]
    r = run(engine2, M)
    assert r.cached == 3 * BLOCK  # L's blocks 0-2; block 2's window members were captured mid-run
    assert same_output(r, baseline["M"])


def test_missing_window_member_moves_the_hit_to_a_whole_window(engine2, baseline: dict[str, Run]) -> None:  # type: ignore[no-untyped-def]
    # X's full-attention KV is stored for every block, but block 1 lost its window members:
    # a hit at 2 blocks (or into the tail) would leave the sliding layers without KV.
    # The longest valid hit is block 0 alone, whose window members are there.
    r = run(engine2, X)
    assert r.cached == BLOCK
    assert same_output(r, baseline["X"])


def test_corrupted_window_member_is_refused(engine2, baseline: dict[str, Run], store_dir: Path) -> None:  # type: ignore[no-untyped-def]
    (victim,) = objects(store_dir, Y, 1, ("kv_g2",))
    corrupt_payload(victim)
    before = metric("rejected_objects", reason="checksum")
    r = run(engine2, Y)
    assert same_output(r, baseline["Y"])
    assert metric("rejected_objects", reason="checksum") > before
    # nothing lost: the recompute stored the window member again, so Y hits in full next time
    again = run(engine2, Y)
    assert again.cached == len(Y) - 1
    assert same_output(again, baseline["Y"])


def test_multiprocess_hybrid_hit_from_worker_memory(
    swa_model: Path, baseline: dict[str, Run], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's default mode: the scheduler side (engine core) tracks captures and sees the
    worker's memory tier only through reports; disk is off, so every hit is from memory.
    The repeated prompts follow at once (no drain): what a step saved is a hit in the next."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = make_llm(swa_model, kv_config({"disk": {"enabled": False}}), dtype="float32")
    try:
        for name in ("P", "L"):
            assert run(llm, ALL[name]).cached == 0
        for name, want in (("P", len(P) - 1), ("L", len(L) - 1), ("M", 3 * BLOCK)):
            r = run(llm, ALL[name])
            assert r.cached == want, name
            assert same_output(r, baseline[name]), name
    finally:
        close_llm(llm)
