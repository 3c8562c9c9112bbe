"""KV-head ranges over TP ranks (`kvpack.identity.heads`): who stores which heads, what a reader loads.

Every split a writer at any TP size can store must be among the splits a reader tries, every
rank's heads must be covered by the stored ranges it loads (and by nothing else), and a
replicated head (TP > KV heads, MLA's single latent) must be stored by exactly one rank.
"""

from __future__ import annotations

import pytest

from kvpack.identity.heads import HeadRange, HeadSplit, partitions, rank_range, sources, split, writes


@pytest.mark.parametrize("num_heads", [1, 2, 4, 8])
@pytest.mark.parametrize("writer_tp", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("reader_tp", [1, 2, 4, 8, 16])
def test_a_reader_at_any_tp_finds_and_covers_what_a_writer_at_any_tp_stored(
    num_heads: int, writer_tp: int, reader_tp: int
) -> None:
    if (writer_tp < num_heads and num_heads % writer_tp) or (reader_tp < num_heads and num_heads % reader_tp):
        pytest.skip("not a split vLLM or SGLang runs")
    writer = HeadSplit(num_heads, 64, writer_tp)
    stored = tuple(writer.own(r) for r in range(writer_tp) if writer.writes(r))
    assert sorted(stored) == list(split(num_heads, len(stored)))  # each head stored once, in equal ranges
    reader = HeadSplit(num_heads, 64, reader_tp)
    assert stored in reader.partitions()  # the reader tries the writer's split
    assert set(writer.written_members()) == {writer.member(r) for r in stored}
    for rank in range(reader_tp):
        own = reader.own(rank)
        parts = sources(own, stored)
        covered = [h for _, part in parts for h in range(part.start, part.stop)]
        assert covered == list(range(own.start, own.stop))  # every head of the rank, once, in order
        assert all(part.start >= s.start and part.stop <= s.stop for s, part in parts)


def test_replicated_heads_are_written_by_the_first_rank_holding_them() -> None:
    assert [rank_range(r, 4, 2) for r in range(4)] == [
        HeadRange(0, 1),
        HeadRange(0, 1),
        HeadRange(1, 2),
        HeadRange(1, 2),
    ]
    assert [writes(r, 4, 2) for r in range(4)] == [True, False, True, False]
    mla = HeadSplit(1, 576, 4)  # one latent, every rank holds it, rank 0 stores it
    assert mla.written_members() == ("kv",) and [mla.writes(r) for r in range(4)] == [True, False, False, False]


def test_member_names_and_the_reader_s_own_split_first() -> None:
    assert HeadRange(0, 2).member(2) == "kv" and HeadRange(1, 2).member(2) == "kv_h1_2"
    assert [len(p) for p in partitions(8, 2)] == [2, 1, 4, 8]
    assert [len(p) for p in partitions(8, 16)] == [8, 1, 2, 4]  # TP > heads: one range per head
    with pytest.raises(ValueError):
        rank_range(0, 3, 8)
    with pytest.raises(ValueError):
        HeadRange(2, 2)
