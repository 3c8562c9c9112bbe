"""`KVStore.lookup` over several head splits (`kvpack.policy.split_lookup`): each chunk from the
first split that holds all of it, on a real store (memory + disk).

The scenario is a fleet that changed its TP size within one conversation: the first
chunks of a prefix are two head-range objects each (TP=2), the later ones one object of
all heads (TP=1). The end-to-end runs are in tests/vllm/test_tensor_parallel.py and
tests/sglang/test_sglang_head_splits.py; here the lookup's answer itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from fixtures.builders import GROUP_FP, MEMBER_FP, chunk_id, make_item
from kvpack import KVPackConfig, KVStore, MemberRole, MemberSpec, StoreKey, TierStatus

ALL = [MemberSpec("kv", MEMBER_FP, MemberRole.TARGET)]
TWO = [MemberSpec("kv_h0_1", MEMBER_FP, MemberRole.TARGET), MemberSpec("kv_h1_2", MEMBER_FP, MemberRole.TARGET)]
CHUNKS = [chunk_id(i) for i in range(6)]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    s = KVStore.from_config(
        KVPackConfig.from_dict({"disk": {"path": str(tmp_path / "disk")}, "memory": {"capacity": "64MiB"}})
    )
    yield s
    s.close()


def put(store: KVStore, chunks: range, members: Sequence[str]) -> None:
    items = [make_item("t", chunk_id(i), m, seed=i, checksum=False)[0] for i in chunks for m in members]
    assert store.store(items) == [TierStatus.OK] * len(items)


def test_each_chunk_is_read_from_the_split_that_holds_it(store: KVStore) -> None:
    put(store, range(0, 2), ["kv_h0_1", "kv_h1_2"])  # turn 1, at TP=2
    put(store, range(2, 4), ["kv"])  # turn 2, at TP=1
    got = store.lookup("t", GROUP_FP, CHUNKS[:4], ALL, 16, alternatives=[TWO])
    assert got.hit_chunks == 4
    assert got.chunk_sets == (1, 1, 0, 0)
    assert [got.members_to_load(i) for i in range(4)] == [("kv_h0_1", "kv_h1_2")] * 2 + [("kv",)] * 2
    want = {StoreKey("t", GROUP_FP, CHUNKS[i], m) for i in range(2) for m in ("kv_h0_1", "kv_h1_2")}
    want |= {StoreKey("t", GROUP_FP, CHUNKS[i], "kv") for i in range(2, 4)}
    assert set(got.located) == want  # the tier of every object the load will read, and of no other
    assert store.metrics.value("hit_tokens", tenant="t") == 4 * 16


def test_a_chunk_with_part_of_a_split_ends_the_hit_as_a_counted_partial_hit(store: KVStore) -> None:
    put(store, range(0, 2), ["kv"])
    put(store, range(2, 3), ["kv_h0_1"])  # chunk 2: one head range of two
    put(store, range(3, 4), ["kv"])
    got = store.lookup("t", GROUP_FP, CHUNKS[:4], ALL, 16, alternatives=[TWO])
    assert got.hit_chunks == 2 and got.chunk_sets == (0, 0)
    assert got.boundary_missing == ("kv_h1_2",)
    assert store.metrics.value("partial_hits", tenant="t", missing_member="kv_h1_2") == 1


def test_other_splits_are_asked_once_and_only_for_the_chunks_the_own_split_lacks(
    store: KVStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At most two batched `locate` calls, however many splits: one round trip each to a
    Mooncake master. The first set in order that holds a chunk whole is the one loaded."""
    put(store, range(0, 3), ["kv"])
    put(store, range(3, 5), ["kv_h0_1", "kv_h1_2"])
    put(store, range(4, 5), ["kv_all2"])  # chunk 4 under a third split too: the second set wins
    asked: list[list[StoreKey]] = []
    locate = store.locate

    def counting(keys, budget=None):  # type: ignore[no-untyped-def]
        asked.append(list(keys))
        return locate(keys, budget)

    monkeypatch.setattr(store, "locate", counting)
    third = [MemberSpec("kv_all2", MEMBER_FP, MemberRole.TARGET)]
    got = store.lookup("t", GROUP_FP, CHUNKS, ALL, 16, alternatives=[TWO, third])
    assert got.hit_chunks == 5 and got.chunk_sets == (0, 0, 0, 1, 1)
    assert [len(keys) for keys in asked] == [6, 3 * (2 + 1)]  # own split: 6 chunks; then chunks 3-5 under both others
    asked.clear()
    assert store.lookup("t", GROUP_FP, CHUNKS[:3], ALL, 16, alternatives=[TWO]).hit_chunks == 3
    assert len(asked) == 1  # the own split held every chunk: no other split is asked
