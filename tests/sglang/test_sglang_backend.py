"""KVPackStorage through SGLang's real factory and real host pools (v1 + legacy).

Every round trip poisons the host pool before the get, so a get that copied
nothing (or the wrong page) fails the bit-exact comparison.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from sglang_parts import (
    DYNAMIC,
    LAYOUTS,
    alloc_pages,
    fill_random,
    kvpack_extra,
    make_backend,
    make_pool,
    page_bytes,
    page_keys,
    poison,
    storage_config,
)

from kvpack import ConfigError
from kvpack.sglang_plugin import KVPackStorage
from kvpack.tiers.host import drop

pytestmark = pytest.mark.sglang

TIERS = {
    "memory": dict(memory=True, disk=False),
    "disk": dict(memory=False, disk=True),
    "memory+disk": dict(memory=True, disk=True),
}


def test_factory_loads_kvpack_through_dynamic(store_dir):
    pool = make_pool("mha", "page_first")
    backend = make_backend(pool, kvpack_extra(store_dir))
    try:
        assert type(backend) is KVPackStorage
        assert [t.name for t in backend.session.store.tiers] == ["memory", "disk"]
        assert backend.engine_config == DYNAMIC  # SGLang's keys were split off, not parsed as kvpack's
        assert backend.binding("kv").member == "kv"
    finally:
        backend.close()


def test_default_config_is_memory_plus_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    backend = make_backend(make_pool("mha", "page_first"), dict(DYNAMIC))
    try:
        assert [t.name for t in backend.session.store.tiers] == ["memory", "disk"]
        assert str(backend.session.store.tiers[1].root).startswith(str(tmp_path))
    finally:
        backend.close()


@pytest.mark.parametrize("tiers", list(TIERS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_v1_round_trip_bit_exact(kind, layout, tiers, store_dir):
    pool = make_pool(kind, layout)
    backend = make_backend(pool, kvpack_extra(store_dir, **TIERS[tiers]), mla=kind == "mla")
    try:
        n = 5
        fill_random(pool, seed=1)
        src = alloc_pages(pool, n)
        want = page_bytes(pool, src)
        keys = page_keys(n, seed=7)
        assert backend.batch_set_v1(keys, src) == [True] * n
        assert backend.flush(10)
        assert backend.batch_exists(keys) == n
        assert backend.batch_exists(page_keys(n, seed=8)) == 0  # negative control

        poison(pool)  # "clear the pool": nothing of the stored pages is left in host memory
        dst = alloc_pages(pool, n)  # other host pages than the ones written
        assert backend.batch_get_v1(keys, dst) == [True] * n
        assert page_bytes(pool, dst) == want

        poison(pool)
        other = page_keys(2, seed=9)
        assert backend.batch_get_v1(other, dst[: 2 * pool.page_size]) == [False, False]
        assert page_bytes(pool, dst[: 2 * pool.page_size]) != want[:2]  # still poisoned: nothing was loaded
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_read_from_disk_are_not_copied_into_the_memory_tier(kind, store_dir):
    """What SGLang reads from L3 lands in its own L2 host pool: after a restart (an empty memory
    tier, the pages on disk), a get restores them without putting a third copy into kvpack's
    memory tier on the prefetch's path; what SGLang writes still goes there."""
    pool = make_pool(kind, "page_first")
    extra = kvpack_extra(store_dir, memory=True, disk=True)
    n, keys = 4, page_keys(4, seed=21)
    first = make_backend(pool, extra, mla=kind == "mla")
    try:
        fill_random(pool, seed=2)
        src = alloc_pages(pool, n)
        want = page_bytes(pool, src)
        assert first.batch_set_v1(keys, src) == [True] * n
        assert first.flush(10)
    finally:
        first.close()
    restarted = make_backend(pool, extra, mla=kind == "mla")
    try:
        memory = restarted.session.store.tiers[0]
        assert memory.name == "memory" and memory.usage().objects == 0
        poison(pool)
        dst = alloc_pages(pool, n)
        assert restarted.batch_get_v1(keys, dst) == [True] * n
        assert page_bytes(pool, dst) == want
        assert memory.usage().objects == 0  # before: one object per page and pool member
        assert restarted.batch_set_v1(page_keys(2, seed=22), src[: 2 * pool.page_size]) == [True, True]
        assert memory.usage().objects > 0  # the control: SGLang's writes still fill it
    finally:
        restarted.close()


@pytest.mark.parametrize("checksum", ["never", "boundary"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_second_server_reads_the_host_store_in_place(layout, checksum, store_dir):
    """Two backends on one host store (``memory.mode: host``, disk off), as two SGLang servers of a
    host: the second loads what the first stored byte for byte. Without checksums it is converted
    into its host pool straight from the shared memory (every byte the host store loaded is
    counted in ``loaded_in_place_bytes``); with them (the default) it is copied out first and the
    checksum checked on that copy (the bytes the conversion reads), none counted in place."""
    name = f"sglang-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    extra = kvpack_extra(store_dir, disk=False, memory=False)
    extra["memory"] = {"capacity": "64MiB", "mode": "host", "host_name": name}
    extra["checksum"] = checksum
    writer_pool, reader_pool = make_pool("mha", layout), make_pool("mha", layout)
    writer, reader = make_backend(writer_pool, extra), make_backend(reader_pool, extra)
    try:
        n = 5
        fill_random(writer_pool, seed=3)
        src = alloc_pages(writer_pool, n)
        keys = page_keys(n, seed=11)
        assert writer.batch_set_v1(keys, src) == [True] * n
        poison(reader_pool)
        dst = alloc_pages(reader_pool, n)
        assert reader.batch_get_v1(keys, dst) == [True] * n
        assert page_bytes(reader_pool, dst) == page_bytes(writer_pool, src)
        metrics = reader.session.metrics
        from_host = metrics.value("loaded_bytes", tenant="default", tier="host")
        in_place = metrics.value("loaded_in_place_bytes", tenant="default")
        assert from_host > 0 and in_place == (from_host if checksum == "never" else 0)
    finally:
        writer.close()
        reader.close()
        drop(name)


@pytest.mark.parametrize("tiers", list(TIERS))
def test_successive_canonical_saves_keep_their_own_bytes(tiers, store_dir):
    # a canonical MHA pool converts each save into staging rows it keeps between calls
    # (pools.StagingRows): the second save rewrites those rows, so any tier that kept a
    # reference to the first save's rows would now hold the second's
    pool = make_pool("mha", "page_first")
    backend = make_backend(pool, kvpack_extra(store_dir, **TIERS[tiers]))
    try:
        n = 4
        fill_random(pool, seed=11)
        first = alloc_pages(pool, n)
        want_first = page_bytes(pool, first)
        assert backend.batch_set_v1(page_keys(n, seed=21), first) == [True] * n
        fill_random(pool, seed=12)
        second = alloc_pages(pool, n)
        want_second = page_bytes(pool, second)
        assert want_second != want_first
        assert backend.batch_set_v1(page_keys(n, seed=22), second) == [True] * n
        assert backend.flush(10)
        poison(pool)
        dst = alloc_pages(pool, n)
        assert backend.batch_get_v1(page_keys(n, seed=21), dst) == [True] * n
        assert page_bytes(pool, dst) == want_first
        assert backend.batch_get_v1(page_keys(n, seed=22), dst) == [True] * n
        assert page_bytes(pool, dst) == want_second
    finally:
        backend.close()


def test_prefix_stops_at_first_missing_page(store_dir):
    pool = make_pool("mha", "page_first")
    backend = make_backend(pool, kvpack_extra(store_dir))
    try:
        fill_random(pool, seed=2)
        keys = page_keys(6, seed=3)
        idx = alloc_pages(pool, 6)
        ps = pool.page_size
        keep = [0, 1, 2, 4, 5]  # page 3 never stored
        sel = torch.cat([idx[i * ps : (i + 1) * ps] for i in keep])
        assert backend.batch_set_v1([keys[i] for i in keep], sel) == [True] * 5
        assert backend.batch_exists(keys) == 3
    finally:
        backend.close()


def test_layout_tenant_and_rank_isolation(store_dir):
    """Native objects: another host layout, another tenant or another TP rank never hits.
    (One KV head per rank at TP=2 and no checkpoint to say whether it is replicated: the
    pool keeps SGLang's own page bytes. Canonical objects are shared across host layouts
    on purpose: test_sglang_head_splits.)"""
    pool = make_pool("mha", "page_first", heads=1)
    writer = make_backend(pool, kvpack_extra(store_dir, memory=False), tp_size=2, tp_rank=0)
    assert writer.binding("kv").canonical is None
    fill_random(pool, seed=4)
    keys = page_keys(3, seed=5)
    assert writer.batch_set_v1(keys, alloc_pages(pool, 3)) == [True] * 3
    assert writer.flush(10)
    try:
        same = make_backend(
            make_pool("mha", "page_first", heads=1), kvpack_extra(store_dir, memory=False), tp_size=2, tp_rank=0
        )
        assert same.batch_exists(keys) == 3  # control: the same layout and rank hits
        for other in (
            make_backend(
                make_pool("mha", "layer_first", heads=1), kvpack_extra(store_dir, memory=False), tp_size=2, tp_rank=0
            ),
            make_backend(
                make_pool("mha", "page_first", heads=1),
                kvpack_extra(store_dir, memory=False, tenant="other"),
                tp_size=2,
                tp_rank=0,
            ),
            make_backend(
                make_pool("mha", "page_first", heads=1), kvpack_extra(store_dir, memory=False), tp_size=2, tp_rank=1
            ),
        ):
            assert other.batch_exists(keys) == 0
            other.close()
        same.close()
    finally:
        writer.close()


def test_canonical_tenant_and_rank_isolation(store_dir):
    """Canonical objects: another host layout hits (the same bytes), another tenant and
    another TP rank's heads never do."""
    pool = make_pool("mha", "page_first")  # 2 heads per rank at TP=2: the model has 4
    writer = make_backend(pool, kvpack_extra(store_dir, memory=False), tp_size=2, tp_rank=0)
    assert writer.binding("kv").canonical is not None
    fill_random(pool, seed=6)
    keys = page_keys(3, seed=7)
    assert writer.batch_set_v1(keys, alloc_pages(pool, 3)) == [True] * 3
    try:
        for backend, hits in (
            (
                make_backend(
                    make_pool("mha", "layer_first"), kvpack_extra(store_dir, memory=False), tp_size=2, tp_rank=0
                ),
                3,
            ),
            (
                make_backend(
                    make_pool("mha", "page_first"),
                    kvpack_extra(store_dir, memory=False, tenant="other"),
                    tp_size=2,
                    tp_rank=0,
                ),
                0,
            ),
            (
                make_backend(
                    make_pool("mha", "page_first"), kvpack_extra(store_dir, memory=False), tp_size=2, tp_rank=1
                ),
                0,
            ),
        ):
            assert backend.batch_exists(keys) == hits
            backend.close()
    finally:
        writer.close()


def test_mla_is_written_once_and_read_by_every_rank(store_dir):
    """MLA KV is replicated: only the storage writer (rank 0) stores it; rank 1 finds it."""
    pool1 = make_pool("mla", "page_first")
    rank1 = make_backend(pool1, kvpack_extra(store_dir, memory=False), mla=True, tp_size=2, tp_rank=1)
    pool0 = make_pool("mla", "page_first")
    rank0 = make_backend(pool0, kvpack_extra(store_dir, memory=False), mla=True, tp_size=2, tp_rank=0)
    try:
        assert not rank1.storage_config.is_storage_writer
        keys = page_keys(2, seed=11)
        fill_random(pool1, seed=12)
        assert rank1.batch_set_v1(keys, alloc_pages(pool1, 2)) == [True, True]  # writer's job: nothing stored
        rank1.flush(10)
        assert rank1.batch_exists(keys) == 0
        fill_random(pool0, seed=13)
        src = alloc_pages(pool0, 2)
        want = page_bytes(pool0, src)
        assert rank0.batch_set_v1(keys, src) == [True, True]
        rank0.flush(10)
        assert rank1.batch_exists(keys) == 2
        poison(pool1)
        dst = alloc_pages(pool1, 2)
        assert rank1.batch_get_v1(keys, dst) == [True, True]
        assert page_bytes(pool1, dst) == want
    finally:
        rank0.close()
        rank1.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_legacy_generic_path_round_trip(layout, store_dir):
    """Without interface_v1 SGLang calls batch_set/batch_get with flat pages, and its prefetch
    asks `batch_exists` (SGLang 0.5.23's hit query) for the pages those gets read."""
    pool = make_pool("mha", layout)
    backend = make_backend(pool, kvpack_extra(store_dir, zero_copy=False))
    try:
        fill_random(pool, seed=21)
        idx = alloc_pages(pool, 2)
        ps = pool.page_size
        keys = page_keys(2, seed=22)
        values = [pool.get_data_page(int(idx[i * ps]), flat=True) for i in range(2)]
        want = [v.clone() for v in values]
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set(keys, values) is True
        assert backend.exists(keys[0]) and not backend.exists(page_keys(1, seed=23)[0])
        assert backend.batch_exists(keys + page_keys(1, seed=23)) == 2
        got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))
        assert backend.get(page_keys(1, seed=24)[0]) is None
    finally:
        backend.close()


def test_each_interface_reports_only_the_pages_its_gets_read(store_dir):
    """One store written through both of SGLang's paths: a server on the zero-copy path is told
    of the pages `batch_get_v1` loads, one on the generic path of those `batch_get` loads; a hit
    on the other path's object would be a failed read."""
    pool = make_pool("mha", "layer_first")
    zero_copy = make_backend(pool, kvpack_extra(store_dir, memory=False))
    generic = make_backend(pool, kvpack_extra(store_dir, memory=False, zero_copy=False))
    try:
        fill_random(pool, seed=25)
        idx = alloc_pages(pool, 2)
        v1_keys, flat_keys = page_keys(2, seed=26), page_keys(2, seed=27)
        assert zero_copy.batch_set_v1(v1_keys, idx) == [True, True]
        flat = [pool.get_data_page(int(idx[i * pool.page_size]), flat=True) for i in range(2)]
        assert generic.batch_set(flat_keys, flat) is True
        assert zero_copy.flush(10) and generic.flush(10)
        assert zero_copy.batch_exists(v1_keys) == 2 and zero_copy.batch_exists(flat_keys) == 0
        assert generic.batch_exists(flat_keys) == 2 and generic.batch_exists(v1_keys) == 0
        assert not generic.exists(v1_keys[0])
        assert generic.batch_get(v1_keys[:1], [pool.get_dummy_flat_data_page()]) == [None]
    finally:
        zero_copy.close()
        generic.close()


def test_start_up_line_names_the_path_sglang_uses(store_dir, caplog):
    """A user who left ``interface_v1`` out reads in the server log that pages are copied and not shared."""
    lines = []
    for zero_copy in (True, False):
        caplog.clear()
        with caplog.at_level("INFO", logger="kvpack.sglang"):
            backend = make_backend(
                make_pool("mha", "layer_first"), kvpack_extra(store_dir, memory=False, zero_copy=zero_copy)
            )
        backend.close()
        lines.append(" ".join(r.getMessage() for r in caplog.records if "storage backend for tenant" in r.getMessage()))
    assert "zero-copy pages (interface_v1)" in lines[0] and "generic path" not in lines[0]
    assert "generic path (no interface_v1: not shared" in lines[1]


# -- failure behaviour ------------------------------------------------------------


def _disk_file(backend, key):
    from kvpack.identity.keys import StoreKey

    disk = next(t for t in backend.session.store.tiers if t.name == "disk")
    return disk.path_of(StoreKey(backend.tenant, backend.group_fingerprint, key, backend.binding("kv").member))


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corrupt_object_is_a_per_key_miss(where, store_dir):
    pool = make_pool("mha", "page_first")
    backend = make_backend(pool, kvpack_extra(store_dir, memory=False))
    try:
        fill_random(pool, seed=31)
        keys = page_keys(4, seed=32)
        src = alloc_pages(pool, 4)
        want = page_bytes(pool, src)
        assert backend.batch_set_v1(keys, src) == [True] * 4
        assert backend.flush(10)
        path = _disk_file(backend, keys[2])
        raw = bytearray(path.read_bytes())
        pos = len(raw) - 100 if where == "payload" else 30
        raw[pos] ^= 0xFF
        path.write_bytes(bytes(raw))

        poison(pool)
        dst = alloc_pages(pool, 4)
        assert backend.batch_get_v1(keys, dst) == [True, True, False, True]
        got = page_bytes(pool, dst)
        assert got[0] == want[0] and got[3] == want[3]
        # Page 2's bytes are unspecified after a False (tiers read in place); a damaged
        # payload can only come back damaged, which is why it must be reported False.
        if where == "payload":
            assert got[2] != want[2]
        assert backend.session.metrics.value("rejected_objects", tier="disk") >= 1
    finally:
        backend.close()


def test_bad_arguments_never_raise(store_dir):
    pool = make_pool("mha", "page_first")
    backend = make_backend(pool, kvpack_extra(store_dir))
    try:
        idx = alloc_pages(pool, 2)
        keys = page_keys(2, seed=41)
        assert backend.batch_set_v1(keys, idx[:5]) == [False, False]  # wrong index count
        assert backend.batch_get_v1(keys, idx[:5]) == [False, False]
        assert backend.batch_set_v1(["../../etc/passwd", keys[1]], idx) == [False, False]
        assert backend.batch_exists(["not a/hash"]) == 0
        assert backend.batch_get_v1(keys, None) == [False, False]
        assert backend.session.metrics.value("tier_errors", tier="sglang") >= 3
    finally:
        backend.close()


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"disk": {"capacity": "lots"}}, "disk.capacity"),
        ({"tenat": "a"}, "tenat"),
        ({"tenant": "../x"}, "tenant"),
        ({"draft_policy": "sometimes"}, "draft_policy"),
        ({"mooncake": {"enabled": True}}, "mooncake.master_server_address"),
    ],
)
def test_bad_extra_config_fails_at_construction(bad, field, store_dir):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    extra = kvpack_extra(store_dir)
    extra.update(bad)
    with pytest.raises(ConfigError) as err:
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), make_pool("mha", "page_first"))
    assert err.value.field == field
    assert field in str(err.value)


def test_staging_rows_are_reused_after_they_are_given_back_and_kept_within_their_bound():
    from kvpack.sglang_plugin.conversion import StagingRows

    rows = StagingRows(kept_bytes=1000)
    a = rows.take(4, 100)
    b = rows.take(2, 100)  # a is still in use: b is another buffer
    assert a.ctypes.data != b.ctypes.data and a.shape == (4, 100)
    rows.give_back(a)
    c = rows.take(3, 100)  # fits in a's buffer
    assert c.ctypes.data == a.ctypes.data and c.shape == (3, 100)
    rows.give_back(c)
    rows.give_back(b)
    assert rows.take(5, 100).ctypes.data not in (a.ctypes.data, b.ctypes.data)  # neither is large enough
    big = rows.take(11, 100)
    rows.give_back(big)  # 1100 bytes would pass the bound of 1000 kept: dropped
    assert rows.take(11, 100).ctypes.data != big.ctypes.data
