"""Issue 34: the disk tier reads a batch's object files natively, the GIL released once.

The extension's ``read_objects`` (`kvpack.ops.object_reader`, `kvpack.tiers.disk.reads`)
opens, checks and reads every whole object of a batch in one call; anything else goes to
the tier's own single-object read. The outcome of every object must be the Python
reader's, byte for byte and reason for reason: whole objects of several sizes, a missing
file, a tail with token ids, every kind of damage, a symlink, a FIFO, an object whose
openat2 is refused; and a whole object costs no Python-level ``preadv``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import xxhash
from helpers import chunk_id, expect, make_item

from fixtures.os_calls import count_os_calls
from kvpack.identity.objects import Expectation, RejectReason
from kvpack.ops import load_extension, object_reader, object_writer
from kvpack.tiers.base import GetResult, PutItem, TierStatus
from kvpack.tiers.disk import DiskTier
from kvpack.tiers.disk.reads import ObjectReader

SIZES = (1024, 4096, 5000, (64 << 10) + 3, 300_000)
DAMAGES = ("payload_flip", "header_flip", "truncate", "magic", "grown", "symlink", "fifo")


def _reader() -> Callable[[], ObjectReader | None]:
    status = load_extension()
    if not status.available:
        pytest.skip(f"extension unavailable: {status.reason}")
    assert object_reader() is not None
    return object_reader


def _tier(
    root: Path, native: Callable[[], ObjectReader | None] | None, io_threads: int = 1, **natives: object
) -> DiskTier:
    return DiskTier(root, 1 << 30, io_threads=io_threads, object_reader=native, **natives)  # type: ignore[arg-type]


def _damage(tier: DiskTier, item: PutItem, how: str, victim: PutItem) -> None:
    path = tier.path_of(item.key)
    if how == "symlink":
        path.unlink()
        os.symlink(tier.path_of(victim.key), path)
        return
    if how == "fifo":
        path.unlink()
        os.mkfifo(path)
        return
    raw = bytearray(path.read_bytes())
    if how == "payload_flip":
        raw[-10] ^= 0xFF
    elif how == "header_flip":
        raw[40] ^= 0x01
    elif how == "truncate":
        raw = raw[:-100]
    elif how == "magic":
        raw[0:4] = b"PKL\x80"
    elif how == "grown":
        raw += b"\0" * 7
    path.write_bytes(bytes(raw))


def _batch(tier: DiskTier) -> tuple[list[PutItem], list[PutItem]]:
    """(what is read, what was stored): whole objects of every size, one per damage (each
    damaged after the store), a tail with token ids, and a missing object."""
    whole = [make_item("t", chunk_id(10 + i), nbytes=n, seed=i)[0] for i, n in enumerate(SIZES)]
    damaged = [make_item("t", chunk_id(40 + i), nbytes=4096, seed=40 + i)[0] for i in range(len(DAMAGES))]
    tail = make_item("t", chunk_id(70), nbytes=2048, seed=70, token_ids=(1, 2, 3), token_count=3)[0]
    missing = make_item("t", chunk_id(80), seed=80)[0]
    stored = [*whole, *damaged, tail]
    assert tier.put_from(stored) == [TierStatus.OK] * len(stored)
    for item, how in zip(damaged, DAMAGES):
        _damage(tier, item, how, whole[0])
    return [whole[0], *damaged[:3], tail, *whole[1:3], missing, *damaged[3:], *whole[3:]], stored


def _expect(it: PutItem) -> Expectation:
    if it.header.token_ids is None:
        return expect(it)
    h = it.header
    return Expectation(h.fingerprint, h.tenant, h.chunk, h.member, None, h.payload_len, token_ids_prefix=h.token_ids)


def _read(tier: DiskTier, items: Sequence[PutItem], verify: bool = True) -> tuple[list[GetResult], list[np.ndarray]]:
    dsts = [np.zeros(it.header.payload_len, np.uint8) for it in items]
    res = tier.get_into([it.key for it in items], [memoryview(d) for d in dsts], [_expect(it) for it in items], verify)
    return res, dsts


def _outcomes(results: Sequence[GetResult]) -> list[tuple[TierStatus, RejectReason | None]]:
    return [(r.status, r.reason) for r in results]


@pytest.mark.parametrize("io_threads", [1, 2])
def test_every_outcome_is_the_python_readers(tmp_path: Path, io_threads: int) -> None:
    native_reader = _reader()
    py_tier = _tier(tmp_path / "py", None)
    native_tier = _tier(tmp_path / "native", native_reader, io_threads)
    items, _ = _batch(py_tier)
    _batch(native_tier)
    py_res, py_dsts = _read(py_tier, items)
    native_res, native_dsts = _read(native_tier, items)
    assert _outcomes(native_res) == _outcomes(py_res)
    by_chunk = {it.key.chunk: r for it, r in zip(items, native_res)}
    assert sum(r.ok for r in native_res) == len(SIZES) + 1  # the whole ones and the tail
    assert by_chunk[chunk_id(80)].status is TierStatus.MISS
    reasons = [by_chunk[chunk_id(40 + i)].reason for i in range(len(DAMAGES))]
    assert reasons == [
        RejectReason.CHECKSUM,
        RejectReason.HEADER_CHECKSUM,
        RejectReason.TRUNCATED,
        RejectReason.BAD_MAGIC,
        RejectReason.TRUNCATED,
        RejectReason.UNSAFE_FILE,
        RejectReason.UNSAFE_FILE,
    ]
    for it, r, py_dst, dst in zip(items, native_res, py_dsts, native_dsts):
        if r.ok:
            assert np.array_equal(dst, np.frombuffer(it.payload, np.uint8)) and np.array_equal(dst, py_dst)
    # refused files are counted and remembered as by the Python reader
    damaged = [make_item("t", chunk_id(40 + i), nbytes=4096, seed=40 + i)[0].key for i in range(len(DAMAGES))]
    assert native_tier.contains(damaged) == py_tier.contains(damaged)
    assert native_tier.counters.refused_unsafe == py_tier.counters.refused_unsafe == 2


def test_whole_objects_cost_no_python_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = _tier(tmp_path / "store", _reader())
    items = [make_item("t", chunk_id(10 + i), nbytes=n, seed=i)[0] for i, n in enumerate(SIZES)]
    assert tier.put_from(items) == [TierStatus.OK] * len(items)
    calls = count_os_calls(monkeypatch, ("preadv", "pread", "fstat", "close"))
    res, dsts = _read(tier, items)
    assert [r.status for r in res] == [TierStatus.OK] * len(items)
    assert all(np.array_equal(d, np.frombuffer(it.payload, np.uint8)) for it, d in zip(items, dsts))
    assert calls == {"preadv": 0, "pread": 0, "fstat": 0, "close": 0}
    # and the Python reader's calls are what the counter sees (the control)
    res, _ = _read(_tier(tmp_path / "store", None), items)
    assert all(r.ok for r in res) and calls["preadv"] == len(items)


def test_the_checksum_is_checked_only_when_asked(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "store", _reader())
    item = make_item("t", chunk_id(7), nbytes=4096)[0]
    assert tier.put_from([item]) == [TierStatus.OK]
    _damage(tier, item, "payload_flip", item)
    assert _read(tier, [item], verify=False)[0][0].ok  # the negative control: only the checksum catches it
    res = _read(tier, [item], verify=True)[0][0]
    assert res.status is TierStatus.REJECTED and res.reason is RejectReason.CHECKSUM


def test_objects_whose_openat2_is_refused_are_read_from_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    native = _reader()()
    assert native is not None

    def refusing(
        root_fd: int, jobs: Sequence[tuple[bytes, Sequence[memoryview]]], digest_from: int
    ) -> list[tuple[int, int, int, int]]:
        """The native reader as under a seccomp filter refusing openat2 from the second object on."""
        return [*native(root_fd, jobs[:1], digest_from), *[(errno.EPERM, -1, -1, 0)] * (len(jobs) - 1)]

    tier = _tier(tmp_path / "store", lambda: refusing)
    items = [make_item("t", chunk_id(10 + i), nbytes=n, seed=i)[0] for i, n in enumerate(SIZES)]
    assert tier.put_from(items) == [TierStatus.OK] * len(items)
    calls = count_os_calls(monkeypatch, ("preadv",))
    res, dsts = _read(tier, items)
    assert [r.status for r in res] == [TierStatus.OK] * len(items)
    assert all(np.array_equal(d, np.frombuffer(it.payload, np.uint8)) for it, d in zip(items, dsts))
    assert calls["preadv"] == len(items) - 1  # all but the first read again from Python


@pytest.mark.parametrize("writer", ["native", "python"])
def test_more_parts_than_one_vector_call_takes(tmp_path: Path, writer: str) -> None:
    """A payload of 1500 regions (IOV_MAX is 1024): written and read back in several vector calls each."""
    natives = {"object_writer": object_writer} if writer == "native" else {}
    tier = _tier(tmp_path / "store", _reader(), **natives)
    item, data = make_item("t", chunk_id(5), nbytes=1500 * 40, seed=5)
    view = memoryview(data)
    regions = tuple(view[i * 40 : (i + 1) * 40] for i in range(1500))
    assert tier.put_from([PutItem(item.key, item.header, regions)]) == [TierStatus.OK]
    out = np.zeros(1500 * 40, np.uint8)
    out_view = memoryview(out)
    dst = tuple(out_view[i * 40 : (i + 1) * 40] for i in range(1500))
    res = tier.get_into([item.key], [dst], [expect(item)], True)
    assert res[0].ok and np.array_equal(out, data)


def test_the_reader_hashes_each_whole_payload_as_python_xxhash_does(tmp_path: Path) -> None:
    """The digest of a whole read covers exactly the parts from ``digest_from`` on, in order,
    whatever their split; nothing is hashed when not asked or when the read was not whole."""
    native = _reader()()
    assert native is not None
    root = tmp_path / "r"
    root.mkdir()
    bodies = [np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(SIZES)]
    for i, body in enumerate(bodies):
        (root / f"o{i}").write_bytes(b"H" * 64 + body.tobytes())
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:

        def jobs() -> list[tuple[bytes, Sequence[memoryview]]]:
            out: list[tuple[bytes, Sequence[memoryview]]] = []
            for i, body in enumerate(bodies):
                cut = body.nbytes // 3  # the payload in two parts of unequal size
                dst = memoryview(bytearray(body.nbytes))
                out.append((f"o{i}".encode(), (memoryview(bytearray(64)), dst[:cut], dst[cut:])))
            return out

        hashed = native(fd, jobs(), 1)
        assert [d for *_, d in hashed] == [xxhash.xxh3_64_intdigest(b.tobytes()) for b in bodies]
        assert [d for *_, d in native(fd, jobs(), -1)] == [0] * len(bodies)
        # a size that is not the parts' total reads nothing, so hashes nothing
        short = [(p, (parts[0], parts[1])) for p, parts in jobs()]
        assert [(got, d) for _, _, got, d in native(fd, short, 1)] == [(-1, 0)] * len(bodies)
    finally:
        os.close(fd)
