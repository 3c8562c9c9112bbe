"""``kvpack_loaded_tokens`` ("tokens restored into the engine") on SGLang: the backend
counts the tokens of every page it restores into the host pool, as the vLLM adapter
does, on real SGLang host pools (issue 28: an SGLang server that loaded 672 tokens
from kvpack showed 0 there)."""

from __future__ import annotations

import torch
from sglang_parts import alloc_pages, fill_random, kvpack_extra, make_backend, make_pool, page_keys


def test_v1_loads_count_restored_tokens(store_dir):
    pool = make_pool("mha", "page_first")
    backend = make_backend(pool, kvpack_extra(store_dir))
    try:
        ps = pool.page_size
        fill_random(pool, seed=31)
        keys = page_keys(4, seed=32)
        assert backend.batch_set_v1(keys, alloc_pages(pool, 4)) == [True] * 4
        assert backend.flush(10)
        assert backend.session.report.metrics.value("loaded_tokens", tenant="default") == 0  # a store restores nothing
        assert backend.batch_get_v1(keys, alloc_pages(pool, 4)) == [True] * 4
        assert backend.session.report.metrics.value("loaded_tokens", tenant="default") == 4 * ps
        missing = page_keys(2, seed=33)  # never stored: nothing restored, nothing counted
        assert backend.batch_get_v1(missing, alloc_pages(pool, 2)) == [False, False]
        assert backend.batch_get_v1(keys[:1] + missing[:1], alloc_pages(pool, 2)) == [True, False]
        assert backend.session.report.metrics.value("loaded_tokens", tenant="default") == 5 * ps
    finally:
        backend.close()


def test_legacy_loads_count_restored_tokens(store_dir):
    pool = make_pool("mha", "layer_first")
    backend = make_backend(pool, kvpack_extra(store_dir, zero_copy=False))
    try:
        ps = pool.page_size
        fill_random(pool, seed=34)
        idx = alloc_pages(pool, 2)
        keys = page_keys(2, seed=35)
        assert backend.batch_set(keys, [pool.get_data_page(int(idx[i * ps]), flat=True) for i in range(2)]) is True
        got = backend.batch_get(keys + page_keys(1, seed=36), [pool.get_dummy_flat_data_page() for _ in range(3)])
        assert [g is not None for g in got] == [True, True, False]
        assert all(isinstance(g, torch.Tensor) for g in got[:2])
        assert backend.session.report.metrics.value("loaded_tokens", tenant="default") == 2 * ps
    finally:
        backend.close()
