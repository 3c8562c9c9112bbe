"""KVPackConnector on the real vLLM CPU engine (in-process): store in one engine, hit in a new one.

Three engine lifetimes for the whole module: a baseline without kvpack, engine 1
that stores, engine 2 (same disk store, prefix_match_unit 4) that hits. Every
assertion compares with the baseline, and the negative controls show that the
comparison can fail.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from vllm_helpers import (
    BLOCK,
    Run,
    close_llm,
    corrupt_payload,
    kv_config,
    make_llm,
    metric,
    object_files,
    prompt,
    run,
    same_output,
    swap_payload,
)

pytestmark = pytest.mark.vllm

P = prompt(1, 301)  # stored whole: 2 blocks + a 45-token tail
Q = P[:283] + prompt(2, 37)  # shares 283 tokens with P (27 into P's tail)
T = prompt(3, 301)  # stored by tenant alice
C = prompt(4, 301)  # its first block gets corrupted
W = prompt(5, 301)  # its first block gets another prompt's (valid) KV
D = prompt(6, 301)  # donor of that KV
CT = prompt(7, 301)  # its tail gets corrupted
F = prompt(8, 301)  # served after the disk tier broke
ALL = {"P": P, "Q": Q, "T": T, "C": C, "W": W, "D": D, "CT": CT, "F": F}
UNIT = 4


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-store") / "kv"


@pytest.fixture(scope="module")
def baseline(tiny_llama: Path) -> dict[str, Run]:
    llm = make_llm(tiny_llama)
    try:
        return {name: run(llm, ids) for name, ids in ALL.items()}
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def stored(tiny_llama: Path, store_dir: Path, baseline: dict[str, Run]) -> dict[str, Run]:
    """Engine 1: every prompt but Q and F once (misses, stored), T as tenant alice."""
    llm = make_llm(tiny_llama, kv_config({"disk": {"path": str(store_dir)}, "trusted_tenants": ["alice", "bob"]}))
    try:
        out = {}
        for name in ("P", "C", "W", "D", "CT"):
            out[name] = run(llm, ALL[name])
        out["T"] = run(llm, T, tenant="alice")
        return out
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def engine2(tiny_llama: Path, store_dir: Path, stored: dict[str, Run]):  # type: ignore[no-untyped-def]
    llm = make_llm(
        tiny_llama,
        kv_config({"disk": {"path": str(store_dir)}, "prefix_match_unit": UNIT, "trusted_tenants": ["alice", "bob"]}),
    )
    yield llm
    close_llm(llm)


def test_engine1_misses_equal_baseline_and_store(
    stored: dict[str, Run], baseline: dict[str, Run], store_dir: Path
) -> None:
    for name, r in stored.items():
        assert r.cached == 0
        assert same_output(r, baseline[name]), name
    blocks, tail = object_files(store_dir, P)
    assert len(blocks) == 2 and tail is not None


def test_hit_in_new_engine_equals_baseline(engine2, baseline: dict[str, Run]) -> None:  # type: ignore[no-untyped-def]
    r = run(engine2, P)
    assert r.cached == len(P) - 1  # 2 whole blocks + 44 of the 45 stored tail tokens (n - 1)
    assert same_output(r, baseline["P"])
    assert metric("loaded_tokens") >= len(P) - 1
    assert metric("tail_hit_tokens", role="SCHEDULER") >= len(P) - 1 - 2 * BLOCK


def test_tail_partial_common_prefix_rounded_to_unit(engine2, baseline: dict[str, Run]) -> None:  # type: ignore[no-untyped-def]
    r = run(engine2, Q)
    common = 283
    assert r.cached == common - (common - 2 * BLOCK) % UNIT == 280
    assert same_output(r, baseline["Q"])


def test_tenants_are_isolated(engine2, baseline: dict[str, Run]) -> None:  # type: ignore[no-untyped-def]
    bob = run(engine2, T, tenant="bob")
    assert bob.cached == 0
    assert same_output(bob, baseline["T"])
    default = run(engine2, T)
    assert default.cached == 0
    alice = run(engine2, T, tenant="alice")
    assert alice.cached == len(T) - 1
    assert same_output(alice, baseline["T"])


def test_corrupted_object_is_refused(engine2, baseline: dict[str, Run], store_dir: Path) -> None:  # type: ignore[no-untyped-def]
    blocks, _ = object_files(store_dir, C)
    corrupt_payload(blocks[0])
    before = metric("rejected_objects", reason="checksum")
    r = run(engine2, C)
    assert metric("rejected_objects", reason="checksum") > before
    assert metric("load_failures") > 0
    assert same_output(r, baseline["C"])


def test_corrupted_tail_is_refused(engine2, baseline: dict[str, Run], store_dir: Path) -> None:  # type: ignore[no-untyped-def]
    _, tail = object_files(store_dir, CT)
    assert tail is not None
    corrupt_payload(tail)
    before = metric("rejected_objects", reason="checksum")
    r = run(engine2, CT)
    assert metric("rejected_objects", reason="checksum") > before
    assert same_output(r, baseline["CT"])


def test_negative_control_wrong_kv_changes_output(engine2, baseline: dict[str, Run], store_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """Loading valid-looking KV of other tokens changes the output: the tests above can fail."""
    target, _ = object_files(store_dir, W)
    donor, _ = object_files(store_dir, D)
    swap_payload(target[0], donor[0])
    r = run(engine2, W)
    assert r.cached == len(W) - 1
    assert not same_output(r, baseline["W"])


def test_broken_disk_tier_degrades_to_memory_and_recompute(engine2, baseline: dict[str, Run], store_dir: Path) -> None:  # type: ignore[no-untyped-def]
    from kvpack.tools.offline import drain

    drain(engine2)  # earlier tests' write-backs still landing would race the rmtree below
    shutil.rmtree(store_dir)
    store_dir.write_text("not a directory any more")  # every disk write now fails
    first = run(engine2, F)
    assert first.cached == 0 and same_output(first, baseline["F"])
    drain(engine2)  # a deterministic point: the write-back has tried (and failed) to write F to disk
    broken = metric("tier_errors", tier="disk") + metric("store_dropped", tier="disk")
    assert broken > 0
    second = run(engine2, F)  # served from host memory
    assert second.cached == len(F) - 1
    assert same_output(second, baseline["F"])
