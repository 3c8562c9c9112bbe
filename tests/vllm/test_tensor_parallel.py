"""A cache written at one TP size is read at another (canonical objects, `kvpack.identity.heads`).

Real vLLM CPU engines, fp32, each in a new process that simply ends: TP=2 runs
two ranks on two cores (``VLLM_CPU_OMP_THREADS_BIND="0|1"``; measured: TP=2 and
TP=1 give identical tokens in fp32). Before canonical objects the group
fingerprint held the TP size and each rank stored its own shard, so a TP=1
reader of a TP=2 store reused 0 tokens and stored the prompt a second time.

- TP=2 writes (``kv_h0_1`` and ``kv_h1_2`` per chunk), TP=1 reads: n - 1 tokens
  reused, outputs equal the TP=1 no-cache run; no chunk is stored twice.
- TP=1 writes (``kv``), TP=2 reads: each rank copies its heads out of the one
  object; outputs equal the same no-cache run.
- One head range missing from the store: the hit stops before that chunk (a
  partial hit, counted), never a load of the wrong heads.
- A conversation across a TP change: turn 1 written at TP=2, turn 2 at TP=1; a new
  TP=1 process reuses all of turn 2, each chunk from the split that holds it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from vllm_helpers import (
    BLOCK,
    Run,
    close_llm,
    engine_process,
    kv_config,
    make_llm,
    metric,
    prompt,
    run,
    same_output,
    stored_files,
)

pytestmark = pytest.mark.vllm

P = prompt(71, 301)
TURN2 = P + prompt(72, 200)
"""Turn 2 of the conversation across a TP change."""
TWO_RANKS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
"""One core per rank: without it a TP=2 CPU engine fails start-up on NUMA binding."""


def members(store: Path) -> dict[str, int]:
    """Stored objects per member name (file names are ``<chunk>.<member>...kvp``)."""
    out: dict[str, int] = {}
    for path in stored_files(store):
        name = path.name.split(".")[1]
        out[name] = out.get(name, 0) + 1
    return out


@pytest.fixture(scope="module")
def no_cache(tiny_llama: Path) -> dict[str, Run]:
    """TP=1 no-cache runs of `P` and `TURN2`, from one engine."""
    llm = make_llm(tiny_llama)
    try:
        return {"P": run(llm, P), "TURN2": run(llm, TURN2)}
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def baseline(no_cache: dict[str, Run]) -> Run:
    return no_cache["P"]


@pytest.fixture(scope="module")
def tp2_store(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("tp2") / "kv"
    log = store.parent / "writer.log"
    written = engine_process(
        tiny_llama,
        {"disk": {"path": str(store)}},
        {"P": P},
        log,
        multiprocess=True,
        env=TWO_RANKS,
        tensor_parallel_size=2,
    )
    assert written["P"].cached == 0
    return store


def test_tp2_writes_tp1_reads(tiny_llama: Path, tp2_store: Path, baseline: Run, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    shutil.copytree(tp2_store, store)
    written = members(store)
    assert (
        set(written) == {"kv_h0_1", "kv_h1_2"} and written["kv_h0_1"] == written["kv_h1_2"]
    )  # 2 heads, one range per rank
    read = engine_process(tiny_llama, {"disk": {"path": str(store)}}, {"P": P}, tmp_path / "reader.log")["P"]
    assert read.cached == len(P) - 1
    assert same_output(read, baseline)
    again = [p.name for p in stored_files(store) if p.name.split(".")[1] == "kv"]
    assert all("-tail" in name for name in again)  # the reader stored no chunk again (only its own generated tail)


def test_tp1_writes_tp2_reads(tiny_llama: Path, baseline: Run, tmp_path: Path) -> None:
    extra = {"disk": {"path": str(tmp_path / "kv")}}
    written = engine_process(tiny_llama, extra, {"P": P}, tmp_path / "writer.log")["P"]
    assert written.cached == 0
    assert set(members(tmp_path / "kv")) == {"kv"}
    read = engine_process(
        tiny_llama,
        extra,
        {"P": P},
        tmp_path / "reader.log",
        multiprocess=True,
        env=TWO_RANKS,
        tensor_parallel_size=2,
    )
    assert read["P"].cached == len(P) - 1
    assert same_output(read["P"], baseline)


def test_a_missing_head_range_stops_the_hit_before_its_chunk(
    tiny_llama: Path, tp2_store: Path, baseline: Run, tmp_path: Path
) -> None:
    from kvpack.identity.keys import chunk_hashes

    store = tmp_path / "kv"
    shutil.copytree(tp2_store, store)
    second = chunk_hashes(P, BLOCK)[1]
    gone = [p for p in stored_files(store) if p.name.startswith(f"{second}.kv_h1_2.")]
    assert len(gone) == 1
    gone[0].unlink()  # chunk 1 keeps heads [0, 1) only
    llm = make_llm(tiny_llama, kv_config({"disk": {"path": str(store)}}))
    try:
        before = metric("partial_hits", role="SCHEDULER", missing_member="kv_h1_2")
        read = run(llm, P)
        assert metric("partial_hits", role="SCHEDULER", missing_member="kv_h1_2") - before == 1
    finally:
        close_llm(llm)
    assert read.cached == BLOCK  # chunk 0 only: never chunk 1 with half its heads
    assert same_output(read, baseline)


def test_a_conversation_across_a_tp_change_reuses_every_chunk(
    tiny_llama: Path, tp2_store: Path, no_cache: dict[str, Run], tmp_path: Path
) -> None:
    """Turn 1 (P) was computed at TP=2; the fleet moved to TP=1, where turn 2 (P and 200
    more tokens) reused turn 1 and stored its new chunks as TP=1 objects. A new TP=1
    process then reuses n - 1 tokens of turn 2: chunks 0-1 from the TP=2 head ranges,
    chunk 2 and the tail from the TP=1 objects (`kvpack.policy.split_lookup`). A lookup that
    took one split for the whole prefix reused turn 1 only (301 tokens), turn after turn."""
    store = tmp_path / "kv"
    shutil.copytree(tp2_store, store)
    extra = {"disk": {"path": str(store)}}
    turn2 = TURN2
    second = engine_process(tiny_llama, extra, {"T": turn2}, tmp_path / "turn2.log")["T"]
    assert second.cached == len(P)  # turn 1's chunks and tail, from the TP=2 objects
    assert {"kv", "kv_h0_1", "kv_h1_2"} <= set(members(store))
    third = engine_process(tiny_llama, extra, {"T": turn2}, tmp_path / "again.log")["T"]
    assert third.cached == len(turn2) - 1
    assert same_output(third, no_cache["TURN2"])
