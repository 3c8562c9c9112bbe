"""SGLang's storage clear (``POST /hicache/storage-backend/clear`` -> `KVPackStorage.clear`) applies
kvpack's reset rule (`kvpack.policy.clearing`), through SGLang's real backend factory and host pools.

Two instances of two models share one disk folder: the first's clear removes its own pages from
its memory tier and the disk (every tenant), and leaves the other model's pages loadable; with
``reset.scope: off`` a clear removes nothing and says so.
"""

from __future__ import annotations

import logging

import pytest
from sglang_parts import alloc_pages, fill_random, kvpack_extra, make_backend, make_pool, page_bytes, page_keys

from kvpack import ClearScope

pytestmark = pytest.mark.sglang


def test_clear_removes_this_models_pages_and_no_other(store_dir, caplog: pytest.LogCaptureFixture) -> None:
    pool_a, pool_b = make_pool("mha", "page_first"), make_pool("mha", "page_first")
    a = make_backend(pool_a, kvpack_extra(store_dir), model="model-a")
    b = make_backend(pool_b, kvpack_extra(store_dir), model="model-b")
    try:
        n = 4
        keys_a, keys_b = page_keys(n, seed=31), page_keys(n, seed=32)
        fill_random(pool_a, seed=1)
        fill_random(pool_b, seed=2)
        src_b = alloc_pages(pool_b, n)
        want_b = page_bytes(pool_b, src_b)
        assert a.batch_set_v1(keys_a, alloc_pages(pool_a, n)) == [True] * n
        assert b.batch_set_v1(keys_b, src_b) == [True] * n
        assert a.flush(10) and b.flush(10)
        assert a.batch_exists(keys_a) == n
        with caplog.at_level(logging.INFO, logger="kvpack"):
            a.clear()
        assert "SGLang storage clear removed" in caplog.text and "memory 4" in caplog.text and "disk 4" in caplog.text
        assert a.batch_exists(keys_a) == 0, "the clear left this model's pages"
        dst = alloc_pages(pool_b, n)
        b.session.store.tiers[0].clear(ClearScope())  # b's own memory emptied: its pages come from disk
        assert b.batch_get_v1(keys_b, dst) == [True] * n, "the clear removed another model's pages"
        assert page_bytes(pool_b, dst) == want_b
    finally:
        a.close()
        b.close()


def test_clear_off_keeps_everything(store_dir, caplog: pytest.LogCaptureFixture) -> None:
    pool = make_pool("mha", "page_first")
    backend = make_backend(pool, kvpack_extra(store_dir, reset={"scope": "off"}))
    try:
        keys = page_keys(3, seed=41)
        fill_random(pool, seed=3)
        assert backend.batch_set_v1(keys, alloc_pages(pool, 3)) == [True] * 3
        with caplog.at_level(logging.INFO, logger="kvpack"):
            backend.clear()
        assert "reset.scope is off" in caplog.text
        assert backend.batch_exists(keys) == 3
    finally:
        backend.close()
