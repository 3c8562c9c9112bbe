"""SGLang (TP=1) loads pages a writer at another TP size stored as KV-head ranges.

A vLLM engine at TP=2 stores each chunk as two canonical objects, ``kv_h0_1`` and
``kv_h1_2`` (`kvpack.heads`). Here those objects are written the way such a writer
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

from kvpack.keys import StoreKey
from kvpack.objects import ObjectHeader
from kvpack.tiers.base import PutItem, TierStatus

pytestmark = pytest.mark.sglang


def store_as_two_ranks(backend, pool, keys: list[str], src: torch.Tensor, skip: set[tuple[int, str]] = frozenset()) -> None:  # type: ignore[no-untyped-def]
    """What a TP=2 writer stores for these pages (minus the (page, member) pairs in `skip`)."""
    binding = backend.binding("kv")
    geo = binding.canonical
    ids = binding.page_ids(src, len(keys))
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
            items.append(PutItem(StoreKey(backend.tenant, backend.group_fingerprint, key, member), header, memoryview(rows[i].numpy())))
    assert all(st is TierStatus.OK for st in backend.store.store(items))


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
        assert backend.batch_exists(keys) == n
        poison(pool)
        dst = alloc_pages(pool, n)
        assert backend.batch_get_v1(keys, dst) == [True] * n
        assert page_bytes(pool, dst) == want
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
