"""`sglang_plugin.conversion.copy_runs`: a real SGLang MHA host pool's pages <-> canonical objects
at arbitrary host addresses (a memory tier's slots come back to back ascending, descending, or
scattered), in pieces on several threads, byte for byte what one contiguous conversion gives; and
the memory tier's own shuffled slots, saved into and loaded from in place."""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch
from sglang_parts import (
    LAYOUTS,
    alloc_pages,
    fill_random,
    kvpack_extra,
    make_backend,
    make_pool,
    page_bytes,
    page_keys,
    poison,
)

from kvpack import address_of
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
    buf = np.zeros(2 * n * size, dtype=np.uint8)
    for name, addrs in _orders(n, size, buf.ctypes.data).items():
        buf[:] = 0
        copy_runs(geo, ids, addrs, gather=True, threads=threads)
        got = [bytes(buf[a - buf.ctypes.data : a - buf.ctypes.data + size]) for a in addrs]
        assert got == [r.tobytes() for r in rows], f"gather, {name}"
        pool.kv_buffer.view(-1).view(torch.uint8).fill_(0xA5)
        copy_runs(geo, ids, addrs, gather=False, threads=threads)
        back = torch.empty(n * size, dtype=torch.uint8)
        geo.copy(ids, back, gather=True, obj_heads=geo.heads)
        assert torch.equal(back, want), f"scatter, {name}"


def test_address_of_is_the_first_byte_of_every_kind_of_buffer():
    """`address_of` (the conversion's per-object address: a tier's lent slot, a lent view,
    a staging row) is where the buffer's first byte lies, writable or read-only, sliced or
    whole, array or memoryview; an empty buffer has numpy's address for it."""
    base = np.arange(4096, dtype=np.uint8)
    start = int(base.ctypes.data)
    cases = {
        "array": (base, 0),
        "array slice": (base[100:300], 100),
        "read-only array": (np.frombuffer(base[64:128].tobytes(), dtype=np.uint8), None),
        "memoryview slice": (memoryview(base)[200:400], 200),
        "read-only memoryview": (memoryview(base)[300:500].toreadonly(), 300),
        "read-only view of a whole slot": (base[512:1024].data.toreadonly(), 512),
        "read-only view of a read-only array": (memoryview(np.frombuffer(bytes(64), dtype=np.uint8)), None),
        "empty": (base[7:7], None),
    }
    for name, (buf, offset) in cases.items():
        want = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if offset is None else start + offset
        assert address_of(buf) == want, name
        view = (ctypes.c_ubyte * 1).from_address(address_of(buf)) if len(buf) else None
        assert view is None or view[0] == np.frombuffer(buf, dtype=np.uint8)[0], name


def test_row_views_are_each_rows_bytes_writable():
    """`row_views` (a load's and a save's per-object buffers) gives each row of a staging
    buffer as ``memoryview(rows[i])`` does: same bytes, same address, writable in place;
    anything but a C-contiguous 2-D array is refused."""
    rows = torch.arange(5 * 48, dtype=torch.int64).to(torch.uint8).view(5, 48).numpy()
    views = conversion.row_views(rows)
    assert len(views) == 5
    for i, view in enumerate(views):
        want = memoryview(rows[i])
        assert (view.nbytes, view.format, view.ndim, view.readonly) == (want.nbytes, want.format, 1, False)
        assert bytes(view) == bytes(want) and address_of(view) == address_of(rows[i])
        view[0] = 200 + i
        assert rows[i, 0] == 200 + i
    assert conversion.row_views(rows[:0]) == []
    for bad in (rows[:, :8], rows.reshape(-1), rows[::2]):
        with pytest.raises(ValueError):
            conversion.row_views(bad)


def test_page_ids_are_the_pages_of_whole_aligned_host_indices():
    """`PageRegions.page_ids`: the page of each run of `page_size` host indices, in the
    batch's order; indices that are not whole, aligned pages (a shifted run, a page with a
    slot out of order, a count that is not whole pages) are refused with one ValueError."""
    from kvpack.sglang_plugin.regions import PageRegions

    ps = 4
    pages = PageRegions("kv", None, ps, (16, 16))
    order = [5, 0, 3, 9]
    idx = torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in order]).to(torch.int32)
    assert pages.page_ids(idx, len(order)) == order
    shifted = idx + 1
    swapped = idx.clone()
    swapped[[5, 6]] = swapped[[6, 5]]
    for bad, n in ((shifted, 4), (swapped, 4), (idx[:-1], 4), (idx, 3)):
        with pytest.raises(ValueError, match="kv"):
            pages.page_ids(bad, n)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_memory_tier_restores_pages_saved_into_shuffled_slots(layout):
    """A save into a full memory tier takes the slots of the groups it evicts, in the order
    they are evicted (least recently read first): after reads in a shuffled order, a
    batch's objects lie in slots scattered over the tier's slabs, and the conversion
    gathers into them and scatters out of them in place (one kernel call per batch, each
    object at its own address). The pages must come back byte for byte."""
    from kvpack.canonical.addressed import address_runs
    from kvpack.identity.keys import StoreKey

    pool = make_pool("mha", layout, device_tokens=512)
    n = 16
    size = canonical_kv("kv", pool, PAR, layout).object_bytes(2)  # type: ignore[union-attr]
    extra = kvpack_extra(memory=True, disk=False)
    extra["memory"]["capacity"] = f"{(3 * n // 2) * size // 1024}KiB"
    backend = make_backend(pool, extra)
    try:
        fill_random(pool, seed=1)
        first, keys = alloc_pages(pool, n), page_keys(n, seed=31)
        assert backend.batch_set_v1(keys, first) == [True] * n
        one = alloc_pages(pool, 1)
        for k in random.Random(4).sample(keys, n):  # reads reorder the groups' recency
            assert backend.batch_get_v1([k], one) == [True]
        fill_random(pool, seed=2)
        second, keys2 = alloc_pages(pool, n), page_keys(n, seed=32)
        want = page_bytes(pool, second)
        assert backend.batch_set_v1(keys2, second) == [True] * n
        binding, tier = backend.binding("kv"), backend.session.store.tiers[0]
        objects = torch.empty(n * size, dtype=torch.uint8)  # each page's object, copied on its own
        binding.canonical.copy(binding.pages.page_ids(second, n), objects, gather=True, obj_heads=2, use_kernel=False)
        lent = tier.borrow_many([StoreKey(backend.tenant, backend.group_fingerprint, k, binding.member) for k in keys2])
        addrs = [int(np.frombuffer(view, dtype=np.uint8).ctypes.data) for _, view in lent]
        assert [bytes(view) for _, view in lent] == [r.numpy().tobytes() for r in objects.view(n, size)]
        del lent  # a borrowed view keeps its slot out of reuse
        assert len(address_runs(list(range(n)), addrs, size)) >= n // 4, "the slots are not shuffled"
        poison(pool)
        dst = alloc_pages(pool, n)
        assert backend.batch_get_v1(keys2, dst) == [True] * n
        assert page_bytes(pool, dst) == want
    finally:
        backend.close()


@pytest.mark.parametrize("engine_device", ["cpu", "cuda"])
def test_pages_are_converted_on_io_threads_only_when_sglang_computes_off_the_cpu(engine_device, monkeypatch):
    """A GPU server's KV pool (its host pool moves pages to a ``cuda`` device) is converted on
    ``io_threads`` threads; a CPU server's on the calling thread alone, whose forward pass
    needs the other cores (`kvpack.conversion_threads`). SGLang checks a pool's device buffers
    against its device, so the GPU server's pool is a CPU pool told what a GPU server's says.
    Either way the pages come back byte for byte."""
    pool = make_pool("mha", "page_first", device_tokens=512)
    if engine_device == "cuda":
        pool._transfer_device = torch.device("cuda")
    backend = make_backend(pool, kvpack_extra(memory=True, disk=False, io_threads=3))
    try:
        binding = backend.pools.kv
        assert binding is not None and binding.canonical is not None
        assert binding.copy_threads == (3 if engine_device == "cuda" else 1)
        monkeypatch.setattr(conversion, "MIN_BYTES_PER_THREAD", 1)  # these small pages get threads too
        seen: list[int] = []
        copy_at = type(binding.canonical).copy_at

        def recorded(self, *args, **kw):  # type: ignore[no-untyped-def]
            seen.append(kw.get("threads", 1))
            return copy_at(self, *args, **kw)

        monkeypatch.setattr(type(binding.canonical), "copy_at", recorded)
        fill_random(pool, seed=5)
        n = 12
        src, keys = alloc_pages(pool, n), page_keys(n, seed=41)
        want = page_bytes(pool, src)
        assert backend.batch_set_v1(keys, src) == [True] * n
        poison(pool)
        dst = alloc_pages(pool, n)
        assert backend.batch_get_v1(keys, dst) == [True] * n
        assert page_bytes(pool, dst) == want
        # one kernel call for the save and one for the load, each cut into a piece per thread
        assert seen == ([3, 3] if engine_device == "cuda" else [1, 1]), seen
    finally:
        backend.close()
