"""Lent copies (`kvpack.store.reader`, `kvpack.store.writer`): saves written straight into the memory tier's slots, loads read
straight out of them, over real tiers; what the other tiers get is unchanged.

A lent save must store exactly what `fill` wrote, on every tier, show nothing when `fill`
raises, and keep a refused object's bytes for the lower tiers; a lent load must hand back
the stored bytes without touching the caller's buffer and read the rest the ordinary way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from fixtures.builders import GROUP_FP, MEMBER_FP, TOKENS, chunk_id, header, key
from kvpack import KVPackConfig, KVStore, MemberObject, PagePart, Session
from kvpack.tiers.base import PutItem, TierStatus
from kvpack.tiers.factory import build_tiers

PAGE = 4096
KV = MemberObject("kv", MEMBER_FP, TOKENS, PAGE)


@pytest.fixture
def make_session(tmp_path: Path) -> Iterator[Callable[..., Session]]:
    opened: list[KVStore] = []

    def make(memory: bool = True, disk: bool = True, capacity: int = 1 << 20, **more: object) -> Session:
        config = KVPackConfig.from_dict(
            {
                "memory": {"enabled": memory, "capacity": capacity},
                "disk": {"enabled": disk, "path": str(tmp_path / "disk")},
                **more,
            }
        )
        store = KVStore(config, build_tiers(config), write_back=False)
        opened.append(store)
        return Session(store, GROUP_FP)

    yield make
    for store in reversed(opened):
        store.close()


def _pages(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(n)]


def _filler(pages: Sequence[np.ndarray], seen: list[list[int]]) -> Callable[[Sequence[int], list[np.ndarray]], None]:
    def fill(todo: Sequence[int], dsts: list[np.ndarray]) -> None:
        seen.append(list(todo))
        for i, dst in zip(todo, dsts):
            assert dst.nbytes == PAGE and dst.flags.writeable
            dst[:] = pages[i]

    return fill


def _read(session: Session, chunks: list[str]) -> tuple[list[bool], list[bytes]]:
    """Ordinary loads into fresh buffers (every tier, read-through)."""
    bufs = [np.zeros(PAGE, dtype=np.uint8) for _ in chunks]
    res = session.complete_load(
        session.prepare_load(session.page_reads("default", KV, chunks, [b.data for b in bufs]))
    ).results
    return [r.ok for r in res], [b.tobytes() for b in bufs]


@pytest.mark.parametrize("tiers", [dict(memory=True, disk=False), dict(memory=True, disk=True)])
def test_a_lent_save_stores_what_fill_wrote_and_only_what_is_not_stored(make_session, tiers):
    session = make_session(**tiers)
    assert session.tiers.lends_slots
    pages = _pages(6, seed=1)
    chunks = [chunk_id(i) for i in range(6)]
    seen: list[list[int]] = []
    assert session.save_pages("default", KV, chunks[:3], fill=_filler(pages, seen)) == [True] * 3
    assert session.save_pages("default", KV, chunks, fill=_filler(pages, seen)) == [True] * 6
    assert seen == [[0, 1, 2], [3, 4, 5]]  # the second save filled only what was not stored
    ok, got = _read(session, chunks)
    assert ok == [True] * 6 and got == [p.tobytes() for p in pages]
    if tiers["disk"]:  # the disk tier got the same bytes, checksummed: a reader without memory loads them
        reader = make_session(memory=False, disk=True)
        ok, got = _read(reader, chunks)
        assert ok == [True] * 6 and got == [p.tobytes() for p in pages]


def test_a_fill_that_raises_stores_nothing(make_session):
    session = make_session(disk=False)
    chunks = [chunk_id(i) for i in range(3)]

    def broken(todo: Sequence[int], dsts: list[np.ndarray]) -> None:
        dsts[0][:] = 7
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        session.save_pages("default", KV, chunks, fill=broken)
    assert session.store.contains_members("default", session.group_fingerprint, chunks, ["kv"]) == [{"kv": False}] * 3
    # and the pages may be stored later (their preparation ended)
    pages = _pages(3, seed=2)
    assert session.save_pages("default", KV, chunks, fill=_filler(pages, [])) == [True] * 3


def test_an_object_memory_refuses_still_reaches_the_disk(make_session):
    # a memory tier smaller than one object admits none: the lent save fills fresh arrays for the disk
    session = make_session(capacity=PAGE // 2)
    pages = _pages(2, seed=3)
    chunks = [chunk_id(i) for i in range(2)]
    assert session.save_pages("default", KV, chunks, fill=_filler(pages, [])) == [True, True]
    assert session.store.in_memory(session._keys("default", chunks, "kv")) == [False, False]
    ok, got = _read(make_session(memory=False), chunks)
    assert ok == [True, True] and got == [p.tobytes() for p in pages]


def test_without_lending_the_verbs_copy(make_session):
    session = make_session(memory=False)  # no memory tier: nothing to lend
    assert not session.tiers.lends_slots
    pages = _pages(2, seed=4)
    chunks = [chunk_id(i) for i in range(2)]
    assert session.save_pages("default", KV, chunks, fill=_filler(pages, [])) == [True, True]
    bufs = [np.zeros(PAGE, dtype=np.uint8) for _ in chunks]
    load = session.complete_load(
        session.prepare_load(session.page_reads("default", KV, chunks, [b.data for b in bufs])), lend=True
    )
    results, views = load.results, load.views
    assert [r.ok for r in results] == [True, True] and views == [None, None]
    assert [b.tobytes() for b in bufs] == [p.tobytes() for p in pages]


def test_a_lent_load_hands_out_memory_copies_and_reads_the_rest(make_session):
    session = make_session(disk=True)
    pages = _pages(4, seed=5)
    chunks = [chunk_id(i) for i in range(4)]
    assert session.save_pages("default", KV, chunks, fill=_filler(pages, [])) == [True] * 4
    keys = session._keys("default", chunks, "kv")
    session.store.tiers[0].remove_groups([keys[1].group, keys[3].group])  # only the disk holds pages 1 and 3
    bufs = [np.zeros(PAGE, dtype=np.uint8) for _ in chunks]
    load = session.complete_load(
        session.prepare_load(
            session.page_reads(
                "default", KV, chunks + [chunk_id(9)], [b.data for b in bufs] + [np.zeros(PAGE, dtype=np.uint8).data]
            )
        ),
        lend=True,
    )
    results, views = load.results, load.views
    assert [r.ok for r in results] == [True, True, True, True, False]
    assert [v is not None for v in views] == [True, False, True, False, False]
    for i in (0, 2):
        assert bytes(views[i]) == pages[i].tobytes() and views[i].readonly  # type: ignore[arg-type,union-attr]
        assert not bufs[i].any()  # the caller's buffer was left as it was
    for i in (1, 3):
        assert bufs[i].tobytes() == pages[i].tobytes()
    # a view outlives its object: the slot is not reused while it is held
    held = bytes(views[0])  # type: ignore[arg-type]
    session.store.tiers[0].remove_groups([keys[0].group])
    more = _pages(8, seed=6)
    session.save_pages("default", KV, [chunk_id(20 + i) for i in range(8)], fill=_filler(more, []))
    assert bytes(views[0]) == held  # type: ignore[arg-type]


def test_checksum_always_turns_lending_off(make_session):
    session = make_session(checksum="always")
    assert not session.tiers.lends_slots


def test_lent_verbs_count_bytes_and_objects_per_tenant(make_session):
    """One count per tenant of a batch, summing every object of it: stored_objects,
    stored_bytes (the memory tier's admitted objects), store_dropped (per reason) and
    loaded_bytes (what was lent)."""
    session = make_session(disk=False, capacity=5 * PAGE)
    metrics = session.store.metrics
    pages = _pages(3, seed=7)
    for tenant in ("alice", "bob"):
        assert session.save_pages(tenant, KV, [chunk_id(i) for i in range(3)], fill=_filler(pages, [])) == [True] * 3
    assert metrics.value("stored_objects", tenant="alice", tier="memory") == 3
    assert metrics.value("stored_bytes", tenant="alice", tier="memory") == 3 * PAGE
    assert metrics.value("stored_bytes", tenant="bob", tier="memory") == 3 * PAGE
    assert metrics.value("store_dropped", tier="memory") == 0
    chunks = [chunk_id(i) for i in range(3)]
    load = session.complete_load(
        session.prepare_load(session.page_reads("bob", KV, chunks, [np.zeros(PAGE, np.uint8).data for _ in chunks])),
        lend=True,
    )
    views = load.views
    lent = sum(v is not None for v in views)
    assert lent >= 1 and metrics.value("loaded_bytes", tenant="bob", tier="memory") == lent * PAGE
    big = MemberObject("kv", MEMBER_FP, TOKENS, 8 * PAGE)  # larger than the whole tier: dropped, counted once each

    def fill(todo: Sequence[int], dsts: list[np.ndarray]) -> None:
        for d in dsts:
            d[:] = 1

    assert session.save_pages("carol", big, [chunk_id(10), chunk_id(11)], fill=fill) == [False, False]
    assert metrics.value("store_dropped", tier="memory") == 2
    assert metrics.value("stored_objects", tenant="carol", tier="memory") == 0


OTHER_FP = "f" * 64


def _mixed_batch(session: Session) -> tuple[list[str], list[bytes | None]]:
    """Pages of tenant ``t`` in one batch, good ones beside every refusal a load makes, and
    the bytes each page must load (None: a miss). Bad headers are put on the tiers as they
    are (a writer of another layout or tenant, a damaged object)."""
    memory, disk = session.store.tiers
    chunks = [chunk_id(40 + i) for i in range(11)]
    pages = _pages(11, seed=11)
    good = [0, 2]
    assert session.save_pages("t", KV, [chunks[i] for i in good], fill=_filler([pages[i] for i in good], [])) == [
        True,
        True,
    ]

    def put(tier, i: int, **changed: object) -> None:
        fields: dict[str, object] = dict(payload_len=PAGE, fingerprint=MEMBER_FP)
        fields.update(changed)
        tenant = str(fields.pop("tenant", "t"))
        chunk = str(fields.pop("chunk", chunks[i]))
        head = header(tenant, chunk, str(fields.pop("member", "kv")), **fields)  # type: ignore[arg-type]
        assert tier.put_from([PutItem(key(chunks[i], tenant="t"), head, pages[i].data)]) == [TierStatus.OK]

    put(memory, 1, fingerprint=OTHER_FP)  # another layout's object under this key
    put(memory, 3, tenant="u")  # another tenant's
    put(memory, 4, chunk=chunks[5])  # damaged: another chunk's header
    put(memory, 5, token_count=TOKENS + 1)
    put(memory, 6, member="draft")
    put(disk, 7)  # good, on the disk only
    put(disk, 8, checksum=12345)  # damaged on the disk: its checksum does not match
    put(memory, 10, fingerprint=OTHER_FP)  # refused in memory, good on the disk
    put(disk, 10)
    want = [pages[i].tobytes() if i in (0, 2, 7, 10) else None for i in range(11)]
    return chunks, want


def _refusals(session: Session) -> dict[str, float]:
    metrics = session.store.metrics
    reasons = ("fingerprint", "tenant", "group", "token_count", "member", "checksum", "length")
    out = {
        f"{tier}/{r}": metrics.value("rejected_objects", tier=tier, reason=r)
        for tier in ("memory", "disk")
        for r in reasons
    }
    out["failures"] = metrics.value("load_failures", tenant="t", status="miss") + metrics.value(
        "load_failures", tenant="t", status="rejected"
    )
    out["lent_bytes"] = metrics.value("loaded_bytes", tenant="t", tier="memory")
    return out


def test_a_batch_of_pages_refuses_exactly_what_the_per_page_load_refuses(tmp_path: Path):
    """`load_pages` (`PageReads`, `complete_load_pages_lent`: one expectation per batch) and
    the per-page `complete_load_lent` (an `Expectation` and a `LoadItem` per page) over the
    same tiers: good pages beside a fingerprint mismatch, another tenant's object, damaged
    objects in memory and on disk, a token count and a member mismatch, a miss. Same
    verdicts, same bytes, same counted refusals, same damaged groups removed."""
    sessions = []
    for name in ("per_page", "batched"):  # each its own disk folder: nothing of one is seen by the other
        config = KVPackConfig.from_dict({"memory": {"capacity": 1 << 20}, "disk": {"path": str(tmp_path / name)}})
        sessions.append(Session(KVStore(config, build_tiers(config), write_back=False), GROUP_FP))
    per_page, batched = sessions
    assert per_page.tiers.lends_slots and batched.tiers.lends_slots
    seen: dict[str, tuple[list[bool], list[bool], list[bytes | None], dict[str, float], list[bool]]] = {}
    for name, session in (("per_page", per_page), ("batched", batched)):
        chunks, want = _mixed_batch(session)
        bufs = [np.zeros(PAGE, dtype=np.uint8) for _ in chunks]
        if name == "per_page":
            load = session.complete_load(
                session.prepare_load(session.page_reads("t", KV, chunks, [b.data for b in bufs])), lend=True
            )
            results, views = load.results, load.views
            ok = [r.ok for r in results]
        else:
            got: list[tuple[list[bool], list[memoryview | None]]] = []
            part = PagePart(
                list(range(len(chunks))),
                session.page_reads("t", KV, chunks, [b.data for b in bufs]),
                lambda o, v: got.append((list(o), list(v))),
            )
            ok = session.load_pages([part], len(chunks), lent=True, tenant="t")
            assert len(got) == 1 and got[0][0] == ok
            views = got[0][1]
        loaded = [(bytes(v) if v is not None else b.tobytes()) if good else None for good, v, b in zip(ok, views, bufs)]
        assert loaded == want, name
        # what each tier still holds of the refused pages (damaged groups removed from both); of the
        # loaded ones memory differs by design: `load_pages` does not promote a disk hit into it
        in_memory = session.store.tiers[0].contains(session._keys("t", chunks, "kv"))
        kept = [held for held, good in zip(in_memory, ok) if not good] + session.store.tiers[1].contains(
            session._keys("t", chunks, "kv")
        )
        seen[name] = (ok, [v is not None for v in views], loaded, _refusals(session), kept)
    for session in sessions:
        session.close()
    assert seen["batched"] == seen["per_page"]
    ok, lent, _, refused, _ = seen["batched"]
    assert ok == [True, False, True, False, False, False, False, True, False, False, True]
    assert lent == [True] + [False, True] + [False] * 8
    assert refused["memory/fingerprint"] == 2 and refused["memory/tenant"] == 1 and refused["memory/group"] == 1
    assert refused["memory/token_count"] == 1 and refused["memory/member"] == 1 and refused["disk/checksum"] == 1
    assert refused["lent_bytes"] == 2 * PAGE
