"""The SGLang backend on the Mooncake tier: a real master + segment holder on 127.0.0.1.

Kept apart from the other SGLang tests: they pass without Mooncake; these skip
when the Mooncake package (or the fixture) is missing.
"""

from __future__ import annotations

import pytest
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang_parts import (
    DYNAMIC,
    alloc_pages,
    fill_random,
    make_backend,
    make_pool,
    mha_pool,
    page_bytes,
    page_keys,
    poison,
)
from sglang_shared import write_then_read_elsewhere

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]


def _extra(cluster) -> dict:
    extra = dict(DYNAMIC)
    extra.update(cluster.kvpack_config().to_dict())
    return extra


def test_mooncake_tier_shared_across_processes(mooncake_cluster, tmp_path):
    seen = write_then_read_elsewhere(_extra(mooncake_cluster), tmp_path, "mha", "page_first")
    assert seen["exists"] == 6 and seen["bit_exact"]


def test_draft_sidecar_round_trip_on_mooncake(mooncake_cluster):
    kv = make_pool("mha", "page_first_direct")
    draft = mha_pool("page_first_direct", layers=1, heads=1, pool_label="draft")
    backend = make_backend(kv, _extra(mooncake_cluster))
    backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    try:
        assert backend.wait_ready(20)
        fill_random(kv, seed=1)
        fill_random(draft, seed=2)
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        a, b = page_keys(3, seed=101), page_keys(3, seed=102)
        ia, ib = alloc_pages(kv, 3), alloc_pages(kv, 3)
        want_kv, want_draft = page_bytes(kv, ia), page_bytes(draft, ia)
        assert backend.batch_set_v1(a, ia) == [True] * 3
        assert (
            backend.batch_set_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=ia, keys=a)])[PoolName.DRAFT]
            == [True] * 3
        )
        assert backend.batch_set_v1(b, ib) == [True] * 3  # target only
        assert backend.flush(20)
        q = lambda keys: [PoolTransfer(name=PoolName.DRAFT, keys=keys, indices_from_pool=PoolName.KV)]  # noqa: E731
        assert backend.batch_exists_v2(a, q(a)).kv_hit_pages == 3
        assert backend.batch_exists_v2(b, q(b)).kv_hit_pages == 0
        assert backend.session.report.metrics.value("partial_hits", missing_member="draft") == 3
        poison(kv)
        poison(draft)
        dst = alloc_pages(kv, 3)
        assert backend.batch_get_v1(a, dst) == [True] * 3
        assert (
            backend.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=dst, keys=a)])[PoolName.DRAFT]
            == [True] * 3
        )
        assert page_bytes(kv, dst) == want_kv and page_bytes(draft, dst) == want_draft
    finally:
        backend.close()


def test_a_new_backends_first_lookup_finds_the_clusters_pages(mooncake_cluster):
    """A new SGLang process asks HiCache's first `batch_exists` while its Mooncake tier is
    still connecting (construction never blocks): the prefetch thread waits for that first
    connect (bounded by connect_wait_ms) instead of missing pages the cluster holds."""
    pool = make_pool("mha", "page_first")
    writer = make_backend(pool, _extra(mooncake_cluster))
    try:
        assert writer.wait_ready(20)
        fill_random(pool, seed=5)
        keys = page_keys(4, seed=501)
        assert writer.batch_set_v1(keys, alloc_pages(pool, 4)) == [True] * 4
    finally:
        writer.close()  # cleanup only: batch_set wrote through to the cluster before it returned True
    reader = make_backend(make_pool("mha", "page_first"), _extra(mooncake_cluster))
    try:
        assert reader.batch_exists(keys) == 4  # 0 before: the tier answered UNAVAILABLE
    finally:
        reader.close()
