"""SGLang's traffic shape against real host pools: many calls, page counts that vary, saves and
loads interleaved, from several threads at once, on every tier set-up.

SGLang's cache controller backs pages up from one thread and prefetches from another while the
scheduler asks `batch_exists`; each call carries however many pages a request's turn added or
hit (one page, forty pages). A canonical MHA pool converts every call's pages through kept
staging buffers (`pools.StagingRows`), so buffers of many sizes are taken and given back
concurrently. Every page written must read back exact and no batch call may fail.

Also the direct regression of the staging pool's free list: a buffer is found by identity,
never by value (``list.remove`` compared torch tensors element-wise and raised once two kept
buffers of different sizes were there and the chosen one was not first).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import pytest
import torch
from sglang_parts import DYNAMIC, alloc_pages, fill_random, kvpack_extra, make_backend, make_pool, page_keys

from kvpack.sglang_plugin.conversion import StagingRows

pytestmark = pytest.mark.sglang

TIERS = {
    "memory": dict(memory=True, disk=False),
    "disk": dict(memory=False, disk=True),
    "memory+disk": dict(memory=True, disk=True),
}
THREADS = 4
ROUNDS = 12
MAX_PAGES = 12


def test_staging_rows_take_finds_a_kept_buffer_by_identity_not_by_value():
    # the reproduction: a 1-page buffer and two 4-page buffers kept, then a 4-page take
    rows = StagingRows()
    one = rows.take(1, 4096)
    rows.give_back(one)
    a, b = rows.take(4, 4096), rows.take(4, 4096)
    assert a.ctypes.data != b.ctypes.data
    rows.give_back(a)
    rows.give_back(b)
    got = rows.take(4, 4096)  # raised "The size of tensor a (4096) must match the size of tensor b (16384)"
    assert got.shape == (4, 4096)
    assert got.ctypes.data in {a.ctypes.data, b.ctypes.data}
    # the other 4-page buffer and the 1-page one are still kept, each handed out once
    again = rows.take(4, 4096)
    assert again.ctypes.data != got.ctypes.data
    assert rows.take(1, 4096).ctypes.data == one.ctypes.data


def test_staging_rows_never_hand_one_buffer_to_two_takers():
    rows = StagingRows()
    held = [rows.take(n, 1024) for n in (3, 1, 7, 2, 7, 5)]
    for buf in held:
        rows.give_back(buf)
    taken = [rows.take(n, 1024) for n in (7, 2, 5, 1, 3, 7)]
    ptrs = [t.ctypes.data for t in taken]
    assert len(set(ptrs)) == len(ptrs)
    assert [t.shape[0] for t in taken] == [7, 2, 5, 1, 3, 7]


@dataclass
class _Worker:
    """One thread's conversations: each a chain of page keys and the source page of each key."""

    seed: int
    dst: torch.Tensor  # this thread's own destination pages (no other thread writes them)
    saved: list[tuple[list[str], list[int]]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    set_calls: int = 0
    get_calls: int = 0
    pages_read: int = 0


def _run_mixed(backend, pool, sources: torch.Tensor, want: list[bytes], workers: list[_Worker]) -> None:
    """Every worker in its own thread: a save of a conversation's next turn (1..MAX_PAGES new pages
    after the pages it saved before, so later saves repeat a prefix SGLang already stored), then a
    lookup and a load of a prefix of one of its conversations (any length), compared byte for byte."""
    ps = pool.page_size
    n_sources = len(sources) // ps
    start = threading.Barrier(len(workers))

    def host_idx(base: torch.Tensor, pages: list[int]) -> torch.Tensor:
        return torch.cat([base[p * ps : (p + 1) * ps] for p in pages])

    def work(w: _Worker) -> None:
        rng = random.Random(w.seed)
        start.wait()
        try:
            for r in range(ROUNDS):
                if w.saved and rng.random() < 0.5:  # a later turn: the whole history, then new pages
                    conv = rng.randrange(len(w.saved))
                    keys, src = w.saved[conv]
                else:
                    keys, src = [], []
                    w.saved.append((keys, src))
                    conv = len(w.saved) - 1
                grow = rng.randint(1, MAX_PAGES)
                new_keys = page_keys(len(keys) + grow, seed=w.seed * 1000 + conv)[len(keys) :]
                new_src = [rng.randrange(n_sources) for _ in range(grow)]
                keys.extend(new_keys)
                src.extend(new_src)
                batch = rng.choice(["all", "new"])  # SGLang backs up a whole turn, or only what was not stored
                lo = 0 if batch == "all" else len(keys) - grow
                got = backend.batch_set_v1(keys[lo:], host_idx(sources, src[lo:]))
                w.set_calls += 1
                if got != [True] * (len(keys) - lo):
                    w.failures.append(f"round {r}: set of {len(keys) - lo} pages answered {got}")
                keys_r, src_r = w.saved[rng.randrange(len(w.saved))]
                n = rng.randint(1, min(len(keys_r), len(w.dst) // ps))
                hit = backend.batch_exists(keys_r[:n])
                if hit != n:
                    w.failures.append(f"round {r}: batch_exists of {n} stored pages answered {hit}")
                    continue
                dst_pages = rng.sample(range(len(w.dst) // ps), n)
                dst = host_idx(w.dst, dst_pages)
                ok = backend.batch_get_v1(keys_r[:n], dst)
                w.get_calls += 1
                w.pages_read += n
                if ok != [True] * n:
                    w.failures.append(f"round {r}: get of {n} pages answered {ok}")
                    continue
                for i, p in enumerate(dst_pages):
                    got_bytes = _page(pool, w.dst, p)
                    if got_bytes != want[src_r[i]]:
                        w.failures.append(f"round {r}: page {i} of a {n}-page get is not the page stored")
        except Exception as exc:  # a raise is a failure of the run, reported with the others
            w.failures.append(f"raised {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(w,), name=f"mixed-{w.seed}") for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"


def _page(pool, base: torch.Tensor, page: int) -> bytes:
    ps = pool.page_size
    return pool.get_data_page(int(base[page * ps]), flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def _check_mixed(backend, pool) -> None:
    fill_random(pool, seed=31)
    n_sources = 24
    sources = alloc_pages(pool, n_sources)
    want = [_page(pool, sources, p) for p in range(n_sources)]
    assert len(set(want)) == n_sources
    workers = [_Worker(seed=s + 1, dst=alloc_pages(pool, MAX_PAGES * 3)) for s in range(THREADS)]
    _run_mixed(backend, pool, sources, want, workers)
    failures = [f"thread {w.seed}: {f}" for w in workers for f in w.failures]
    assert not failures, "\n".join(failures[:20])
    assert sum(w.get_calls for w in workers) >= THREADS * ROUNDS // 2
    assert backend.session.report.metrics.value("tier_errors", tier="sglang", status="exception") == 0
    assert [_page(pool, sources, p) for p in range(n_sources)] == want  # the sources were only read


def _mixed_pool(kind: str, layout: str):
    # room for the sources and every thread's destinations (the host pool is 2x the device pool)
    return make_pool(kind, layout, device_tokens=16 * (24 + THREADS * MAX_PAGES * 3) // 2 + 64)


@pytest.mark.parametrize("tiers", list(TIERS))
@pytest.mark.parametrize(("kind", "layout"), [("mha", "page_first"), ("mha", "layer_first"), ("mla", "page_first")])
def test_mixed_page_counts_from_several_threads_read_back_exact(kind, layout, tiers, store_dir):
    pool = _mixed_pool(kind, layout)
    backend = make_backend(pool, kvpack_extra(store_dir, **TIERS[tiers]), mla=kind == "mla")
    try:
        assert (backend.binding("kv").canonical is not None) == (kind == "mha")
        _check_mixed(backend, pool)
    finally:
        backend.close()


@pytest.mark.mooncake
@pytest.mark.parametrize("memory", [False, True], ids=["mooncake", "memory+mooncake"])
def test_mixed_page_counts_on_mooncake(memory, mooncake_cluster):
    extra = dict(DYNAMIC)
    extra.update(mooncake_cluster.kvpack_config().to_dict())
    if memory:
        extra["memory"] = {"enabled": True, "capacity": "256MiB"}
    pool = _mixed_pool("mha", "page_first")
    backend = make_backend(pool, extra)
    try:
        assert backend.wait_ready(20)
        assert [t.name for t in backend.session.store.tiers][-1] == "mooncake"
        _check_mixed(backend, pool)
    finally:
        backend.close()
