"""The SGLang backend over the core's lifecycle verbs (`kvpack.store.lifecycle`).

- `batch_exists_v2` answers from the core's `resolve_lookup` (pools as members,
  TRAILING_PAGES as `Coverage.TRAILING`): the answers below are the ones the
  adapter's own window and draft-policy code gave before it was removed
  (kv_hit_pages, extra_pool_hit_pages, restorable_prefix_pages), for a target
  and a draft sliding-window pool and an ALL_PAGES draft pool, under both
  draft policies.
- A page a lookup found in memory and that memory evicted before the get is
  counted as ``evicted_before_load{tier="memory"}`` (and read from disk when
  disk has it).
- `batch_set` stores only what `prepare_store` says is missing.
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
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
)

pytestmark = pytest.mark.sglang

TRAILING = PoolHitPolicy.TRAILING_PAGES


def _pages(idx: torch.Tensor, ps: int, sel: list[int]) -> torch.Tensor:
    return torch.cat([idx[i * ps : (i + 1) * ps] for i in sel])


def _backend(store_dir, policy: str, pools: dict[str, object]):  # type: ignore[no-untyped-def]
    kv = make_pool("mha", "page_first")
    backend = make_backend(kv, kvpack_extra(store_dir, disk=False, draft_policy=policy))
    for name, pool in pools.items():
        backend.register_mem_host_pool_v2(pool, name)
    return kv, backend


def _set_pool(backend, name, keys, idx, ps, sel, policy=PoolHitPolicy.ALL_PAGES):  # type: ignore[no-untyped-def]
    t = [PoolTransfer(name=name, host_indices=_pages(idx, ps, sel), keys=[keys[i] for i in sel], hit_policy=policy)]
    assert backend.batch_set_v2(t)[name] == [True] * len(sel)


# (policy, pools stored as page sets, query) -> (kv_hit_pages, extra_pool_hit_pages, restorable_prefix_pages)
# kv is stored for pages 0-5; swa (window 2) for 1-5; draft_swa (window 2) for 2-3; draft (ALL_PAGES) for 0-3.
CASES = {
    ("recompute", "swa+draft_swa"): (4, {"kv": 6, "swa": 6, "draft_swa": 4}, [4]),
    ("target_only", "swa+draft_swa"): (6, {"kv": 6, "swa": 6, "draft_swa": 4}, [3, 4, 5, 6]),
    ("recompute", "draft+swa"): (4, {"kv": 6, "draft": 4, "swa": 4}, [3, 4]),
    ("target_only", "draft+swa"): (6, {"kv": 6, "draft": 4, "swa": 6}, [3, 4, 5, 6]),
}


@pytest.mark.parametrize("policy,pools", sorted(CASES))
def test_exists_v2_windows_and_draft_policy_unchanged(store_dir, policy: str, pools: str) -> None:
    extra = {
        "swa": mha_pool("page_first", layers=1, pool_label="swa"),
        "draft_swa": mha_pool("page_first", layers=1, pool_label="draft_swa"),
        "draft": mha_pool("page_first", layers=1, heads=1, head_dim=64, pool_label="draft"),
    }
    wanted = pools.split("+")
    kv, backend = _backend(store_dir, policy, {n: extra[n] for n in wanted})
    try:
        for n, pool in [("kv", kv)] + [(n, extra[n]) for n in wanted]:
            fill_random(pool, seed=len(n))
        keys = page_keys(6, seed=80)
        idx = alloc_pages(kv, 6)
        ps = kv.page_size
        assert backend.batch_set_v1(keys, idx) == [True] * 6
        query = []
        if "swa" in wanted:
            _set_pool(backend, "swa", keys, idx, ps, [1, 2, 3, 4, 5], TRAILING)
            query.append(PoolTransfer(name=PoolName.SWA, keys=keys[-2:], hit_policy=TRAILING))
        if "draft_swa" in wanted:
            _set_pool(backend, "draft_swa", keys, idx, ps, [2, 3], TRAILING)
            query.append(PoolTransfer(name="draft_swa", keys=keys[-2:], hit_policy=TRAILING))
        if "draft" in wanted:
            _set_pool(backend, "draft", keys, idx, ps, [0, 1, 2, 3])
            query.append(PoolTransfer(name=PoolName.DRAFT, keys=keys))
        res = backend.batch_exists_v2(keys, query)
        got = (
            res.kv_hit_pages,
            {str(getattr(k, "value", k)): v for k, v in res.extra_pool_hit_pages.items()},
            res.restorable_prefix_pages,
        )
        assert got == CASES[(policy, pools)]
        assert (
            backend.session.metrics.value("partial_hits") > 0
        )  # a draft pool lacked pages the target has: never silent
    finally:
        backend.close()


@pytest.mark.parametrize("disk", [True, False], ids=["fallback-to-disk", "memory-only"])
def test_page_evicted_between_exists_and_get_is_counted(store_dir, disk: bool) -> None:
    kv = make_pool("mha", "page_first")
    extra = kvpack_extra(store_dir, disk=disk)
    extra["memory"]["capacity"] = "64KiB"  # 4 pages of 16 KiB
    backend = make_backend(kv, extra)
    try:
        fill_random(kv, seed=9)
        a, b = page_keys(4, seed=90), page_keys(4, seed=91)
        a_idx, b_idx = alloc_pages(kv, 4), alloc_pages(kv, 4)
        want = page_bytes(kv, a_idx)
        assert backend.batch_set_v1(a, a_idx) == [True] * 4
        assert backend.batch_exists(a) == 4  # found in memory
        assert backend.batch_set_v1(b, b_idx) == [True] * 4  # evicts every page of a from memory
        poison(kv)
        dst = alloc_pages(kv, 4)
        assert backend.batch_get_v1(a, dst) == [disk] * 4
        assert backend.session.metrics.value("evicted_before_load", tier="memory") == 4
        assert backend.session.metrics.value("load_failures", status="miss") == (0 if disk else 4)
        if disk:
            assert page_bytes(kv, dst) == want
    finally:
        backend.close()


def test_set_stores_only_what_prepare_store_says_is_missing(store_dir) -> None:
    kv = make_pool("mha", "page_first")
    backend = make_backend(kv, kvpack_extra(store_dir, disk=False))
    try:
        fill_random(kv, seed=10)
        keys = page_keys(3, seed=100)
        idx = alloc_pages(kv, 3)
        assert backend.batch_set_v1(keys[:2], idx[: 2 * kv.page_size]) == [True, True]
        before = backend.session.metrics.value("stored_objects")
        assert backend.batch_set_v1(keys, idx) == [True] * 3
        assert backend.session.metrics.value("stored_objects") == before + 1  # only the page not stored yet
    finally:
        backend.close()
