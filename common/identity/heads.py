"""KV-head ranges: how canonical objects are split over tensor-parallel ranks.

A canonical object (`kvpack.canonical`) holds one chunk of every layer for a
range of KV heads ``[start, stop)``, named by `HeadRange.member`. A writer at
TP=t stores one object per rank that holds its heads first (`writer_range`):
the engine's ``num_kv_heads`` split into ``min(t, num_kv_heads)`` equal ranges,
replicated heads (TP > KV heads) and MLA's single latent written once. A reader
at TP=r needs, for its own range, every stored range that overlaps it
(`HeadRange.overlaps`): one, or several, or part of one. Which split the store
holds is not known in advance, so a lookup tries the `partitions` in order,
the reader's own first; a chunk is a hit only under a split whose every range is
present (a head range missing is a miss, counted as a partial hit, never a load
of the wrong heads).
"""

from __future__ import annotations

from dataclasses import dataclass

from .keys import member_name


@dataclass(frozen=True, order=True)
class HeadRange:
    """KV heads ``[start, stop)`` of the model (global head indices)."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"empty or negative head range [{self.start}, {self.stop})")

    @property
    def size(self) -> int:
        return self.stop - self.start

    def member(self, num_heads: int, base: str = "kv") -> str:
        """The member name of an object of these heads (`kvpack.identity.keys.member_name`): `base` when
        it holds all `num_heads`, else ``<base>_h<start>_<stop>``."""
        whole = (self.start, self.stop) == (0, num_heads)
        return member_name(base, heads=None if whole else (self.start, self.stop))

    def overlap(self, other: HeadRange) -> HeadRange | None:
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return HeadRange(lo, hi) if lo < hi else None


def split(num_heads: int, parts: int) -> tuple[HeadRange, ...]:
    """`num_heads` in `parts` equal ranges (`parts` divides `num_heads`)."""
    if parts < 1 or num_heads % parts:
        raise ValueError(f"{num_heads} KV heads do not split into {parts} equal ranges")
    step = num_heads // parts
    return tuple(HeadRange(i * step, (i + 1) * step) for i in range(parts))


def rank_range(rank: int, tp_size: int, num_heads: int) -> HeadRange:
    """The KV heads TP rank `rank` of `tp_size` holds (vLLM's and SGLang's split: equal
    ranges, or one replicated head per group of ranks when TP > KV heads)."""
    if tp_size <= num_heads:
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} KV heads do not split over TP={tp_size}")
        step = num_heads // tp_size
        return HeadRange(rank * step, (rank + 1) * step)
    if tp_size % num_heads:
        raise ValueError(f"TP={tp_size} is not a multiple of {num_heads} KV heads")
    per = tp_size // num_heads
    head = rank // per
    return HeadRange(head, head + 1)


def writes(rank: int, tp_size: int, num_heads: int) -> bool:
    """Whether rank `rank` stores its range: the first rank holding a replicated head does."""
    return tp_size <= num_heads or rank % (tp_size // num_heads) == 0


def partitions(num_heads: int, tp_size: int) -> tuple[tuple[HeadRange, ...], ...]:
    """Every split a writer at some TP size stores, the reader's own (`tp_size`) first,
    then by number of ranges (one object per chunk first)."""
    own = min(tp_size, num_heads)
    sizes = [own] + [p for p in range(1, num_heads + 1) if num_heads % p == 0 and p != own]
    return tuple(split(num_heads, p) for p in sizes)


def sources(own: HeadRange, partition: tuple[HeadRange, ...]) -> tuple[tuple[HeadRange, HeadRange], ...]:
    """(stored range, the part of it `own` needs) for every range of `partition` overlapping `own`."""
    out = []
    for stored in partition:
        part = stored.overlap(own)
        if part is not None:
            out.append((stored, part))
    return tuple(out)


@dataclass(frozen=True)
class HeadSplit:
    """One engine's KV heads over its TP ranks (canonical objects only)."""

    num_heads: int
    """The model's KV heads (all ranks; 1 for MLA's latent)."""
    head_dim: int
    tp_size: int

    def own(self, rank: int) -> HeadRange:
        return rank_range(rank, self.tp_size, self.num_heads)

    def writes(self, rank: int) -> bool:
        return writes(rank, self.tp_size, self.num_heads)

    def member(self, heads: HeadRange, base: str = "kv") -> str:
        return heads.member(self.num_heads, base)

    def written_members(self, base: str = "kv") -> tuple[str, ...]:
        """The members this engine's ranks store for one chunk, in head order."""
        return tuple(dict.fromkeys(self.member(self.own(r), base) for r in range(self.tp_size) if self.writes(r)))

    def partitions(self) -> tuple[tuple[HeadRange, ...], ...]:
        return partitions(self.num_heads, self.tp_size)
