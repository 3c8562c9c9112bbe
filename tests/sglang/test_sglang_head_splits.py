"""SGLang (TP=1) loads pages a writer at another TP size stored as KV-head ranges.

A vLLM engine at TP=2 stores each chunk as two canonical objects, ``kv_h0_1`` and
``kv_h1_2`` (`kvpack.identity.heads`). Here those objects are written the way such a writer
writes them (canonical gathers of one head range each, their member fingerprints,
into the same disk store); then a TP=1 SGLang backend over real host pools must
find the pages (`batch_exists`), restore them bit-exact into a poisoned pool, and
stop the prefix at a page that lacks one of its ranges, never loading half its heads.
Before, the backend looked for its own ``kv`` member only: 0 pages found.
"""

from __future__ import annotations

import pytest
import torch
from sglang_parts import alloc_pages, fill_random, kvpack_extra, make_backend, make_pool, page_bytes, page_keys, poison

from kvpack.identity.keys import StoreKey
from kvpack.identity.objects import ObjectHeader
from kvpack.tiers.base import PutItem, TierStatus

pytestmark = pytest.mark.sglang


def store_as_two_ranks(
    backend, pool, keys: list[str], src: torch.Tensor, skip: set[tuple[int, str]] = frozenset()
) -> None:  # type: ignore[no-untyped-def]
    """What a TP=2 writer stores for these pages (minus the (page, member) pairs in `skip`)."""
    binding = backend.binding("kv")
    geo = binding.canonical
    ids = binding.pages.page_ids(src, len(keys))
    two_ranks = next(objects for objects in binding.sources if len(objects) == 2)
    items = []
    for obj in two_ranks:
        stored, member, fingerprint = obj.heads, obj.member, obj.fingerprint
        rows = torch.empty((len(keys), geo.object_bytes(stored.size)), dtype=torch.uint8)
        geo.copy(ids, rows.view(-1), gather=True, obj_heads=stored.size, cache_h0=stored.start, n_heads=stored.size)
        for i, key in enumerate(keys):
            if (i, member) in skip:
                continue
            header = ObjectHeader(fingerprint, backend.tenant, key, member, pool.page_size, rows.shape[1], None)
            items.append(
                PutItem(
                    StoreKey(backend.tenant, backend.group_fingerprint, key, member),
                    header,
                    memoryview(rows[i].numpy()),
                )
            )
    assert all(st is TierStatus.OK for st in backend.session.store.store(items))


def assert_found_and_restored(backend, pool, keys: list[str], want) -> None:  # type: ignore[no-untyped-def]
    """`batch_exists` finds every page, and `batch_get_v1` restores them bit-exact (`want`)
    into new pages of the poisoned pool."""
    n = len(keys)
    assert backend.batch_exists(keys) == n
    poison(pool)
    dst = alloc_pages(pool, n)
    assert backend.batch_get_v1(keys, dst) == [True] * n
    assert page_bytes(pool, dst) == want


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_pages_stored_as_two_head_ranges_are_found_and_restored(layout: str, store_dir) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool("mha", layout)  # 2 KV heads
    backend = make_backend(pool, kvpack_extra(store_dir, memory=False, disk=True))
    try:
        assert backend.binding("kv").canonical is not None
        n = 4
        fill_random(pool, seed=3)
        src = alloc_pages(pool, n)
        want = page_bytes(pool, src)
        keys = page_keys(n, seed=11)
        store_as_two_ranks(backend, pool, keys, src)
        assert_found_and_restored(backend, pool, keys, want)
    finally:
        backend.close()


def test_a_page_lacking_one_head_range_ends_the_prefix(store_dir) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool("mha", "page_first")
    backend = make_backend(pool, kvpack_extra(store_dir, memory=False, disk=True))
    try:
        n = 4
        fill_random(pool, seed=5)
        src = alloc_pages(pool, n)
        keys = page_keys(n, seed=13)
        store_as_two_ranks(backend, pool, keys, src, skip={(2, "kv_h1_2")})
        assert backend.batch_exists(keys) == 2
        poison(pool)
        dst = alloc_pages(pool, n)
        got = backend.batch_get_v1(keys, dst)
        assert got[:2] == [True, True] and got[2] is False
        page = pool.page_size
        assert set(page_bytes(pool, dst[2 * page : 3 * page])[0]) == {0xA5}  # page 2 untouched: still poisoned
    finally:
        backend.close()


def test_a_prefix_stored_by_two_tp_sizes_is_found_and_restored_whole(store_dir) -> None:  # type: ignore[no-untyped-def]
    """A fleet that moved from TP=2 to TP=1 between two turns of a conversation: the first
    pages are two head-range objects each, the later ones one object of all heads. Each
    page is read from the split that holds it (`kvpack.policy.split_lookup`); a lookup that took
    one split for the whole prefix found 2 of the 4 pages, on every later turn."""
    pool = make_pool("mha", "page_first")
    extra = kvpack_extra(store_dir, memory=False, disk=True)
    n, page = 4, pool.page_size
    fill_random(pool, seed=7)
    src = alloc_pages(pool, n)
    want = page_bytes(pool, src)
    keys = page_keys(n, seed=17)
    writer = make_backend(pool, extra)
    try:
        store_as_two_ranks(writer, pool, keys[:2], src[: 2 * page])  # turn 1, at TP=2
        assert writer.batch_set_v1(keys[2:], src[2 * page :]) == [True, True]  # turn 2, at TP=1
    finally:
        writer.close()
    reader = make_backend(pool, extra)
    try:
        assert_found_and_restored(reader, pool, keys, want)
    finally:
        reader.close()


# -- SGLang itself at TP > 1 -------------------------------------------------------------
#
# A rank's host pool holds its KV heads (4 model heads: 2 per rank at TP=2). The pools
# below are filled the way SGLang fills them, head slices of one model pool (the head
# axis is the pool buffer's second to last in every host layout), never through kvpack.


def _rank_pools(layout: str, n: int, seed: int):  # type: ignore[no-untyped-def]
    """The model's pool (4 heads), its TP=2 ranks' pools (heads 0-1, 2-3), n pages of each."""
    full = make_pool("mha", layout, heads=4)
    fill_random(full, seed=seed)
    ranks = [make_pool("mha", layout, heads=2) for _ in range(2)]
    for r, pool in enumerate(ranks):
        pool.kv_buffer.copy_(full.kv_buffer[..., 2 * r : 2 * r + 2, :])
    pages = [alloc_pages(p, n) for p in [full, *ranks]]
    assert all(torch.equal(pages[0], p) for p in pages[1:])
    return full, ranks, pages[0]


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_an_sglang_tp2_store_is_restored_by_tp1_and_the_reverse(layout: str, store_dir) -> None:  # type: ignore[no-untyped-def]
    n = 3
    full, ranks, src = _rank_pools(layout, n, seed=21)
    keys, other = page_keys(n, seed=22), page_keys(n, seed=23)
    extra = kvpack_extra(store_dir, memory=False, disk=True)
    for r, pool in enumerate(ranks):  # TP=2 writes: each rank its head range
        backend = make_backend(pool, extra, tp_rank=r, tp_size=2)
        try:
            assert backend.binding("kv").canonical is not None
            assert backend.binding("kv").member == f"kv_h{2 * r}_{2 * r + 2}"
            assert backend.batch_set_v1(keys, src) == [True] * n
        finally:
            backend.close()
    writer = make_backend(full, extra)  # TP=1 writes other pages: one object of all heads
    try:
        assert writer.binding("kv").member == "kv"
        assert writer.batch_set_v1(other, src) == [True] * n
    finally:
        writer.close()

    reader = make_pool("mha", layout, heads=4)
    poison(reader)
    dst = alloc_pages(reader, n)
    backend = make_backend(reader, extra)  # TP=1 reads the TP=2 store
    try:
        assert backend.batch_exists(keys) == n
        assert backend.batch_get_v1(keys, dst) == [True] * n
        assert page_bytes(reader, dst) == page_bytes(full, src)
    finally:
        backend.close()
    for r in range(2):  # each TP=2 rank reads its heads out of the TP=1 objects
        pool = make_pool("mha", layout, heads=2)
        poison(pool)
        dst = alloc_pages(pool, n)
        backend = make_backend(pool, extra, tp_rank=r, tp_size=2)
        try:
            assert backend.batch_exists(other) == n
            assert backend.batch_get_v1(other, dst) == [True] * n
            assert page_bytes(pool, dst) == page_bytes(ranks[r], src)
        finally:
            backend.close()


def test_replicated_heads_are_written_once_and_an_unknown_count_stays_native(store_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One KV head at TP=2: both ranks hold head 0. SGLang's storage config does not say how
    many heads the model has; kvpack reads the checkpoint's config.json. Without it, a rank
    of one head cannot tell a 2-head model from a replicated 1-head one: native objects."""
    import json

    model = tmp_path / "one-kv-head"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 1})
    )
    n = 2
    pools = [make_pool("mha", "page_first", heads=1) for _ in range(2)]
    fill_random(pools[0], seed=31)
    pools[1].kv_buffer.copy_(pools[0].kv_buffer)
    src = [alloc_pages(p, n) for p in pools][0]
    keys = page_keys(n, seed=32)
    extra = kvpack_extra(store_dir, memory=False, disk=True)
    for r in (1, 0):  # the second rank first: it stores nothing
        backend = make_backend(pools[r], extra, tp_rank=r, tp_size=2, model=str(model))
        try:
            binding = backend.binding("kv")
            assert binding.canonical is not None and binding.member == "kv" and binding.writes == (r == 0)
            assert backend.batch_set_v1(keys, src) == [True] * n
            assert backend.batch_exists(keys) == (0 if r == 1 else n)
        finally:
            backend.close()
    reader = make_pool("mha", "page_first", heads=1)
    poison(reader)
    dst = alloc_pages(reader, n)
    backend = make_backend(reader, extra, model=str(model))  # TP=1 of the same model
    try:
        assert backend.batch_get_v1(keys, dst) == [True] * n
        assert page_bytes(reader, dst) == page_bytes(pools[0], src)
    finally:
        backend.close()
    unknown = make_backend(
        make_pool("mha", "page_first", heads=1), extra, tp_rank=0, tp_size=2
    )  # model "kvpack-tiny": no checkpoint
    try:
        assert unknown.binding("kv").canonical is None
    finally:
        unknown.close()
