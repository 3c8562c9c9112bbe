"""`sglang_plugin.conversion.copy_runs`: a real SGLang MHA host pool's pages <-> canonical objects
at arbitrary host addresses (a memory tier's slots come back to back ascending, descending, or
scattered), in runs and on several threads, byte for byte what one contiguous conversion gives."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from sglang_parts import LAYOUTS, fill_random, make_pool

from kvpack.sglang_plugin import conversion
from kvpack.sglang_plugin.conversion import copy_runs
from kvpack.sglang_plugin.pools import ParallelInfo, canonical_kv

pytestmark = pytest.mark.sglang

PAR = ParallelInfo("kvpack-tiny", 0, 1, 0, 1, 0, 1, False, True)


def _orders(n: int, size: int, base: int) -> dict[str, list[int]]:
    """Object addresses inside a buffer of 2n objects at `base`: the shapes a slab arena hands out."""
    rng = random.Random(n)
    scattered = rng.sample(range(2 * n), n)
    mixed = list(range(0, n // 2)) + list(range(2 * n - 1, 2 * n - 1 - (n - n // 2), -1))
    return {
        "ascending": [base + i * size for i in range(n)],
        "descending": [base + (2 * n - 1 - i) * size for i in range(n)],
        "scattered": [base + i * size for i in scattered],
        "runs both ways": [base + i * size for i in mixed],
    }


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_runs_equals_one_contiguous_conversion(layout, threads, monkeypatch):
    monkeypatch.setattr(conversion, "MIN_BYTES_PER_THREAD", 1)  # these small pages get threads too
    pool = make_pool("mha", layout, device_tokens=512)
    fill_random(pool, seed=3)
    geo = canonical_kv("kv", pool, PAR, layout)
    assert geo is not None
    size, n = geo.object_bytes(geo.heads), 13
    ids = random.Random(1).sample(range(geo.num_blocks), n)
    want = torch.empty(n * size, dtype=torch.uint8)
    geo.copy(ids, want, gather=True, obj_heads=geo.heads)
    rows = want.view(n, size).numpy()
    workers = ThreadPoolExecutor(threads - 1) if threads > 1 else None
    try:
        buf = np.zeros(2 * n * size, dtype=np.uint8)
        for name, addrs in _orders(n, size, buf.ctypes.data).items():
            buf[:] = 0
            copy_runs(geo, ids, addrs, gather=True, workers=workers, threads=threads)
            got = [bytes(buf[a - buf.ctypes.data : a - buf.ctypes.data + size]) for a in addrs]
            assert got == [r.tobytes() for r in rows], f"gather, {name}"
            pool.kv_buffer.view(-1).view(torch.uint8).fill_(0xA5)
            copy_runs(geo, ids, addrs, gather=False, workers=workers, threads=threads)
            back = torch.empty(n * size, dtype=torch.uint8)
            geo.copy(ids, back, gather=True, obj_heads=geo.heads)
            assert torch.equal(back, want), f"scatter, {name}"
    finally:
        if workers is not None:
            workers.shutdown()
