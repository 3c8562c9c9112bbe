"""v2 multi-pool contract: draft sidecars, hit policies, partial hits by member.

The headline failure this guards against: a tiered-cache "hit" that restored the
target KV but not the draft model's state (accept length 4.5 -> 1.6, no error).
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer
from sglang_parts import (
    alloc_pages,
    fill_random,
    kvpack_extra,
    make_backend,
    make_pool,
    mha_pool,
    page_bytes,
    page_keys,
    poison,
    storage_config,
)

pytestmark = pytest.mark.sglang


def _draft_transfer(keys, idx=None, policy=PoolHitPolicy.ALL_PAGES, name=PoolName.DRAFT):
    return PoolTransfer(name=name, host_indices=idx, keys=list(keys), hit_policy=policy, indices_from_pool=PoolName.KV)


def _with_draft(store_dir, **extra):
    kv = make_pool("mha", "page_first")
    draft = mha_pool("page_first", layers=1, heads=1, head_dim=64, pool_label="draft")  # EAGLE-style: own layout
    backend = make_backend(kv, kvpack_extra(store_dir, **extra))
    backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    return kv, draft, backend


@pytest.mark.parametrize("tiers", [dict(memory=True, disk=False), dict(memory=False, disk=True)])
def test_draft_sidecar_full_vs_partial_hit(tiers, store_dir):
    kv, draft, backend = _with_draft(store_dir, **tiers)
    try:
        assert backend.binding(PoolName.DRAFT).member == "draft"
        fill_random(kv, seed=1)
        fill_random(draft, seed=2)
        n = 4
        a, b = page_keys(n, seed=10), page_keys(n, seed=20)
        a_idx, b_idx = alloc_pages(kv, n), alloc_pages(kv, n)
        want_kv, want_draft = page_bytes(kv, a_idx), page_bytes(draft, a_idx)
        # prefix A: target + draft; prefix B: target only
        assert backend.batch_set_v1(a, a_idx) == [True] * n
        assert backend.batch_set_v2([_draft_transfer(a, a_idx)]) == {PoolName.DRAFT: [True] * n}
        assert backend.batch_set_v1(b, b_idx) == [True] * n
        assert backend.flush(10)

        full = backend.batch_exists_v2(a, [_draft_transfer(a)])
        assert full.kv_hit_pages == n and full.restorable_prefix_pages == list(range(1, n + 1))
        assert full.extra_pool_hit_pages[PoolName.DRAFT] == n

        partial_before = backend.session.report.metrics.value("partial_hits", missing_member="draft")
        part = backend.batch_exists_v2(b, [_draft_transfer(b)])
        assert part.kv_hit_pages == 0 and part.restorable_prefix_pages == []
        assert PoolName.DRAFT not in part.extra_pool_hit_pages
        assert backend.session.report.metrics.value("partial_hits", missing_member="draft") == partial_before + n
        # v1 lookups see the registered draft pool too: a KV-only prefix is not a hit
        assert backend.batch_exists(a) == n and backend.batch_exists(b) == 0

        poison(kv)
        poison(draft)
        dst = alloc_pages(kv, n)
        assert backend.batch_get_v1(a, dst) == [True] * n
        assert backend.batch_get_v2([_draft_transfer(a, dst)]) == {PoolName.DRAFT: [True] * n}
        assert page_bytes(kv, dst) == want_kv and page_bytes(draft, dst) == want_draft
        assert backend.batch_get_v2([_draft_transfer(b, dst)]) == {PoolName.DRAFT: [False] * n}
    finally:
        backend.close()


def test_target_only_policy_reports_target_prefix_and_counts_partial(store_dir):
    kv, draft, backend = _with_draft(store_dir, draft_policy="target_only")
    try:
        fill_random(kv, seed=3)
        keys = page_keys(3, seed=30)
        assert backend.batch_set_v1(keys, alloc_pages(kv, 3)) == [True] * 3
        res = backend.batch_exists_v2(keys, [_draft_transfer(keys)])
        assert res.kv_hit_pages == 3
        assert PoolName.DRAFT not in res.extra_pool_hit_pages  # never reported as restorable for the draft
        assert backend.session.report.metrics.value("partial_hits", missing_member="draft") == 3
    finally:
        backend.close()


def test_no_draft_pool_means_no_draft_member(store_dir):
    """Without speculative decoding there is no extra object and no extra lookup member."""
    kv = make_pool("mha", "page_first")
    backend = make_backend(kv, kvpack_extra(store_dir, disk=False))
    try:
        fill_random(kv, seed=4)
        keys = page_keys(2, seed=40)
        assert backend.batch_set_v1(keys, alloc_pages(kv, 2)) == [True, True]
        assert backend.batch_exists(keys) == 2
        assert backend.session.store.tiers[0].usage().objects == 2
        assert backend.session.report.metrics.value("partial_hits") == 0
    finally:
        backend.close()


def _swa_scenario(set_kv, set_swa):
    """6 KV pages; the SWA state (window 2) stored only for pages 2, 3 and 5."""
    keys = page_keys(6, seed=50)
    set_kv(keys)
    set_swa([keys[i] for i in (2, 3, 5)], [2, 3, 5])
    return keys


@pytest.mark.parametrize("interface", ["v1", "generic"])
def test_trailing_pages_pool_matches_sglang_file_backend(store_dir, tmp_path, interface):
    """kvpack's hits with a TRAILING_PAGES pool equal SGLang's `file` backend's, on either of
    SGLang's KV paths (generic: the KV pages are whole flat pages, as `file` stores them)."""
    kv = make_pool("mha", "page_first")
    swa = mha_pool("page_first", layers=1, pool_label="swa")
    fill_random(kv, seed=5)
    fill_random(swa, seed=6)
    idx = alloc_pages(kv, 6)
    ps = kv.page_size

    def pages(sel):
        return torch.cat([idx[i * ps : (i + 1) * ps] for i in sel])

    backend = make_backend(kv, kvpack_extra(store_dir, zero_copy=interface == "v1"))
    backend.register_mem_host_pool_v2(swa, PoolName.SWA)
    ref = HiCacheFile(storage_config({}), file_path=str(tmp_path / "sglang-file"))
    ref.register_mem_pool_host(kv)
    ref.register_mem_host_pool_v2(swa, PoolName.SWA)
    try:

        def set_kv(keys):
            flat = [kv.get_data_page(int(idx[i * ps])) for i in range(6)]
            if interface == "v1":
                assert backend.batch_set_v1(keys, idx) == [True] * 6
            else:
                assert backend.batch_set(keys, flat) is True
            assert ref.batch_set(keys, flat)

        def set_swa(keys, sel):
            t = [
                PoolTransfer(
                    name=PoolName.SWA, host_indices=pages(sel), keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES
                )
            ]
            assert backend.batch_set_v2(t)[PoolName.SWA] == [True] * 3
            assert ref.batch_set_v2(t)[PoolName.SWA] == [True] * 3

        keys = _swa_scenario(set_kv, set_swa)
        backend.flush(10)
        query = [PoolTransfer(name=PoolName.SWA, keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        ours, theirs = backend.batch_exists_v2(keys, query), ref.batch_exists_v2(keys, query)
        assert ours.restorable_prefix_pages == theirs.restorable_prefix_pages == [4]
        assert ours.kv_hit_pages == theirs.kv_hit_pages == 4
        assert ours.extra_pool_hit_pages[PoolName.SWA] == theirs.extra_pool_hit_pages[PoolName.SWA] == 4

        # window 1: every page whose own state is stored is a stop point (3, 4, 6)
        one = [PoolTransfer(name=PoolName.SWA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        assert (
            backend.batch_exists_v2(keys, one).restorable_prefix_pages
            == ref.batch_exists_v2(keys, one).restorable_prefix_pages
            == [3, 4, 6]
        )
    finally:
        backend.close()


def test_all_pages_state_pool_shrinks_the_hit(store_dir):
    kv = make_pool("mha", "page_first")
    idxr = mha_pool("page_first", layers=1, pool_label="indexer")
    backend = make_backend(kv, kvpack_extra(store_dir, disk=False))
    backend.register_mem_host_pool_v2(idxr, PoolName.INDEXER)
    try:
        fill_random(kv, seed=7)
        keys = page_keys(5, seed=60)
        idx = alloc_pages(kv, 5)
        ps = kv.page_size
        assert backend.batch_set_v1(keys, idx) == [True] * 5
        t = [PoolTransfer(name=PoolName.INDEXER, host_indices=idx[: 2 * ps], keys=keys[:2])]
        assert backend.batch_set_v2(t)[PoolName.INDEXER] == [True, True]
        res = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys)])
        assert res.kv_hit_pages == 2
        # a state pool is part of the target: the hit is simply shorter, not a partial (draft) hit
        assert backend.session.report.metrics.value("partial_hits") == 0
    finally:
        backend.close()


def test_unregistered_pool_is_a_miss_not_an_error(store_dir):
    kv = make_pool("mha", "page_first")
    backend = make_backend(kv, kvpack_extra(store_dir, disk=False))
    try:
        keys = page_keys(2, seed=70)
        idx = alloc_pages(kv, 2)
        assert backend.batch_set_v2([_draft_transfer(keys, idx)]) == {PoolName.DRAFT: [False, False]}
        assert backend.batch_get_v2([_draft_transfer(keys, idx)]) == {PoolName.DRAFT: [False, False]}
        assert backend.batch_exists_v2(keys, [_draft_transfer(keys)]).kv_hit_pages == 0
    finally:
        backend.close()
