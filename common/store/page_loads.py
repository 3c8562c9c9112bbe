"""Page batches an adapter loads as several objects per page: which head split a lookup
found each page under, and one load of all of a batch's objects where a page counts as
restored only when every object of it loaded.

An engine's host page may be restored from more than one object: a pool's own member,
or (canonical KV stored at another TP size, `kvpack.identity.heads`) one object per stored head
range. The adapter builds one `PagePart` per such object set (`PageReads`: the batch's
keys, buffers and one expectation, no per-page objects); `load_pages` reads them all in
one plan (`Reader.prepare_load`, then `complete_load`, or `complete_load_pages_lent`)
and calls each part's `finish` with its pages' verdicts, so a page half-restored is
never reported as restored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..identity.keys import StoreKey
from .reader import LentLoad, Reader
from .reads import PageReads

Finish = Callable[[Sequence[bool], Sequence[memoryview | None]], None]
"""What a part's buffers do once loaded: per page of the part, restored or not, and the
stored payload lent in place of a copy (None where the item's buffer was filled)."""


@dataclass(frozen=True, eq=False)
class PagePart:
    """One object per page of `pages` (indices into the batch): page j of `reads` restores
    page ``pages[j]``; `finish` is called once with those pages' verdicts (`Finish`)."""

    pages: list[int]
    reads: PageReads
    finish: Finish


def located_splits(
    were_located: Callable[[Sequence[str], str], list[bool]], chunks: Sequence[str], members: Sequence[str]
) -> list[int]:
    """Per chunk, the index into `members` of the first member a lookup found it under
    (`were_located(chunks, member)`; `members[0]`: the engine's own; 0 also for chunks no
    lookup found). One batched look per member, only for chunks not placed yet."""
    out = [0] * len(chunks)
    if not members:
        return out
    rest = [i for i, own in enumerate(were_located(chunks, members[0])) if not own]
    for split, member in enumerate(members[1:], start=1):
        if not rest:
            break
        found = were_located([chunks[i] for i in rest], member)
        for i, hit in zip(rest, found):
            if hit:
                out[i] = split
        rest = [i for i, hit in zip(rest, found) if not hit]
    return out


def load_pages(
    reader: Reader, located: Mapping[StoreKey, str], parts: Sequence[PagePart], pages: int, *, lent: bool, tenant: str
) -> list[bool]:
    """Load every part in one plan (`Reader.prepare_load` of `located`: where a lookup found each
    object, then `complete_load`, or `complete_load_pages_lent` when `lent`: the memory tier's and
    the host store's payloads are lent, not copied; a page whose host-store view changed while its
    part's `finish` copied it is not restored: `LentLoad.lost`), each object from the tier the
    lookup found it in; per page of the batch (`pages` of them), True when every object of it
    loaded. Each part's `finish` runs after all reads, with its pages' verdicts. The bytes lent
    and kept are counted as ``loaded_in_place_bytes`` of `tenant`.

    A page read from a lower tier is not promoted into this process's memory tier: it lands in
    the engine's own host-memory cache (SGLang's L2 host pool), which holds it from now on, so a
    copy in the memory tier would be a third one in the same process, made on the prefetch's
    path. What the engine writes back (`save_pages`) still goes to the memory tier."""
    reads = [part.reads for part in parts]
    plan = reader.prepare_load(located)
    if lent:
        load = reader.complete_load_pages_lent(plan, reads, promote=False)
    else:
        load = LentLoad.copied(reader.complete_load(plan, [item for r in reads for item in r.items()], promote=False))
    loaded = load.ok
    ok = [True] * pages
    page_of: list[int] = []  # the batch's page of each object, in load order
    at = 0
    for part in parts:
        n = len(part.reads)
        page_of.extend(part.pages)
        if not all(loaded[at : at + n]):
            for p, good in zip(part.pages, loaded[at : at + n]):
                ok[p] = good and ok[p]
        at += n
    at = 0
    for part in parts:
        n = len(part.reads)
        part.finish([ok[p] for p in part.pages], load.views[at : at + n])
        at += n
    if lent:  # a host-store view rewritten while `finish` copied it: that page is a miss
        lost = set(load.lost())
        in_place = 0
        for i, (view, p) in enumerate(zip(load.views, page_of)):
            ok[p] = ok[p] and i not in lost
            in_place += view.nbytes if view is not None and ok[p] else 0
        if in_place:
            reader.metrics.inc("loaded_in_place_bytes", in_place, tenant=tenant)
    return ok
